"""The pre-norm transformer layer and the stack of layers one pipeline stage owns.

    x = x + Dropout(Attention(Norm(x)))          (GPT-2 / Megatron-LM pre-LN ordering)
    x = x + Dropout(MLP(Norm(x)))
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..recompute import recompute
from .attention import SelfAttention
from .config import ExecutionConfig, GPTConfig
from .mla import MLASelfAttention
from .mlp import MLP
from .moe import MoELayer
from .norm import Norm
from .offload import attach_offloading


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, layer_number: int = 0,
                 device=None, cp_group=None, ep_group=None, token_group=None, etp_group="tp", moe: bool | None = None):
        """`moe`: an MoE MLP or a dense one; default: as --moe-layer-freq says of `layer_number`."""
        super().__init__()
        self.layer_number = layer_number  # global, 0-based: names and init depend on it
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = execution.sequence_parallel
        self.rng_tracker = rng_tracker
        self.input_layernorm = Norm(config, execution, device)
        attention = MLASelfAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, execution, tp_group, rng_tracker, device, cp_group,
                                            layer_number)
        self.pre_mlp_layernorm = Norm(config, execution, device)
        self.mlp = (MoELayer(config, execution, tp_group, ep_group, token_group, device, etp_group)
                    if (config.is_moe_layer(layer_number) if moe is None else moe)
                    else MLP(config, execution, tp_group, device))
        self.recompute_parts: set = set()  # --recompute-modules (select_recompute)

    def select_recompute(self, modules) -> None:
        """--recompute-modules: which parts of this layer keep only their inputs and redo their
        forward in backward (Megatron-LM's selective recompute; the same gradients)."""
        self.recompute_parts = set()
        if "core_attn" in modules:
            self.self_attention.recompute_core_attention = True
        if "layernorm" in modules:
            self.recompute_parts |= {self.input_layernorm, self.pre_mlp_layernorm}
        moe = isinstance(self.mlp, MoELayer)
        if ("mlp" in modules and not moe) or ("moe" in modules and moe):
            self.recompute_parts.add(self.mlp)
        if moe:
            self.mlp.recompute_shared = "shared_experts" in modules
            self.mlp.experts.recompute_activation = "moe_act" in modules
        if "mla_up_proj" in modules and hasattr(self.self_attention, "recompute_up_proj"):
            self.self_attention.recompute_up_proj = True

    def _part(self, module, x):
        if module in self.recompute_parts and self.training and torch.is_grad_enabled():
            return recompute(module, x, rng_tracker=self.rng_tracker)
        return module(x)

    def _dropout(self, x):
        if not self.training or self.hidden_dropout == 0:
            return x
        # sequence-parallel activations are different tokens on each TP rank: different masks
        fork = self.rng_tracker.fork() if self.sequence_parallel else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.hidden_dropout, training=True)

    def forward(self, x, rotary=None, attention_mask=None):
        # x: [s, b, h] ([s/tp, b, h] under sequence parallelism)
        x = x + self._dropout(self.self_attention(self._part(self.input_layernorm, x), rotary, attention_mask))
        return x + self._dropout(self._part(self.mlp, self._part(self.pre_mlp_layernorm, x)))


class TransformerBlock(nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the model, plus the final norm on the
    last pipeline stage."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, layer_offset: int = 0,
                 num_layers: int | None = None, post_process: bool = True, device=None, cp_group=None, ep_group=None,
                 token_group=None, etp_group="tp"):
        super().__init__()
        n = config.num_layers if num_layers is None else num_layers
        self.layer_offset, self.rng_tracker = layer_offset, rng_tracker
        self.recompute_granularity = execution.recompute_granularity
        self.recompute_method, self.recompute_num_layers = execution.recompute_method, execution.recompute_num_layers
        self.layers = nn.ModuleList(
            TransformerLayer(config, execution, tp_group, rng_tracker, layer_offset + i, device, cp_group, ep_group,
                             token_group, etp_group) for i in range(n))
        if self.recompute_granularity == "selective":
            for layer in self.layers:
                layer.select_recompute(execution.recompute_modules)
        # --fine-grained-activation-offloading (hooks held by the modules: no cycle to break)
        attach_offloading(self.layers, execution.offload_modules)
        self.final_layernorm = Norm(config, execution, device) if post_process else None

    def _run(self, start: int, end: int):
        def fn(x, rotary_cos, rotary_sin, attention_mask):
            rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
            for layer in self.layers[start:end]:
                x = layer(x, rotary, attention_mask)
            return x
        return fn

    def forward(self, x, rotary=None, attention_mask=None):
        cos, sin = rotary if rotary is not None else (None, None)
        n = len(self.layers)
        if self.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            k = self.recompute_num_layers
            if self.recompute_method == "uniform":
                # checkpoint the input of every chunk of k layers; recompute the chunk in backward
                for start in range(0, n, k):
                    x = recompute(self._run(start, min(start + k, n)), x, cos, sin, attention_mask,
                                  rng_tracker=self.rng_tracker)
            else:  # "block": recompute the first k layers of this stage, keep the rest
                for i in range(n):
                    fn = self._run(i, i + 1)
                    x = (recompute(fn, x, cos, sin, attention_mask, rng_tracker=self.rng_tracker)
                         if i < k else fn(x, cos, sin, attention_mask))
        else:
            x = self._run(0, n)(x, cos, sin, attention_mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x
