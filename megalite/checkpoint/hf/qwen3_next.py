"""Gated DeltaNet hybrids <-> Hugging Face: `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM` (dense) and
`Qwen3_5MoeForCausalLM`: --experimental-attention-variant gated_delta_net layers (model/gated_delta_net.py)
between gated softmax-attention layers (--attention-output-gate, --qk-layernorm), zero-centred RMSNorms.

    megalite (decoder.layers.{i}.)             Qwen3-Next                      Qwen3.5 (model.layers.{i}.)
    self_attention.in_proj.weight              linear_attn.in_proj_qkvz ;      linear_attn.in_proj_qkv ; in_proj_z ;
      [nk, (q, k, v, z, b, a)] rows              in_proj_ba (by key head)        in_proj_b ; in_proj_a (by kind)
    self_attention.conv1d.weight [nk, (q,k,v)] linear_attn.conv1d.weight [q; k; v]  (the same)
    self_attention.dt_bias / A_log             linear_attn.dt_bias / A_log     (the same)
    self_attention.out_norm.weight             linear_attn.norm.weight         (the same; a plain weight there)
    self_attention.out_proj.weight             linear_attn.out_proj.weight     (the same)
    self_attention.linear_qkv.weight           self_attn.q_proj ([q_h; gate_h] per head) ; k_proj ; v_proj
      [ng, (q heads, gate heads, k, v)]
    self_attention.q_layernorm / k_layernorm   self_attn.q_norm / k_norm
    mlp.router / experts / shared_experts      mlp.gate / experts / shared_expert, shared_expert_gate

Hugging Face's RMSNorms scale by (1 + w) (w stored zero-centred: megalite's --apply-layernorm-1p, which
imports set) except the DeltaNet's output norm, whose weight is stored as is. Qwen3.5's RoPE is
multimodal (mrope_section); for text every position axis is the token's index, which is plain RoPE
over the partial_rotary_factor channels (--rotary-percent). Qwen3-Next's routers renormalise the
top-k probabilities when norm_topk_prob (megalite's default) and not otherwise
(--moe-router-pre-softmax); Qwen3.5-MoE's always do and have no dense layers, so an MoE model
exports as Qwen3-Next unless --hf-architecture qwen3_5_moe_text asks for Qwen3.5-MoE.

Multi-token prediction (model/mtp.py, --mtp-num-layers D): the released checkpoints carry it under
`mtp.*` (transformers' classes skip it: `_keys_to_ignore_on_load_unexpected`; vLLM's
qwen3_next_mtp.py / qwen3_5_mtp.py compute it), D = the config's mtp_num_hidden_layers:

    megalite (mtp.layers.{k}.)          Hugging Face
    enorm / hnorm                       mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden
    eh_proj [h, 2h]                     mtp.fc  (input [norm(emb); norm(h)] on both sides)
    final_layernorm                     mtp.norm
    transformer_layer.*                 mtp.layers.{k}.*  (a full_attention decoder layer, the MLP
                                                           MoE exactly when the last layer's is)

all norms zero-centred (1 + w). vLLM shares one fc and its three norms among its D layers, and the
embedding and output layer with the main model (mtp_use_dedicated_embeddings false): on import each
megalite module gets a copy of them; on export D > 1 modules must hold equal ones.
"""
from __future__ import annotations

import torch

from ...config.attention_variant import LINEAR_VARIANTS, linear_attention_pattern
from .moe import moe_pattern
from .tables import Rule, expert_rules, glu, mapped, same, unfuse_experts

