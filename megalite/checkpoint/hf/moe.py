"""Mixture-of-Experts models <-> Hugging Face: `MixtralForCausalLM`, `Qwen2MoeForCausalLM` and
`Qwen3MoeForCausalLM`.

All are Llama-style models (RoPE, RMSNorm, SwiGLU, GQA; config.py maps those) whose MLP is,
in some or all layers, a top-k routed set of SwiGLU experts (model/moe/):

    Mixtral     every layer MoE; softmax over the experts, top-k, renormalised, which is
                megalite's default softmax over the k largest logits; no shared expert, no biases
    Qwen2-MoE   MoE in the layers that `mlp_only_layers` / `decoder_sparse_step` leave sparse
                (--moe-layer-freq as a list of 0/1 per layer); a shared expert gated by
                sigmoid(x · w) (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate);
                `norm_topk_prob` false is --moe-router-pre-softmax (top-k of the softmax, not
                renormalised), true the renormalised softmax; q/k/v biases (`qkv_bias`,
                --add-qkv-bias)
    Qwen3-MoE   Qwen2-MoE's routing and dense layers, without the shared expert or any bias, with
                --qk-layernorm (`self_attn.q_norm` / `k_norm`, mapped in conversion.py); its
                head_dim may differ from hidden / heads (--kv-channels)

Weights, per MoE layer (rows of an expert's fc1 are [gate; up], as the dense SwiGLU MLP's):

    megalite mlp.                                 Mixtral block_sparse_moe.   Qwen2-MoE / Qwen3-MoE mlp.
    router.weight                       [E, h]    gate.weight                 gate.weight
    experts.local_experts.{e}.linear_fc1 [2f, h]  experts.{e}.w1 ; .w3        experts.{e}.gate_proj ; .up_proj
    experts.local_experts.{e}.linear_fc2 [h, f]   experts.{e}.w2              experts.{e}.down_proj
    shared_experts.linear_fc1 / fc2                                           shared_expert.gate_proj ; up ; down
    shared_experts.gate_weight          [1, h]                                shared_expert_gate.weight
                                                                              (the shared expert: Qwen2-MoE only)

transformers 5 holds the experts fused in memory (`mlp.experts.gate_up_proj` [E, 2f, h],
`mlp.experts.down_proj` [E, h, f]) and writes the per-expert names above, which transformers 4
reads too; the import takes either. Router training settings (load-balancing loss, z-loss) are not
part of the function and do not travel: transformers' `router_aux_loss_coef` is normalised
differently (over all layers at once, without the 1/k), so --moe-aux-loss-coeff is given anew when
training continues. What changes the function and has no Hugging Face counterpart (sigmoid scores,
expert bias, a capacity factor, sliding windows, router jitter) is refused with the setting named.
"""
from __future__ import annotations

from ...config.moe import moe_layer_pattern
from .gpt_oss import GPT_OSS_CLASS, gpt_oss_flags, gpt_oss_hf_config, gpt_oss_mlp_rules
from .tables import Rule, expert_rules, glu, same, unfuse_experts

HF_MOE_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": GPT_OSS_CLASS}  # gpt-oss: gpt_oss.py


def moe_pattern(cfg: dict) -> list[bool]:
    """Per layer, whether it is an MoE layer (all False for a dense model)."""
    if not cfg.get("num_experts"):
        return [False] * cfg["num_layers"]
    return moe_layer_pattern(cfg.get("moe_layer_freq", "1"), cfg["num_layers"])


