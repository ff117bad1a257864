"""gpt-oss <-> Hugging Face `GptOssForCausalLM` (OpenAI 2025, gpt-oss model card; transformers'
models/gpt_oss).

gpt-oss is a Llama-style MoE model (RoPE or YaRN, RMSNorm, GQA, every layer MoE) with:

    attention   biases on q, k, v and o (`attention_bias`: --add-bias-linear, megalite's
                default); one learned sink logit per head in the softmax (`self_attn.sinks`:
                --softmax-type learnable, `core_attention.softmax_offset`); a sliding window on
                the layers `layer_types` calls "sliding_attention" (--window-size W-1,0 with
                --window-attn-skip-freq: transformers' window of W keys is the query and the
                W-1 before it, Megatron-LM's LEFT counts the keys before the query)
    router      a biased linear (`mlp.router.weight` / `.bias`), softmax over the top-k logits
                (megalite's default softmax routing)
    experts     biased, with a clamped GLU: gate = min(gate, limit), up = clamp(up, ±limit),
                out = (up + 1) · gate · sigmoid(alpha · gate) (--quick-geglu, whose alpha is 1.702,
                --glu-linear-offset 1, --activation-func-clamp-value limit)

Expert weights, fused and transposed in transformers, [gate; up] rows in megalite:

    megalite mlp.experts.local_experts.{e}.        GptOss mlp.experts.
    linear_fc1.weight [2f, h]  ([gate; up])        gate_up_proj[e] [h, 2f]  (columns gate_0, up_0, gate_1, ...)
    linear_fc1.bias   [2f]                         gate_up_proj_bias[e] [2f] (interleaved alike)
    linear_fc2.weight [h, f]                       down_proj[e] [f, h]
    linear_fc2.bias   [h]                          down_proj_bias[e] [h]

What megalite's gpt-oss model may hold that transformers' cannot (dense layers, a shared expert,
other routing, no biases, a GLU without the offset or clamp, a window with RIGHT > 0) is refused,
named; so is a GptOssConfig with another swiglu_alpha or without attention biases.
"""
from __future__ import annotations

import torch

from .tables import Rule, same

GPT_OSS_CLASS = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702  # megalite's quick_gelu (model/mlp.py)


def is_gpt_oss(cfg: dict) -> bool:
    """Whether a megalite model_config is gpt-oss-shaped (its experts run the quick-GeGLU)."""
    return bool(cfg.get("num_experts")) and bool(cfg.get("quick_geglu"))


def gpt_oss_architecture(cfg: dict, refuse) -> str:
    """"gpt_oss", or `refuse(setting, target)` naming what GptOssForCausalLM cannot express."""
    target = GPT_OSS_CLASS
    checks = (
        (cfg["position_embedding_type"] not in ("rope", "yarn"),
         f"--position-embedding-type {cfg['position_embedding_type']} (gpt-oss rotates with RoPE or YaRN)"),
        (cfg["normalization"] != "RMSNorm", f"--normalization {cfg['normalization']}"),
        (cfg.get("rotary_percent", 1.0) != 1.0, f"--rotary-percent {cfg.get('rotary_percent')}"),
        (cfg.get("use_rope_scaling") or cfg.get("rotary_seq_len_interpolation_factor"),
         "Llama 3.1 RoPE scaling or position interpolation"),
        (not cfg["add_bias_linear"], "--disable-bias-linear (gpt-oss's attention, router and experts are biased)"),
        (cfg.get("softmax_type", "vanilla") != "learnable", f"--softmax-type {cfg.get('softmax_type', 'vanilla')} "
         "(gpt-oss's softmax has a learned sink per head)"),
        (cfg.get("glu_linear_offset", 0.0) != 1.0, f"--glu-linear-offset {cfg.get('glu_linear_offset')} (gpt-oss: 1)"),
        (cfg.get("activation_func_clamp_value") is None, "no --activation-func-clamp-value (gpt-oss clamps)"),
        (not all(_moe_pattern(cfg)), f"--moe-layer-freq {cfg.get('moe_layer_freq')} (every gpt-oss layer is MoE)"),
        (cfg.get("moe_shared_expert_intermediate_size"), "--moe-shared-expert-intermediate-size"),
        (cfg.get("moe_router_score_function", "softmax") != "softmax" or cfg.get("moe_router_pre_softmax"),
         "routing other than the softmax over the top-k logits"),
        (cfg.get("moe_router_group_topk"), "--moe-router-group-topk (group-limited routing)"),
        (cfg.get("moe_router_topk_scaling_factor") not in (None, 1.0), "--moe-router-topk-scaling-factor"),
        (cfg.get("moe_router_enable_expert_bias"), "--moe-router-enable-expert-bias"),
        (cfg.get("moe_expert_capacity_factor") is not None, "--moe-expert-capacity-factor (token dropping)"),
        (cfg.get("qk_layernorm"), "--qk-layernorm"),
    )
    for bad, setting in checks:
        if bad:
            refuse(setting, target)
    if cfg.get("window_size") is not None:
        left, right = _window(cfg)
        if right != 0 or left < 0:
            refuse(f"--window-size {cfg['window_size']} (transformers' sliding window looks back only)", target)
    return "gpt_oss"


def _moe_pattern(cfg: dict) -> list[bool]:
    from ...config.moe import moe_layer_pattern
    return moe_layer_pattern(cfg.get("moe_layer_freq", "1"), cfg["num_layers"])