QWEN3_NEXT_CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                      "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
_CONFIGS = {"qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig",
            "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}


def is_gated_delta_net(cfg: dict) -> bool:
    return cfg.get("experimental_attention_variant") in LINEAR_VARIANTS


# -- which architecture ---------------------------------------------------------------------------
def qwen3_next_architecture(cfg: dict, refuse, prefer: str | None = None) -> str:
    """A key of QWEN3_NEXT_CLASSES for a gated DeltaNet model; `refuse(setting, target)` raises."""
    target = "Qwen3NextForCausalLM / Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM"
    for what, bad in (("--normalization LayerNorm (their norms are RMSNorm)", cfg["normalization"] != "RMSNorm"),
                      ("a GeLU MLP (no --swiglu)", not cfg["swiglu"]),
                      ("biases (no --disable-bias-linear)", cfg["add_bias_linear"] or cfg.get("add_qkv_bias")),
                      ("no --qk-layernorm (their attention always has q_norm / k_norm)", not cfg.get("qk_layernorm")),
                      ("no --attention-output-gate (their attention is gated)", not cfg.get("attention_output_gate")),
                      (f"--position-embedding-type {cfg['position_embedding_type']}",
                       cfg["position_embedding_type"] != "rope"),
                      ("--use-rope-scaling / --rotary-seq-len-interpolation-factor",
                       cfg.get("use_rope_scaling") or cfg.get("rotary_seq_len_interpolation_factor"))):
        if bad:
            refuse(what, target)
    if not cfg.get("num_experts"):
        if prefer not in (None, "qwen3_5_text"):
            refuse(f"a dense model as --hf-architecture {prefer}", target)
        return "qwen3_5_text"
    for what, bad in ((f"--moe-router-score-function {cfg.get('moe_router_score_function')}",
                       cfg.get("moe_router_score_function", "softmax") != "softmax"),
                      ("--moe-router-group-topk", cfg.get("moe_router_group_topk")),
                      ("--moe-router-topk-scaling-factor", cfg.get("moe_router_topk_scaling_factor") not in (None, 1.0)),
                      ("--moe-expert-capacity-factor", cfg.get("moe_expert_capacity_factor") is not None),
                      ("no gated shared expert (--moe-shared-expert-intermediate-size with --moe-shared-expert-gate)",
                       not (cfg.get("moe_shared_expert_intermediate_size") and cfg.get("moe_shared_expert_gate")))):
        if bad:
            refuse(what, target)
    if prefer == "qwen3_5_moe_text":
        if cfg.get("moe_router_pre_softmax") or not all(moe_pattern(cfg)):
            refuse("--moe-router-pre-softmax or dense layers (--moe-layer-freq)", "Qwen3_5MoeForCausalLM")
        return prefer
    if prefer not in (None, "qwen3_next"):
        refuse(f"an MoE model as --hf-architecture {prefer}", target)
    return "qwen3_next"


# -- configs ----------------------------------------------------------------------------------------
def layer_types(cfg: dict) -> list[str]:
    return ["linear_attention" if linear else "full_attention"
            for linear in linear_attention_pattern(cfg["linear_attention_freq"], cfg["num_layers"])]


def qwen3_next_hf_config(cfg: dict, arch: str, common: dict, transformers_class):
    """The Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig of a model_config."""
    kw = dict(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_layers"],
              intermediate_size=cfg["ffn_hidden_size"], num_attention_heads=cfg["num_attention_heads"],
              num_key_value_heads=cfg["num_query_groups"], head_dim=cfg["kv_channels"], hidden_act="silu",
              max_position_embeddings=cfg["max_position_embeddings"], rms_norm_eps=cfg["norm_epsilon"],
              rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rotary_base"]),
                               "partial_rotary_factor": float(cfg.get("rotary_percent", 1.0))},
              attention_bias=False, attention_dropout=cfg.get("attention_dropout", 0.0),
              linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"], linear_key_head_dim=cfg["linear_key_head_dim"],
              linear_value_head_dim=cfg["linear_value_head_dim"], linear_num_key_heads=cfg["linear_num_key_heads"],
              linear_num_value_heads=cfg["linear_num_value_heads"], layer_types=layer_types(cfg),
              architectures=[QWEN3_NEXT_CLASSES[arch]], **common)
    if cfg.get("num_experts"):
        kw.update(moe_intermediate_size=cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
                  shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                  num_experts_per_tok=cfg["moe_router_topk"], num_experts=cfg["num_experts"],
                  output_router_logits=False)
    if cfg.get("mtp_num_layers"):  # (config.json only: transformers' classes skip mtp.*)
        kw.update(mtp_num_hidden_layers=cfg["mtp_num_layers"], mtp_use_dedicated_embeddings=False)
    if arch == "qwen3_next":
        kw.update(decoder_sparse_step=1, norm_topk_prob=not cfg.get("moe_router_pre_softmax"),
                  mlp_only_layers=[i for i, moe in enumerate(moe_pattern(cfg)) if not moe])
    return transformers_class(_CONFIGS[arch], QWEN3_NEXT_CLASSES[arch])(**kw)


