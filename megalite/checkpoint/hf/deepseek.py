"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: multi-latent attention (model/mla.py) with
DeepSeek-V3's MoE (sigmoid routing with an expert bias, group-limited top-k, a scaling factor, a
shared expert, the first layers dense).

    megalite                               DeepseekV3ForCausalLM (model.layers.{i}.)
    self_attention.linear_q_proj           self_attn.q_proj                (no --q-lora-rank)
    self_attention.linear_q_down_proj      self_attn.q_a_proj
    self_attention.q_layernorm             self_attn.q_a_layernorm
    self_attention.linear_q_up_proj        self_attn.q_b_proj
    self_attention.linear_kv_down_proj     self_attn.kv_a_proj_with_mqa
    self_attention.kv_layernorm            self_attn.kv_a_layernorm
    self_attention.linear_kv_up_proj       self_attn.kv_b_proj
    self_attention.linear_proj             self_attn.o_proj
    mlp.router.weight / .expert_bias       mlp.gate.weight / .e_score_correction_bias
    mlp.experts.local_experts.{e}.*        mlp.experts.{e}.gate_proj ; up_proj ; down_proj
    mlp.shared_experts.linear_fc1 / fc2    mlp.shared_experts.gate_proj ; up_proj ; down_proj

Settings: first_k_dense_replace k is --moe-layer-freq [0]*k+[1]*(L-k); n_group / topk_group are
--moe-router-num-groups / --moe-router-group-topk (transformers scores a group by its top 2
experts, Megatron-LM by its top k / group_topk: the two agree when k / group_topk = 2, which is
checked); routed_scaling_factor is --moe-router-topk-scaling-factor; norm_topk_prob is megalite's
sigmoid normalisation (over the k chosen when k > 1); n_shared_experts x moe_intermediate_size is
--moe-shared-expert-intermediate-size. The latent norms always exist there: --qk-layernorm, with
their epsilon fixed at 1e-6 (--norm-epsilon 1e-6).

RoPE: DeepSeek lays each head's rotary channels out in interleaved pairs (rope_interleave true,
the default, and what the export writes); megalite rotates halves, so the rotary rows of q_proj /
q_b_proj and kv_a_proj_with_mqa are permuted (evens first, then odds) on the way in and back out.
YaRN: transformers' rope_type "yarn" with mscale / mscale_all_dim, whose mscale_all_dim also scales
the softmax (m² / √(d + dr)); MLA's --rope-type yarn.

Multi-token prediction (model/mtp.py): num_nextn_predict_layers D is --mtp-num-layers, and module
k is stored as DeepSeek-V3's checkpoint stores it (vLLM's deepseek_mtp.py and transformers'
MtpModel read it; DeepseekV3ForCausalLM skips it), as one more decoder layer:

    mtp.layers.{k}.enorm / hnorm / eh_proj   model.layers.{L + k}.enorm / hnorm / eh_proj
    mtp.layers.{k}.transformer_layer.*       model.layers.{L + k}.self_attn.* / mlp.* / *_layernorm
    mtp.layers.{k}.final_layernorm           model.layers.{L + k}.shared_head.norm
    (shared with the main model)             model.layers.{L + k}.embed_tokens / shared_head.head

