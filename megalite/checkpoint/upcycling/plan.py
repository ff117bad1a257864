"""--moe-use-upcycling, the plan: which dense weight each MoE weight starts from, and the scale
(torch-free: validation reads it before torch is imported; load.py beside it does the loading).

Sparse upcycling (Komatsuzaki et al. 2022) starts an MoE model from a dense checkpoint: every
weight the two share is copied, each expert of an MoE layer starts as the layer's dense MLP,
and the router (absent from the dense model) keeps its own initialisation. Granular upcycling
(He et al. 2024, arXiv:2410.07524; --moe-upcycling-granularity g) cuts the dense MLP's hidden
units into g slices: expert e is slice e mod g of the dense MLP (fc1's rows, fc2's columns;
SwiGLU's gate and up halves sliced alike), so each run of g consecutive experts holds the
whole MLP, and the router's rows repeat in runs of g (row e is the initial row e // g) so a
run's experts tie and are chosen together. This is Megatron-LM's upcycling_utils.

Function at step 0. With g = 1 and weights that sum to 1 over the chosen experts (softmax after
the top-k, the default; sigmoid with k > 1), y = sum_k p_k MLP(x) = MLP(x): the dense model's
function exactly. Otherwise Megatron-LM scales fc1 and fc2 (fc1's bias too) by s^(1/3) for a
gated or squared-ReLU MLP and s^(1/2) otherwise, with the activation scale s = g (the g slices of
a run each weighted ~1/g) or, with --moe-router-pre-softmax, s = E·g/k (a near-uniform router
gives each chosen expert ~1/E): exact only for a positively homogeneous activation and a
uniform router, so an approximation; `step0_differences` lists every reason the step-0
function is not the dense one, and the run prints them."""
from __future__ import annotations

import re

# an expert weight of an MoE layer, and the dense weight it starts from
EXPERT_PARAM = re.compile(r"^(?P<layer>.*\.mlp\.)experts\.local_experts\.(?P<expert>\d+)\."
                          r"(?P<linear>linear_fc[12])\.(?P<kind>weight|bias)$")
ROUTER_WEIGHT = re.compile(r"\.mlp\.router\.weight$")


def dense_source(name: str) -> tuple[str, int, str, str] | None:
    """(dense parameter name, expert index, linear_fc1|linear_fc2, weight|bias) of an expert
    parameter; None for any other parameter (copied under its own name, or kept as initialised)."""
    m = EXPERT_PARAM.match(name)
    if m is None:
        return None
    return (f"{m['layer']}{m['linear']}.{m['kind']}", int(m["expert"]), m["linear"], m["kind"])


def activation_scale(model: dict, granularity: int) -> float:
    """Megatron-LM's moe_activation_scale: how much smaller the MoE output starts than the dense
    one, which the weight scale undoes (arXiv:2410.07524, Sec. 3)."""
    if model.get("moe_router_pre_softmax"):
        return model["num_experts"] * granularity / model["moe_router_topk"]
    return float(granularity)


def weight_scale(model: dict, granularity: int) -> float:
    """The factor on the experts' fc1 and fc2 weights (and fc1's bias): the activation scale's
    cube root for a gated MLP (two factors meet in gate x up, one more in fc2), else its square
    root (one in fc1, one in fc2)."""
    s = activation_scale(model, granularity)
    return s ** (1 / 3) if model.get("swiglu") or model.get("quick_geglu") else s ** 0.5


def dense_ffn_problem(dense: dict, moe: dict, granularity: int) -> str | None:
    """Why the MoE run's sizes cannot come from this dense checkpoint, or None. `dense`, `moe`:
    model configs (GPTConfig.to_dict())."""
    from ...config.moe import moe_layer_pattern
    F = dense["ffn_hidden_size"]
    expert = moe.get("moe_ffn_hidden_size") or moe["ffn_hidden_size"]
    E = moe["num_experts"]
    if expert * granularity != F:
        return (f"the experts' hidden size ({expert}, --moe-ffn-hidden-size or --ffn-hidden-size) x "
                f"--moe-upcycling-granularity ({granularity}) must be the dense checkpoint's --ffn-hidden-size ({F})")
    if E % granularity:
        return f"--num-experts ({E}) is not divisible by --moe-upcycling-granularity ({granularity})"
    dense_layers = not all(moe_layer_pattern(moe.get("moe_layer_freq", 1), moe["num_layers"]))
    if dense_layers and moe["ffn_hidden_size"] != F:
        return (f"the layers --moe-layer-freq leaves dense are copied from the checkpoint, so --ffn-hidden-size "
                f"({moe['ffn_hidden_size']}) must be its {F} (the experts' size is --moe-ffn-hidden-size)")
    return None


def step0_differences(model: dict, granularity: int) -> list[str]:
    """Why the upcycled model's function at step 0 is not exactly the dense model's (empty: it is)."""
    out = []
    E, k = model["num_experts"], model["moe_router_topk"]
    scale = weight_scale(model, granularity)
    if scale != 1.0:
        why = f"--moe-upcycling-granularity {granularity}" if granularity > 1 else ""
        if model.get("moe_router_pre_softmax"):
            why += (" and " if why else "") + f"--moe-router-pre-softmax (the {k} chosen of {E} probabilities sum to "\
                                               "less than 1)"
        out.append(f"the experts' fc1 and fc2 are scaled by {scale:.6g} for {why} (Megatron-LM's "
                   "arXiv:2410.07524 scaling; exact only for a uniform router and a homogeneous activation)")
    if model.get("moe_router_score_function") == "sigmoid" and k == 1:
        out.append("--moe-router-score-function sigmoid with --moe-router-topk 1 weights each token's expert by "
                   "sigmoid(logit) < 1")
    if model.get("moe_router_topk_scaling_factor") not in (None, 1.0):
        out.append(f"--moe-router-topk-scaling-factor {model['moe_router_topk_scaling_factor']} scales the experts' "
                   "output")
    if model.get("moe_shared_expert_intermediate_size"):
        out.append("the shared expert (--moe-shared-expert-intermediate-size) starts from its own initialisation "
                   "and adds to the experts' output")
    if model.get("moe_expert_capacity_factor") is not None:
        out.append("--moe-expert-capacity-factor drops the tokens over an expert's capacity")
    return out