def qwen3_next_config_from_hf(c, raw: dict, refuse) -> dict:
    """megalite's model_config settings of a Qwen3-Next / Qwen3.5 text config (`raw` its config.json)."""
    if c.hidden_act != "silu":
        refuse(f"hidden_act {c.hidden_act!r} (megalite's SwiGLU uses silu)")
    if c.attention_bias:
        refuse("attention_bias true")
    rope = dict(raw.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        refuse(f"rope_parameters.rope_type {rope.get('rope_type')!r} (megalite imports their default RoPE)")
    linear = [t == "linear_attention" for t in c.layer_types]
    n = len(linear)
    period = next((p for p in range(1, n + 1) if linear == [(i + 1) % p != 0 for i in range(n)]), None)
    out = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
               num_query_groups=c.num_key_value_heads, group_query_attention=c.num_key_value_heads != c.num_attention_heads,
               kv_channels=c.head_dim, seq_length=c.max_position_embeddings,
               max_position_embeddings=c.max_position_embeddings, position_embedding_type="rope",
               rotary_base=float(rope.get("rope_theta", 10000.0)),
               rotary_percent=float(rope.get("partial_rotary_factor", 1.0)), normalization="RMSNorm",
               norm_epsilon=c.rms_norm_eps, apply_layernorm_1p=True, swiglu=True, add_bias_linear=False,
               hidden_dropout=0.0, attention_dropout=float(c.attention_dropout or 0.0),
               ffn_hidden_size=c.intermediate_size, qk_layernorm=True, attention_output_gate=True,
               experimental_attention_variant="gated_delta_net",
               linear_attention_freq=str(period) if period else "[" + ",".join(str(int(v)) for v in linear) + "]",
               linear_conv_kernel_dim=c.linear_conv_kernel_dim, linear_key_head_dim=c.linear_key_head_dim,
               linear_value_head_dim=c.linear_value_head_dim, linear_num_key_heads=c.linear_num_key_heads,
               linear_num_value_heads=c.linear_num_value_heads)
    if c.model_type == "qwen3_5_text" or not getattr(c, "num_experts", 0):
        return out
    if c.model_type == "qwen3_next":
        only = set(c.mlp_only_layers or [])
        pattern = [i not in only and (i + 1) % c.decoder_sparse_step == 0 for i in range(n)]
        pre_softmax = not c.norm_topk_prob
    else:  # Qwen3.5-MoE: every layer, renormalised top-k
        pattern, pre_softmax = [True] * n, False
    if not c.shared_expert_intermediate_size:
        refuse("shared_expert_intermediate_size 0")
    out.update(num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
               moe_ffn_hidden_size=c.moe_intermediate_size,
               moe_layer_freq="1" if all(pattern) else "[" + ",".join(str(int(m)) for m in pattern) + "]",
               moe_router_pre_softmax=pre_softmax,
               moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size, moe_shared_expert_gate=True)
    return out


def qwen3_next_flags(cfg: dict) -> list:
    """pretrain_gpt.py flags of the gated DeltaNet settings (beside config.pretrain_flags')."""
    if not is_gated_delta_net(cfg):
        return []
    flags = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
             cfg["linear_attention_freq"]]
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads"):
        flags += ["--" + key.replace("_", "-"), cfg[key]]
    if cfg.get("mtp_num_layers"):
        flags += ["--mtp-num-layers", cfg["mtp_num_layers"]]
    return flags + ["--attention-output-gate"] * bool(cfg.get("attention_output_gate")) + \
        ["--apply-layernorm-1p"] * bool(cfg.get("apply_layernorm_1p"))


# -- weights ----------------------------------------------------------------------------------------
def _norms(cfg: dict):
    """(zero-centred, plain) rules: Hugging Face's (1 + w) norms and the DeltaNet's plain output norm,
    from megalite's weight (stored w - 1 under --apply-layernorm-1p)."""
    shift = 0.0 if cfg.get("apply_layernorm_1p") else 1.0

    def centred(ours, theirs):  # hf = effective - 1
        return mapped(ours, theirs, lambda w: w - shift, lambda w: w + shift)

    def plain(ours, theirs):  # hf = effective
        return mapped(ours, theirs, lambda w: w + 1 - shift, lambda w: w - 1 + shift)
    return centred, plain