eh_proj's input is [enorm(emb); hnorm(h)] on both sides. The copies of the embedding and output
layer are written on export and, on import, must equal the main model's when present.
"""
from __future__ import annotations

import math

import torch

from ...config.moe import moe_layer_pattern
from .tables import Rule, expert_rules, export_tensors, glu, import_tensors, mapped, same, under, unfuse_experts

DEEPSEEK_CLASS = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm / kv_a_layernorm keep
_OUTER_RULES = [same("embedding.word_embeddings.weight", "embed_tokens.weight"),
                same("decoder.final_layernorm.weight", "norm.weight")]  # the output layer aside
# an MTP module's own weights: megalite's under mtp.layers.{k}., DeepSeek-V3's under model.layers.{L + k}.
MTP_RULES = [same("enorm.weight", "enorm.weight"), same("hnorm.weight", "hnorm.weight"),
             same("eh_proj.weight", "eh_proj.weight"), same("final_layernorm.weight", "shared_head.norm.weight")]


def _mla_names(cfg: dict) -> list[tuple[str, str]]:
    """(megalite, Hugging Face) names of one layer's MLA weights, under self_attention. / self_attn."""
    q = ([("linear_q_proj.weight", "q_proj.weight")] if cfg.get("q_lora_rank") is None else
         [("linear_q_down_proj.weight", "q_a_proj.weight"), ("q_layernorm.weight", "q_a_layernorm.weight"),
          ("linear_q_up_proj.weight", "q_b_proj.weight")])
    return q + [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
                ("kv_layernorm.weight", "kv_a_layernorm.weight"), ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
                ("linear_proj.weight", "o_proj.weight")]


def _rope_rows(cfg: dict, hf_name: str, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """The rotary rows of a query or kv_a weight between megalite's rotate-half order and
    DeepSeek's interleaved pairs (to_hf: halves -> pairs)."""
    dr = cfg["qk_pos_emb_head_dim"]
    halves = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])  # megalite row j = interleaved row halves[j]
    order = torch.argsort(halves) if to_hf else halves
    if hf_name.startswith("kv_a_proj"):  # [kv_lora_rank + dr, h]: the rotary rows last
        r = cfg["kv_lora_rank"]
        return torch.cat([w[:r], w[r:][order]])
    if hf_name in ("q_proj.weight", "q_b_proj.weight"):  # [n·(d + dr), in], each head [d ; dr]
        heads = w.view(cfg["num_attention_heads"], cfg["qk_head_dim"] + dr, -1)
        d = cfg["qk_head_dim"]
        return torch.cat([heads[:, :d], heads[:, d:][:, order]], dim=1).reshape(w.shape)
    return w