def _window(cfg: dict) -> tuple[int, int]:
    from ...config.model import parse_window_size
    return parse_window_size(cfg["window_size"])


def _layer_types(cfg: dict) -> tuple[list[str], int | None]:
    """(transformers' layer_types, sliding_window) of --window-size / --window-attn-skip-freq."""
    from ...config.model import window_layer_pattern
    if cfg.get("window_size") is None:
        return ["full_attention"] * cfg["num_layers"], None
    windowed = window_layer_pattern(cfg.get("window_attn_skip_freq"), cfg["num_layers"])
    return ["sliding_attention" if w else "full_attention" for w in windowed], _window(cfg)[0] + 1


def gpt_oss_hf_config(cfg: dict, rope_model: dict, transformers_class):
    """The GptOssConfig of a gpt-oss-shaped model_config; `rope_model`: the Llama-style keywords."""
    layer_types, window = _layer_types(cfg)
    return transformers_class("GptOssConfig", GPT_OSS_CLASS)(
        intermediate_size=cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"], num_local_experts=cfg["num_experts"],
        num_experts_per_tok=cfg["moe_router_topk"], attention_bias=True, swiglu_alpha=QUICK_GELU_ALPHA,
        swiglu_limit=float(cfg["activation_func_clamp_value"]), layer_types=layer_types,
        sliding_window=window if window is not None else 128, output_router_logits=False,
        architectures=[GPT_OSS_CLASS], **rope_model)


def gpt_oss_config_from_hf(c, refuse) -> dict:
    """megalite's settings of a GptOssConfig beside the Llama-style ones (which it overrides: no
    SwiGLU, biases everywhere)."""
    if not c.attention_bias:
        refuse("attention_bias false (megalite's --disable-bias-linear would drop the experts' and router's "
               "biases too)")
    if float(c.swiglu_alpha) != QUICK_GELU_ALPHA:
        refuse(f"swiglu_alpha {c.swiglu_alpha} (megalite's --quick-geglu is x·sigmoid({QUICK_GELU_ALPHA}·x))")
    types = list(c.layer_types)
    out = dict(ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
               moe_router_topk=c.num_experts_per_tok, moe_layer_freq="1", add_bias_linear=True, swiglu=False,
               quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=float(c.swiglu_limit),
               softmax_type="learnable", window_size=None, window_attn_skip_freq=None)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        refuse(f"layer_types {unknown}")
    if "sliding_attention" in types:
        if not c.sliding_window or c.sliding_window < 1:
            refuse(f"sliding_window {c.sliding_window} on 'sliding_attention' layers")
        windowed = [t == "sliding_attention" for t in types]
        default = [(i + 1) % 2 != 0 for i in range(len(types))]  # every other layer, as gpt-oss (skip freq 2)
        out.update(window_size=f"{c.sliding_window - 1},0",
                   window_attn_skip_freq="2" if windowed == default else
                   "[" + ",".join(str(int(w)) for w in windowed) + "]")
    return out


def gpt_oss_flags(cfg: dict) -> list:
    """pretrain_gpt.py flags of gpt-oss's attention and MLP variants."""
    flags = ["--quick-geglu", "--glu-linear-offset", cfg["glu_linear_offset"], "--activation-func-clamp-value",
             cfg["activation_func_clamp_value"], "--softmax-type", cfg["softmax_type"]]
    if cfg.get("window_size") is not None:
        flags += ["--window-size", cfg["window_size"]]
        if cfg.get("window_attn_skip_freq") is not None:
            flags += ["--window-attn-skip-freq", cfg["window_attn_skip_freq"]]
    return flags


# -- weights ---------------------------------------------------------------------------------------
def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[f, ...] gate rows and [f, ...] up rows -> [2f, ...] as gate_0, up_0, gate_1, up_1, ..."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.size(0), *gate.shape[1:])


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The inverse of _interleave: [2f, ...] gate_0, up_0, ... -> [gate; up]."""
    return torch.cat([x[0::2], x[1::2]])


def gpt_oss_mlp_rules(cfg: dict) -> list[Rule]:
    """The name table of one gpt-oss MLP, under `mlp.` on both sides: the biased router, and each of
    the experts' four tensors stacked into one there (fc1's rows interleaved, weights transposed)."""
    def experts(name: str) -> tuple[str, ...]:
        return tuple(f"experts.local_experts.{e}.{name}" for e in range(cfg["num_experts"]))

    def stacked(name: str, theirs: str, out, back) -> Rule:
        return Rule(experts(name), (theirs,), lambda ts: [torch.stack([out(t) for t in ts])],
                    lambda t: [back(x) for x in t[0]])

    return [same("router.weight", "router.weight"), same("router.bias", "router.bias"),
            stacked("linear_fc1.weight", "experts.gate_up_proj", lambda w: _interleave(*w.chunk(2)).t(),
                    lambda w: _deinterleave(w.t())),
            stacked("linear_fc1.bias", "experts.gate_up_proj_bias", lambda b: _interleave(*b.chunk(2)), _deinterleave),
            stacked("linear_fc2.weight", "experts.down_proj", lambda w: w.t(), lambda w: w.t()),
            stacked("linear_fc2.bias", "experts.down_proj_bias", lambda b: b, lambda b: b)]
