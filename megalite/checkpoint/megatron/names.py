"""megalite's parameter names <-> megatron-core's sharded (global) checkpoint keys. Torch-free.

megalite names its parameters as megatron-core's local layer spec does, one module per layer
(`decoder.layers.3.self_attention.linear_qkv.weight`, experts
`decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`). A torch_dist checkpoint stacks
the layers (and the experts) along leading axes of one global tensor per key, and names the
norms that Transformer Engine fuses into the next linear layer by that layer:

    megalite decoder.layers.{i}.          Megatron-LM key, index
    input_layernorm.{weight,bias}         decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias} [i]
    pre_mlp_layernorm.{weight,bias}       decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias} [i]
                                          (a TE-spec MoE layer: decoder.layers.pre_mlp_layernorm.* [i])
    mlp.experts.local_experts.{e}.REST    decoder.layers.mlp.experts.experts.REST [i, e]
    REST                                  decoder.layers.REST [i]
    (outside the layers: the same name, no index)

The tensors' own layouts agree, so nothing is permuted: the fused QKV rows are grouped by query
group, [ng, (np/ng q, k, v), hn] in both (megatron-core's SelfAttention), and the global SwiGLU fc1
is [gate; up] in both (megatron-core's `apply_swiglu_sharded_factory` stores each TP rank's gate
and up rows at their global offsets). Moments of a non-distributed optimizer are stored under
`optimizer.state.<kind>.<key>` with the parameter's global shape (`MOMENT_PREFIXES`).
"""
from __future__ import annotations

import re

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# megalite's norm before attention / before the MLP -> the keys megatron-core saves it under,
# the first megatron-core's own specs use (local and TE), the others older or TE MoE ones
_NORMS = {
    "input_layernorm": ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    "pre_mlp_layernorm": ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
}
# megalite's optimizer-state kinds -> the prefix of a non-distributed Megatron optimizer's keys
MOMENT_PREFIXES = {"exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq.",
                   "momentum_buffer": "optimizer.state.momentum_buffer.", "master": "optimizer.state.fp32_param."}


def megatron_keys(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """Candidate (global key, leading index) pairs for megalite parameter `name`, preferred first;
    the reader takes the first whose saved chunks hold that index."""
    m = _LAYER.match(name)
    if m is None:
        return [(name, ())]
    layer, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        return [(f"decoder.layers.mlp.experts.experts.{e.group(2)}", (layer, int(e.group(1))))]
    module, _, kind = rest.rpartition(".")
    if module in _NORMS:
        fused, own = _NORMS[module]
        return [(f"decoder.layers.{fused}{kind}", (layer,)), (f"decoder.layers.{own}{kind}", (layer,))]
    return [(f"decoder.layers.{rest}", (layer,))]


def megalite_name(key: str, index: tuple[int, ...]) -> str | None:
    """The megalite parameter at `index` of global key `key` (inverse of megatron_keys); None for
    keys that are no parameter (optimizer state, objects)."""
    if key.startswith("optimizer.") or "_extra_state" in key or key == "rng_state":
        return None
    if not key.startswith("decoder.layers."):
        return key
    rest = key[len("decoder.layers."):]
    if rest.startswith("mlp.experts.experts."):
        layer, expert = index
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{rest[len('mlp.experts.experts.'):]}"
    for module, (fused, own) in _NORMS.items():
        for prefix in (fused, own):
            if rest.startswith(prefix):
                return f"decoder.layers.{index[0]}.{module}.{rest[len(prefix):]}"
    return f"decoder.layers.{index[0]}.{rest}"


def index_depth(key: str) -> int:
    """How many leading axes of `key`'s global tensor index layers (and experts)."""
    if not key.startswith("decoder.layers."):
        return 0
    return 2 if key.startswith("decoder.layers.mlp.experts.experts.") else 1
