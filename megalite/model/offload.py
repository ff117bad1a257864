"""--fine-grained-activation-offloading with --offload-modules (Megatron-LM's): what chosen parts of
each layer save for backward is kept in host memory instead of the accelerator's, copied back when
backward needs it (torch.autograd.graph.save_on_cpu, entered for the part's forward by hooks). It
changes where activations live, never their values. On the CPU they are in host memory already:
nothing is moved.

Megatron-LM's names -> megalite's modules: attn_norm (input_layernorm), mlp_norm
(pre_mlp_layernorm), qkv_linear (linear_qkv; MLA's q/kv projections), core_attn (core_attention),
attn_proj (linear_proj), expert_fc1 and moe_act (the routed experts, whole: their fc1 input and
activation, with fc2's input too)."""
from __future__ import annotations

import torch
from torch import nn

_QKV = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj")


def _targets(layer: nn.Module, names) -> list[nn.Module]:
    attention = layer.self_attention
    out = []
    for name in names:
        if name == "attn_norm":
            out.append(layer.input_layernorm)
        elif name == "mlp_norm":
            out.append(layer.pre_mlp_layernorm)
        elif name == "qkv_linear":
            out += [getattr(attention, q) for q in _QKV if getattr(attention, q, None) is not None]
        elif name == "core_attn":
            out.append(attention.core_attention)
        elif name == "attn_proj":
            out.append(attention.linear_proj)
        elif name in ("expert_fc1", "moe_act") and hasattr(layer.mlp, "experts"):
            out.append(layer.mlp.experts)
    return list(dict.fromkeys(out))


def attach_offloading(layers, names) -> list:
    """Hooks on each layer's chosen parts that keep what they save for backward in pinned host
    memory while training on an accelerator; returns the hook handles."""
    handles = []
    for layer in layers:
        for module in _targets(layer, names):
            handles += _hook(module)
    return handles


def _hook(module: nn.Module) -> list:
    stack = []

    def enter(m, inputs):
        x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
        if m.training and torch.is_grad_enabled() and x is not None and x.device.type != "cpu":
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
            ctx.__enter__()
            stack.append(ctx)
        else:
            stack.append(None)

    def leave(m, inputs, out):
        ctx = stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