def _layer_rules(cfg: dict, moe: bool) -> list[Rule]:
    """The name table of one decoder layer: MLA (the rotary rows permuted, _rope_rows), and a dense
    MLP or DeepSeek-V3's MoE (router and expert bias, experts, the shared expert)."""
    rules = [same("input_layernorm.weight", "input_layernorm.weight"),
             same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    rules += under("self_attention.", "self_attn.", [
        mapped(ours, theirs, lambda w, n=theirs: _rope_rows(cfg, n, w, True),
               lambda w, n=theirs: _rope_rows(cfg, n, w, False)) for ours, theirs in _mla_names(cfg)])
    if not moe:
        return rules + [glu("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
                        same("mlp.linear_fc2.weight", "mlp.down_proj.weight")]
    mlp = [same("router.weight", "gate.weight"), same("router.expert_bias", "gate.e_score_correction_bias")]
    mlp += expert_rules(cfg["num_experts"])
    mlp += [glu("shared_experts.linear_fc1.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"),
            same("shared_experts.linear_fc2.weight", "shared_experts.down_proj.weight")]
    return rules + under("mlp.", "mlp.", mlp)


def _pattern(cfg: dict) -> list[bool]:
    """Whether each decoder layer is MoE, then each MTP module's layer (MoE as the last layer is)."""
    layers = cfg["num_layers"]
    pattern = moe_layer_pattern(cfg.get("moe_layer_freq", "1"), layers) if cfg.get("num_experts") else [False] * layers
    return pattern + [pattern[-1]] * (cfg.get("mtp_num_layers") or 0)


def deepseek_tensors(cfg: dict, state: dict) -> dict:
    """DeepseekV3ForCausalLM's tensors of megalite's `state`, popping what they use; MTP module k
    as DeepSeek-V3 stores it: model.layers.{num_layers + k}.*, with copies of the embedding and
    the output layer (module docstring)."""
    out = export_tensors(_OUTER_RULES, state, h="model.")
    if cfg["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    layers = cfg["num_layers"]
    for i, moe in enumerate(_pattern(cfg)):
        m, h = (f"decoder.layers.{i}.", f"model.layers.{i}.") if i < layers else \
            (f"mtp.layers.{i - layers}.transformer_layer.", f"model.layers.{i}.")
        if moe and m + "mlp.router.expert_bias" not in state:  # no --moe-router-enable-expert-bias:
            state[m + "mlp.router.expert_bias"] = torch.zeros(cfg["num_experts"])  # transformers' buffer is zeros
        out.update(export_tensors(_layer_rules(cfg, moe), state, m, h))
        if i < layers:
            continue
        out.update(export_tensors(MTP_RULES, state, f"mtp.layers.{i - layers}.", h))
        out[h + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[h + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def deepseek_mtp_depth(c, hf: dict, refuse) -> int | None:
    """--mtp-num-layers of a DeepseekV3 checkpoint (`hf`: its tensors, "model." stripped): its
    num_nextn_predict_layers when those modules' weights are there; none when none are (a model
    transformers saved: DeepseekV3ForCausalLM neither loads nor writes them, while its config
    defaults to 1)."""
    depth = getattr(c, "num_mtp_layers", None) or getattr(c, "num_nextn_predict_layers", 0) or 0
    layers = c.num_hidden_layers
    present = [k for k in range(depth) if f"layers.{layers + k}.eh_proj.weight" in hf]
    if not present:
        return None
    if len(present) != depth:
        refuse(f"num_nextn_predict_layers {depth} but the weights of MTP modules {present} only")
    last_moe = bool(c.n_routed_experts) and min(c.first_k_dense_replace or 0, layers) < layers
    for k in present:  # megalite builds an MTP layer as the last decoder layer (config.is_moe_mtp_layer)
        if (f"layers.{layers + k}.mlp.gate.weight" in hf) != last_moe:
            refuse(f"MTP module {k} (model.layers.{layers + k}) {'with' if not last_moe else 'without'} experts, "
                   f"unlike the last decoder layer (megalite's MTP layer is MoE exactly when that layer is)")
    return depth


def deepseek_state(cfg: dict, hf: dict, lm_head: torch.Tensor | None = None) -> dict:
    """megalite tensors of DeepseekV3's `hf` ("model." stripped; `lm_head` its lm_head.weight),
    popping what they use; KeyError names a missing tensor, ValueError an MTP module's copy of
    the embedding or output layer that differs from the one megalite's MTP shares."""
    out = import_tensors(_OUTER_RULES, hf)
    layers = cfg["num_layers"]
    shared = {"embed_tokens.weight": out["embedding.word_embeddings.weight"],
              "shared_head.head.weight": out["embedding.word_embeddings.weight"] if lm_head is None else lm_head}
    for i, moe in enumerate(_pattern(cfg)):
        m, h = (f"decoder.layers.{i}.", f"layers.{i}.") if i < layers else \
            (f"mtp.layers.{i - layers}.transformer_layer.", f"layers.{i}.")
        if i >= layers:
            out.update(import_tensors(MTP_RULES, hf, f"mtp.layers.{i - layers}.", h))
            for name, kept in shared.items():  # the copies DeepSeek-V3 stores (vLLM reads them); optional
                copy = hf.pop(h + name, None)
                if copy is not None and not torch.equal(copy, kept):
                    raise ValueError(f"model.{h}{name} differs from the main model's (megalite's MTP module shares "
                                     "the embedding and the output layer)")
        if moe:  # transformers 5's fused experts, in memory
            unfuse_experts(hf, h + "mlp.", cfg["num_experts"], "gate_proj", "up_proj", "down_proj")
        out.update(import_tensors(_layer_rules(cfg, moe), hf, m, h))
    return out


# -- configs ----------------------------------------------------------------------------------------
def _dense_prefix(cfg: dict) -> int:
    """first_k_dense_replace of megalite's MoE layer pattern, or -1 when it is not k dense then all MoE."""
    if not cfg.get("num_experts"):
        return cfg["num_layers"]
    pattern = moe_layer_pattern(cfg.get("moe_layer_freq", "1"), cfg["num_layers"])
    k = pattern.index(True) if any(pattern) else len(pattern)
    return k if all(pattern[k:]) else -1


def deepseek_architecture(cfg: dict, refuse) -> str:
    """"deepseek_v3" for a model with --multi-latent-attention that DeepseekV3ForCausalLM computes;
    `refuse(setting, target)` raises naming what it cannot express."""
    target = DEEPSEEK_CLASS
    if cfg["normalization"] != "RMSNorm" or not cfg["swiglu"]:
        refuse("--multi-latent-attention without --normalization RMSNorm and --swiglu", target)
    if cfg["add_bias_linear"]:
        refuse("--multi-latent-attention without --disable-bias-linear (DeepSeek-V3 has no biases)", target)
    if cfg.get("position_embedding_type") == "learned_absolute":
        refuse("--multi-latent-attention with learned absolute positions (DeepSeek-V3 has RoPE only)", target)
    if not cfg.get("qk_layernorm"):
        refuse("--multi-latent-attention without --qk-layernorm (its q_a_layernorm / kv_a_layernorm always exist)",
               target)
    if cfg["norm_epsilon"] != LATENT_NORM_EPS:
        refuse(f"--norm-epsilon {cfg['norm_epsilon']} (its latent norms' epsilon is fixed at 1e-6)", target)
    if cfg.get("apply_layernorm_1p"):
        refuse("--apply-layernorm-1p", target)
    if not cfg.get("num_experts"):
        return "deepseek_v3"
    k, groups, group_topk = cfg["moe_router_topk"], cfg.get("moe_router_num_groups"), cfg.get("moe_router_group_topk")
    expert_ffn = cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    shared = cfg.get("moe_shared_expert_intermediate_size")
    for what, bad in ((f"--moe-router-score-function {cfg.get('moe_router_score_function')} (its router is "
                       "sigmoid)", cfg.get("moe_router_score_function") != "sigmoid"),
                      ("--moe-expert-capacity-factor (its MoE is dropless)", cfg.get("moe_expert_capacity_factor")),
                      ("no --moe-shared-expert-intermediate-size (it always has shared experts)", not shared),
                      (f"--moe-shared-expert-intermediate-size {shared} not a multiple of the experts' "
                       f"{expert_ffn}", shared and shared % expert_ffn),
                      ("--moe-shared-expert-gate", cfg.get("moe_shared_expert_gate")),
                      (f"--moe-layer-freq {cfg.get('moe_layer_freq')} (its dense layers are the first "
                       "first_k_dense_replace only)", _dense_prefix(cfg) < 0),
                      (f"--moe-router-topk {k} / --moe-router-group-topk {group_topk} != 2 (it scores a group "
                       "by its top 2 experts)", group_topk and groups and groups > 1 and k // group_topk != 2),
                      (f"--num-experts {cfg['num_experts']} < 2 per group", cfg["num_experts"] // (groups or 1) < 2)):
        if bad:
            refuse(what, target)
    return "deepseek_v3"


def deepseek_hf_config(cfg: dict, common: dict, rope_parameters: dict, transformers_class):
    """The DeepseekV3Config of an MLA model_config; `common`: vocabulary, tokens, init, tying."""
    experts = cfg.get("num_experts") or 0
    expert_ffn = cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    k = cfg.get("moe_router_topk", 1) if experts else 1
    groups = (cfg.get("moe_router_num_groups") or 1) if cfg.get("moe_router_group_topk") else 1
    return transformers_class("DeepseekV3Config", DEEPSEEK_CLASS)(
        hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_layers"], intermediate_size=cfg["ffn_hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_attention_heads"],
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_head_dim"],
        qk_rope_head_dim=cfg["qk_pos_emb_head_dim"], v_head_dim=cfg["v_head_dim"], rope_interleave=True,
        moe_intermediate_size=expert_ffn, n_routed_experts=experts or 1, num_experts_per_tok=k,
        n_shared_experts=(cfg.get("moe_shared_expert_intermediate_size") or expert_ffn) // expert_ffn,
        # a dense model's MTP layers dense too: DeepSeek's layer i is MoE from first_k_dense_replace on
        first_k_dense_replace=_dense_prefix(cfg) + (0 if experts else cfg.get("mtp_num_layers") or 0), n_group=groups,
        topk_group=cfg.get("moe_router_group_topk") if groups > 1 else 1, norm_topk_prob=k > 1,
        routed_scaling_factor=float(cfg.get("moe_router_topk_scaling_factor") or 1.0), hidden_act="silu",
        max_position_embeddings=cfg["max_position_embeddings"], rms_norm_eps=cfg["norm_epsilon"],
        rope_parameters=rope_parameters, attention_bias=False, attention_dropout=cfg.get("attention_dropout", 0.0),
        num_mtp_layers=cfg.get("mtp_num_layers") or 0, architectures=[DEEPSEEK_CLASS], **common)


def deepseek_yarn(cfg: dict) -> bool:
    """MLA with YaRN that changes the function (factor > 1): written as transformers' rope_type yarn."""
    return bool(cfg.get("multi_latent_attention")) and (cfg.get("rope_type") or "yarn") == "yarn" \
        and float(cfg.get("rotary_scaling_factor", 1.0)) > 1


def deepseek_config_from_hf(c, raw: dict, rope: dict, refuse) -> dict:
    """megalite's settings of a DeepseekV3Config (`rope`: rope_from_hf's reading of its RoPE)."""
    if c.hidden_act != "silu":
        refuse(f"hidden_act {c.hidden_act!r} (megalite's SwiGLU uses silu)")
    if c.attention_bias:
        refuse("attention_bias true (megalite's MLA projections have no biases)")
    if c.rms_norm_eps != LATENT_NORM_EPS:
        refuse(f"rms_norm_eps {c.rms_norm_eps} (its latent norms keep 1e-6; megalite has one --norm-epsilon)")
    out = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
               num_query_groups=c.num_attention_heads, kv_channels=c.qk_nope_head_dim + c.qk_rope_head_dim,
               seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
               normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True, hidden_dropout=0.0,
               attention_dropout=float(c.attention_dropout or 0.0), ffn_hidden_size=c.intermediate_size,
               add_bias_linear=False, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=c.q_lora_rank,
               kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim,
               v_head_dim=c.v_head_dim, rotary_percent=1.0, **_mla_rope(raw, rope, refuse))
    dense = min(c.first_k_dense_replace or 0, c.num_hidden_layers)
    if dense < c.num_hidden_layers:
        out.update(_deepseek_moe(c, dense, refuse))
    return out


def _mla_rope(raw: dict, rope: dict, refuse) -> dict:
    """MLA's --rope-type and YaRN flags: rope_from_hf's YaRN reading, with --mscale-all-dim set as
    transformers scales the softmax (by mscale_all_dim's m², when it is non-zero) and --mscale then
    solved for its cos/sin attention factor."""
    if rope.get("use_rope_scaling") or rope.get("rotary_seq_len_interpolation_factor"):
        refuse("rope_type llama3 / linear (MLA's RoPE is --rope-type rope or yarn)")
    out = dict(rope, position_embedding_type="rope", rope_type="rope")
    if rope["position_embedding_type"] != "yarn":
        return out
    d = raw.get("rope_parameters") or raw.get("rope_scaling")
    factor, all_dim = float(d["factor"]), float(d.get("mscale_all_dim") or 0.0)
    out["rope_type"] = "yarn"
    if all_dim and factor > 1:
        def m(a):
            return 0.1 * a * math.log(factor) + 1.0
        mscale = d.get("mscale")
        wanted = d.get("attention_factor") or (m(mscale) / m(all_dim) if mscale else m(1.0))
        out.update(mscale_all_dim=all_dim, mscale=(wanted * m(all_dim) - 1.0) / (0.1 * math.log(factor)))
    return out


def _deepseek_moe(c, dense: int, refuse) -> dict:
    k, groups = c.num_experts_per_tok, c.n_group or 1
    if c.n_routed_experts % groups:
        refuse(f"n_routed_experts {c.n_routed_experts} not divisible by n_group {groups}")
    if groups > 1 and c.topk_group < groups and k // c.topk_group != 2:
        refuse(f"num_experts_per_tok {k} / topk_group {c.topk_group} != 2 (megalite scores a group by its top "
               "num_experts_per_tok / topk_group experts, transformers by its top 2)")
    if bool(c.norm_topk_prob) != (k > 1):
        refuse(f"norm_topk_prob {c.norm_topk_prob} with num_experts_per_tok {k} (megalite's sigmoid router "
               "normalises over the chosen experts exactly when there are more than one)")
    if not c.n_shared_experts:
        refuse("n_shared_experts 0 (megalite's shared expert needs a size >= 1)")
    layers = c.num_hidden_layers
    return dict(num_experts=c.n_routed_experts, moe_router_topk=k, moe_ffn_hidden_size=c.moe_intermediate_size,
                moe_layer_freq="1" if dense == 0 else f"[{','.join(['0'] * dense + ['1'] * (layers - dense))}]",
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if groups > 1 and c.topk_group < groups else None,
                moe_router_group_topk=c.topk_group if groups > 1 and c.topk_group < groups else None,
                moe_router_topk_scaling_factor=float(c.routed_scaling_factor),
                moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts)


def deepseek_flags(cfg: dict) -> list:
    """pretrain_gpt.py flags of MLA and DeepSeek-V3's routing (beside moe.moe_flags')."""
    if not cfg.get("multi_latent_attention"):
        return []
    flags = ["--multi-latent-attention", "--kv-lora-rank", cfg["kv_lora_rank"], "--qk-head-dim", cfg["qk_head_dim"],
             "--qk-pos-emb-head-dim", cfg["qk_pos_emb_head_dim"], "--v-head-dim", cfg["v_head_dim"],
             "--rope-type", cfg.get("rope_type") or "yarn"]
    if cfg.get("mtp_num_layers"):
        flags += ["--mtp-num-layers", cfg["mtp_num_layers"]]
    if cfg.get("q_lora_rank"):
        flags += ["--q-lora-rank", cfg["q_lora_rank"]]
    if (cfg.get("rope_type") or "yarn") == "yarn":
        flags += ["--rotary-scaling-factor", cfg["rotary_scaling_factor"], "--mscale", cfg["mscale"],
                  "--mscale-all-dim", cfg["mscale_all_dim"], "--yarn-beta-fast", cfg["yarn_beta_fast"],
                  "--yarn-beta-slow", cfg["yarn_beta_slow"]]
        if cfg.get("yarn_original_max_position_embeddings"):
            flags += ["--yarn-original-max-position-embeddings", cfg["yarn_original_max_position_embeddings"]]
        if not cfg.get("yarn_correction_range_round_to_int", True):
            flags.append("--no-yarn-correction-range-round-to-int")
    if cfg.get("num_experts"):
        flags += ["--moe-router-score-function", cfg["moe_router_score_function"]]
        if cfg.get("moe_router_enable_expert_bias"):
            flags.append("--moe-router-enable-expert-bias")
        if cfg.get("moe_router_group_topk"):
            flags += ["--moe-router-num-groups", cfg["moe_router_num_groups"], "--moe-router-group-topk",
                      cfg["moe_router_group_topk"]]
        if cfg.get("moe_router_topk_scaling_factor"):
            flags += ["--moe-router-topk-scaling-factor", cfg["moe_router_topk_scaling_factor"]]
    return flags