def _gdn_rules(cfg: dict, arch: str) -> list[Rule]:
    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = cfg["linear_num_value_heads"] // nk
    sections = [dk, dk, r * dv, r * dv, r, r]

    def per_group(w):  # [nk·P, h] -> [nk, P, h] split into the six kinds
        return w.view(nk, sum(sections), -1).split(sections, dim=1)

    def joined(parts):  # inverse of per_group (each part [nk, size, h])
        return torch.cat(parts, dim=1).reshape(-1, parts[0].size(-1))

    def conv_out(w):  # [nk, (q, k, v), 1, K] -> [q all; k all; v all]
        q, k, v = w.view(nk, 2 * dk + r * dv, *w.shape[1:]).split([dk, dk, r * dv], dim=1)
        return torch.cat([t.reshape(-1, *w.shape[1:]) for t in (q, k, v)])

    def conv_back(w):
        q, k, v = w.split([nk * dk, nk * dk, nk * r * dv])
        return torch.cat([t.view(nk, -1, *w.shape[1:]) for t in (q, k, v)], dim=1).reshape(w.shape)

    m, h = "self_attention.", "linear_attn."
    _, plain = _norms(cfg)
    rules = [mapped(m + "conv1d.weight", h + "conv1d.weight", conv_out, conv_back),
             same(m + "dt_bias", h + "dt_bias"), same(m + "A_log", h + "A_log"),
             plain(m + "out_norm.weight", h + "norm.weight"), same(m + "out_proj.weight", h + "out_proj.weight")]
    if arch == "qwen3_next":  # [nk, (q, k, v, z)] and [nk, (b, a)]
        return rules + [Rule((m + "in_proj.weight",), (h + "in_proj_qkvz.weight", h + "in_proj_ba.weight"),
                             lambda t: [joined(per_group(t[0])[:4]), joined(per_group(t[0])[4:])],
                             lambda t: [joined(list(t[0].view(nk, -1, t[0].size(-1)).split(sections[:4], dim=1))
                                               + list(t[1].view(nk, -1, t[1].size(-1)).split(sections[4:], dim=1)))])]

    def out(t):  # Qwen3.5: each kind over all heads
        q, k, v, z, b, a = (p.reshape(-1, p.size(-1)) for p in per_group(t[0]))
        return [torch.cat([q, k, v]), z, b, a]

    def back(t):
        q, k, v = t[0].split([nk * dk, nk * dk, nk * r * dv])
        return [joined([p.view(nk, -1, p.size(-1)) for p in (q, k, v, t[1], t[2], t[3])])]
    return rules + [Rule((m + "in_proj.weight",), tuple(h + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                         out, back)]


def _attention_rules(cfg: dict) -> list[Rule]:
    """The gated softmax attention: megalite's [ng, (q heads, gate heads, k, v), hn] rows as q_proj
    ([q_h; gate_h] per head), k_proj and v_proj."""
    heads, groups, hn = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["kv_channels"]
    hpg = heads // groups

    def out(t):
        g = t[0].view(groups, 2 * hpg + 2, hn, -1)
        q = torch.stack([g[:, :hpg], g[:, hpg:2 * hpg]], dim=2)  # [ng, hpg, 2, hn, h]
        return [q.reshape(-1, g.size(-1)), g[:, 2 * hpg].reshape(-1, g.size(-1)), g[:, -1].reshape(-1, g.size(-1))]

    def back(t):
        q = t[0].view(groups, hpg, 2, hn, -1)
        k, v = (x.view(groups, 1, hn, -1) for x in t[1:])
        return [torch.cat([q[:, :, 0], q[:, :, 1], k, v], dim=1).reshape(-1, q.size(-1))]
    centred, _ = _norms(cfg)
    return [Rule(("self_attention.linear_qkv.weight",), tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), out, back),
            centred("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            centred("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
            same("self_attention.linear_proj.weight", "self_attn.o_proj.weight")]


def _mlp_rules(cfg: dict, moe: bool) -> list[Rule]:
    if not moe:
        return [glu("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
                same("mlp.linear_fc2.weight", "mlp.down_proj.weight")]
    rules = [same("router.weight", "gate.weight")] + expert_rules(cfg["num_experts"])
    rules += [glu("shared_experts.linear_fc1.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"),
              same("shared_experts.linear_fc2.weight", "shared_expert.down_proj.weight"),
              same("shared_experts.gate_weight", "shared_expert_gate.weight")]
    return [Rule(tuple("mlp." + n for n in r.ours), tuple("mlp." + n for n in r.theirs), r.out, r.back) for r in rules]


def layer_rules(cfg: dict, arch: str, i: int, moe: bool) -> list[Rule]:
    """Decoder layer i's table; i >= num_layers: an MTP module's layer (full attention)."""
    centred, _ = _norms(cfg)
    rules = [centred("input_layernorm.weight", "input_layernorm.weight"),
             centred("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    linear = i < cfg["num_layers"] and linear_attention_pattern(cfg["linear_attention_freq"], cfg["num_layers"])[i]
    return rules + (_gdn_rules(cfg, arch) if linear else _attention_rules(cfg)) + _mlp_rules(cfg, moe)


def outer_rules(cfg: dict) -> list[Rule]:
    centred, _ = _norms(cfg)
    return [same("embedding.word_embeddings.weight", "embed_tokens.weight"),
            centred("decoder.final_layernorm.weight", "norm.weight")]


def mtp_rules(cfg: dict) -> list[Rule]:
    """An MTP module's fc and norms: megalite's under mtp.layers.{k}., Hugging Face's under mtp."""
    centred, _ = _norms(cfg)
    return [centred("enorm.weight", "pre_fc_norm_embedding.weight"),
            centred("hnorm.weight", "pre_fc_norm_hidden.weight"), same("eh_proj.weight", "fc.weight"),
            centred("final_layernorm.weight", "norm.weight")]


def unfuse(cfg: dict, hf: dict, prefix: str) -> None:
    """transformers 5's fused experts of a layer (in memory), per expert for the tables."""
    if cfg.get("num_experts"):
        unfuse_experts(hf, prefix + "mlp.", cfg["num_experts"], "gate_proj", "up_proj", "down_proj")


def qwen3_next_tensors(cfg: dict, state: dict, arch: str) -> dict:
    """Hugging Face's tensors of a gated DeltaNet model (popped from megalite's `state`), its MTP
    modules under mtp.* (module docstring); ValueError for D > 1 modules with different fc or norms."""
    from .tables import export_tensors
    out = export_tensors(outer_rules(cfg), state, h="model.")
    if cfg["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    pattern, layers = moe_pattern(cfg), cfg["num_layers"]
    for i, moe in enumerate(pattern):
        out.update(export_tensors(layer_rules(cfg, arch, i, moe), state, f"decoder.layers.{i}.", f"model.layers.{i}."))
    for k in range(cfg.get("mtp_num_layers") or 0):
        m = f"mtp.layers.{k}."
        out.update(export_tensors(layer_rules(cfg, arch, layers + k, pattern[-1]), state, m + "transformer_layer.",
                                  m))
        shared = export_tensors(mtp_rules(cfg), state, m, "mtp.")
        for name, t in shared.items():
            if k and not torch.equal(t, out[name]):
                raise ValueError(f"MTP module {k}'s {name} differs from module 0's (Qwen3-Next's MTP layers share "
                                 "one fc and its norms)")
            out[name] = t
    return out


def qwen3_next_mtp_depth(cfg: dict, raw: dict, hf: dict, refuse) -> int | None:
    """--mtp-num-layers of a Qwen3-Next / Qwen3.5 checkpoint (`raw`: its config.json, `hf`: its
    tensors): mtp_num_hidden_layers when the mtp.* weights are there; none when none are (a model
    transformers saved keeps the setting but not the weights)."""
    if not any(k.startswith("mtp.") for k in hf):
        return None
    depth = raw.get("mtp_num_hidden_layers") or 0
    if raw.get("mtp_use_dedicated_embeddings"):
        refuse("mtp_use_dedicated_embeddings true (megalite's MTP shares the main model's embedding)")
    if not depth:
        refuse("mtp.* weights but no mtp_num_hidden_layers")
    present = [k for k in range(depth) if f"mtp.layers.{k}.input_layernorm.weight" in hf]
    if len(present) != depth:
        refuse(f"mtp.* weights with mtp_num_hidden_layers {depth} but the layers of MTP modules {present} only")
    last_moe = moe_pattern(cfg)[-1]
    for k in present:  # megalite builds an MTP layer as the last decoder layer (config.is_moe_mtp_layer)
        if (f"mtp.layers.{k}.mlp.gate.weight" in hf) != last_moe:
            refuse(f"MTP layer {k} {'with' if not last_moe else 'without'} experts, unlike the last decoder layer "
                   "(megalite's MTP layer is MoE exactly when that layer is)")
    return depth


def qwen3_next_state(cfg: dict, hf: dict, arch: str) -> dict:
    """megalite's tensors of a Qwen3-Next / Qwen3.5 checkpoint (`hf`: "model." stripped), popped from it;
    each MTP module a copy of the shared fc and norms."""
    from .tables import import_tensors
    out = import_tensors(outer_rules(cfg), hf)
    pattern, layers, depth = moe_pattern(cfg), cfg["num_layers"], cfg.get("mtp_num_layers") or 0
    for i, moe in enumerate(pattern + [pattern[-1]] * depth):
        m, h = (f"decoder.layers.{i}.", f"layers.{i}.") if i < layers else \
            (f"mtp.layers.{i - layers}.transformer_layer.", f"mtp.layers.{i - layers}.")
        if moe:
            unfuse(cfg, hf, h)
        out.update(import_tensors(layer_rules(cfg, arch, i, moe), hf, m, h))
    if depth:
        shared = import_tensors(mtp_rules(cfg), hf, "mtp.layers.0.", "mtp.")
        for k in range(depth):
            out.update({n.replace("mtp.layers.0.", f"mtp.layers.{k}.", 1): t.clone() for n, t in shared.items()})
    return out