# -- which architecture, and the configs both ways --------------------------------------------------
def moe_architecture(cfg: dict, refuse) -> str:
    """"mixtral", "qwen2_moe" or "qwen3_moe" for an MoE model_config that is otherwise Llama-like;
    `refuse(setting, target)` raises naming what cannot be expressed."""
    target = "MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM"
    if cfg["add_bias_linear"]:
        refuse("--num-experts without --disable-bias-linear (biases on every linear layer)", target)
    if cfg.get("moe_router_score_function", "softmax") != "softmax":
        refuse(f"--moe-router-score-function {cfg['moe_router_score_function']} (their routers use softmax)", target)
    if cfg.get("moe_router_group_topk"):
        refuse(f"--moe-router-group-topk {cfg['moe_router_group_topk']} (group-limited routing; their routers "
               "choose among all experts)", target)
    if cfg.get("moe_router_topk_scaling_factor") not in (None, 1.0):
        refuse(f"--moe-router-topk-scaling-factor {cfg['moe_router_topk_scaling_factor']} (their routers do not "
               "scale the probabilities)", target)
    if cfg.get("moe_expert_capacity_factor") is not None:
        refuse(f"--moe-expert-capacity-factor {cfg['moe_expert_capacity_factor']} (token dropping; their MoE "
               "layers are dropless)", target)
    pattern = moe_pattern(cfg)
    if cfg.get("qk_layernorm"):  # Qwen3-MoE: QK-norm, no shared expert; dense layers and either top-k
        qwen3 = "Qwen3MoeForCausalLM (the MoE model with --qk-layernorm)"
        if cfg.get("moe_shared_expert_intermediate_size"):
            refuse("--moe-shared-expert-intermediate-size with --qk-layernorm (Qwen3-MoE has no shared expert, "
                   "Qwen2-MoE no QK-norm)", qwen3)
        if cfg.get("add_qkv_bias"):
            refuse("--add-qkv-bias with --qk-layernorm (Qwen3-MoE's attention_bias puts a bias on the output "
                   "projection too)", qwen3)
        return "qwen3_moe"
    if cfg.get("moe_shared_expert_intermediate_size"):
        qwen = "Qwen2MoeForCausalLM (the MoE model with a shared expert)"
        if not cfg.get("moe_shared_expert_gate"):
            refuse("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate", qwen)
        if cfg["kv_channels"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
            refuse(f"--kv-channels {cfg['kv_channels']} != --hidden-size / --num-attention-heads (Qwen2MoeConfig "
                   "has no head_dim in transformers 4)", qwen)
        return "qwen2_moe"
    mixtral = "MixtralForCausalLM (the MoE model without a shared expert)"
    if cfg.get("moe_router_pre_softmax"):
        refuse("--moe-router-pre-softmax without a shared expert (Mixtral renormalises the top-k probabilities)",
               mixtral)
    if not all(pattern):
        refuse(f"--moe-layer-freq {cfg.get('moe_layer_freq')} (dense layers) without a shared expert "
               "(every Mixtral layer is MoE)", mixtral)
    if cfg.get("add_qkv_bias"):
        refuse("--add-qkv-bias without a shared expert (Mixtral's attention has no biases)", mixtral)
    return "mixtral"


def moe_hf_config(cfg: dict, arch: str, rope_model: dict, transformers_class):
    """The MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig of an MoE model_config; `rope_model`: the
    keyword arguments every Llama-style config shares (sizes, heads, RoPE, norms, vocabulary);
    `transformers_class(name, architecture)`: config.py's look-up of a class a transformers may lack
    (passed in, as `refuse` elsewhere here: config.py imports this module)."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    if arch == "gpt_oss":
        return gpt_oss_hf_config(cfg, rope_model, transformers_class)
    expert_ffn = cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    routing = dict(num_experts_per_tok=cfg["moe_router_topk"], output_router_logits=False)
    if arch == "mixtral":
        return MixtralConfig(intermediate_size=expert_ffn, num_local_experts=cfg["num_experts"], sliding_window=None,
                             router_jitter_noise=0.0, architectures=[HF_MOE_CLASSES[arch]], **routing, **rope_model)
    dense = [i for i, moe in enumerate(moe_pattern(cfg)) if not moe]
    sparse = dict(intermediate_size=cfg["ffn_hidden_size"], moe_intermediate_size=expert_ffn,
                  num_experts=cfg["num_experts"], norm_topk_prob=not cfg.get("moe_router_pre_softmax"),
                  decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False,
                  architectures=[HF_MOE_CLASSES[arch]], **routing)
    if arch == "qwen3_moe":
        return transformers_class("Qwen3MoeConfig", HF_MOE_CLASSES[arch])(attention_bias=False, **sparse, **rope_model)
    rope_model = {k: v for k, v in rope_model.items() if k != "head_dim"}  # hidden / heads (checked)
    return Qwen2MoeConfig(shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                          qkv_bias=bool(cfg.get("add_qkv_bias")), **sparse, **rope_model)


def moe_config_from_hf(c, refuse) -> dict:
    """megalite's MoE settings (and the MLP, bias and QK-norm settings that go with them) of a
    MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig; `refuse(what)` raises naming the field."""
    if c.model_type == "mixtral":
        if getattr(c, "router_jitter_noise", 0.0):
            refuse(f"router_jitter_noise {c.router_jitter_noise} (megalite's router adds no noise)")
        window = getattr(c, "sliding_window", None)
        if window is not None and window < c.max_position_embeddings:
            refuse(f"sliding_window {window} < max_position_embeddings {c.max_position_embeddings} "
                   "(megalite attends to every earlier position)")
        return dict(ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    moe_router_topk=c.num_experts_per_tok, moe_layer_freq="1", add_qkv_bias=False)
    if getattr(c, "use_sliding_window", False) or "sliding_attention" in (getattr(c, "layer_types", None) or []):
        refuse("use_sliding_window / layer_types 'sliding_attention' (the import does not map Hugging Face's "
               "sliding windows to --window-size)")
    if not c.num_experts:
        refuse("num_experts 0 (a dense model)")
    only = set(getattr(c, "mlp_only_layers", None) or [])
    pattern = [i not in only and (i + 1) % c.decoder_sparse_step == 0 for i in range(c.num_hidden_layers)]
    if not any(pattern):
        refuse(f"no sparse layer (decoder_sparse_step {c.decoder_sparse_step}, mlp_only_layers {sorted(only)})")
    sparse = dict(ffn_hidden_size=c.intermediate_size, num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
                  moe_ffn_hidden_size=c.moe_intermediate_size,
                  moe_layer_freq="1" if all(pattern) else "[" + ",".join(str(int(m)) for m in pattern) + "]",
                  moe_router_pre_softmax=not c.norm_topk_prob)
    if c.model_type == "qwen3_moe":  # its attention (QK-norm, no biases) is checked in config.py
        return dict(sparse, qk_layernorm=True, add_qkv_bias=False)
    if not c.shared_expert_intermediate_size:
        refuse("shared_expert_intermediate_size 0 (--moe-shared-expert-intermediate-size must be >= 1)")
    return dict(sparse, moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
                add_qkv_bias=bool(getattr(c, "qkv_bias", True)))  # transformers 4: always biased


def moe_flags(cfg: dict) -> list:
    """pretrain_gpt.py flags of the MoE settings (and --add-qkv-bias)."""
    flags = ["--add-qkv-bias"] if cfg.get("add_qkv_bias") else []
    if cfg.get("quick_geglu"):  # gpt-oss's attention and MLP variants
        flags += gpt_oss_flags(cfg)
    if not cfg.get("num_experts"):
        return flags
    flags += ["--num-experts", cfg["num_experts"], "--moe-router-topk", cfg["moe_router_topk"]]
    if cfg.get("moe_ffn_hidden_size"):
        flags += ["--moe-ffn-hidden-size", cfg["moe_ffn_hidden_size"]]
    if str(cfg.get("moe_layer_freq", "1")) != "1":
        flags += ["--moe-layer-freq", cfg["moe_layer_freq"]]
    if cfg.get("moe_router_pre_softmax"):
        flags.append("--moe-router-pre-softmax")
    if cfg.get("moe_shared_expert_intermediate_size"):
        flags += ["--moe-shared-expert-intermediate-size", cfg["moe_shared_expert_intermediate_size"]]
    if cfg.get("moe_shared_expert_gate"):
        flags.append("--moe-shared-expert-gate")
    return flags


# -- weights of one MoE layer's MLP -----------------------------------------------------------------
# (expert fc1's gate rows, its up rows, fc2) by architecture
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def moe_mlp_rules(cfg: dict, arch: str) -> list[Rule]:
    """The name table of one MoE layer's MLP, under megalite's `mlp.` and the prefix that
    `moe_prefix` gives there: router, experts, and Qwen2-MoE's gated shared expert."""
    if arch == "gpt_oss":
        return gpt_oss_mlp_rules(cfg)
    rules = [same("router.weight", "gate.weight")] + expert_rules(cfg["num_experts"], *EXPERT_NAMES[arch])
    if arch == "qwen2_moe":
        rules += [glu("shared_experts.linear_fc1.weight", "shared_expert.gate_proj.weight",
                      "shared_expert.up_proj.weight"),
                  same("shared_experts.linear_fc2.weight", "shared_expert.down_proj.weight"),
                  same("shared_experts.gate_weight", "shared_expert_gate.weight")]
    return rules


def moe_prefix(cfg: dict, arch: str, hf: dict | None = None, h: str = "") -> str:
    """Where a layer's MoE MLP lies in Hugging Face's names: Mixtral's `block_sparse_moe.` (what the
    export writes, and transformers 4 reads), else `mlp.`. On import (`hf`, layer prefix `h`) the
    one present, with transformers 5's fused experts split into the per-expert names (tables.py)."""
    if hf is None:
        return "block_sparse_moe." if arch == "mixtral" else "mlp."
    prefix = "block_sparse_moe." if arch == "mixtral" and h + "block_sparse_moe.gate.weight" in hf else "mlp."
    if arch in EXPERT_NAMES:
        unfuse_experts(hf, h + prefix, cfg["num_experts"], *EXPERT_NAMES[arch])
    return prefix
