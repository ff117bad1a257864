"""DeepSeek-V3.2 <-> Hugging Face `DeepseekV32ForCausalLM`: DeepSeek-V3 (deepseek.py: MLA, its MoE)
with DeepSeek Sparse Attention in every layer (--experimental-attention-variant dsa, model/dsa.py).

    megalite (decoder.layers.{i}.self_attention.core_attention.indexer.)    (model.layers.{i}.self_attn.indexer.)
    linear_wq_b.weight                                                      wq_b.weight
    linear_wk.weight                                                        wk.weight
    k_norm.weight / k_norm.bias                                             k_norm.weight / k_norm.bias
    linear_weights_proj.weight                                              weights_proj.weight

The rest is DeepSeek-V3's table. The indexer's RoPE rotates halves of its first qk_rope_head_dim
channels on both sides (unlike MLA's interleaved pairs), so its rows are copied as they are; its
index score Σ_h w_h ReLU(q_h · k) / √(H·D) is transformers' (the Hadamard rotation both leave out
preserves every q · k). index_n_heads, index_head_dim and index_topk are --dsa-indexer-n-heads,
--dsa-indexer-head-dim and --dsa-indexer-topk; its k_norm's epsilon is fixed at 1e-6, as the latent
norms' (--norm-epsilon 1e-6). The indexer's training loss (--dsa-indexer-loss-coeff) has no
counterpart there: a model imports with none.

Multi-token prediction: DeepSeek-V3.2's released checkpoint stores MTP module k as DeepSeek-V3's
does, as decoder layer num_hidden_layers + k (deepseek.py's table: enorm, hnorm, eh_proj,
shared_head.norm, copies of the embedding and output layer), with its indexer as every layer's:

    mtp.layers.{k}.transformer_layer.self_attention.core_attention.indexer.*
                                                                  model.layers.{L + k}.self_attn.indexer.*

and num_nextn_predict_layers in config.json (which DeepseekV32Config keeps as an extra setting and
DeepseekV32ForCausalLM ignores, as it ignores those layers).
"""
from __future__ import annotations

from .deepseek import deepseek_config_from_hf, deepseek_hf_config, deepseek_state, deepseek_tensors
from .tables import export_tensors, import_tensors, same, under

DEEPSEEK_V32_CLASS = "DeepseekV32ForCausalLM"
_INDEXER = under("self_attention.core_attention.indexer.", "self_attn.indexer.", [
    same("linear_wq_b.weight", "wq_b.weight"), same("linear_wk.weight", "wk.weight"),
    same("k_norm.weight", "k_norm.weight"), same("k_norm.bias", "k_norm.bias"),
    same("linear_weights_proj.weight", "weights_proj.weight")])
# DeepseekV3Config's settings that DeepseekV32Config (a strict dataclass) does not take
_V3_ONLY = ("num_mtp_layers", "rope_interleave")


def deepseek_v32_architecture(cfg: dict, refuse) -> str:
    """"deepseek_v32" for a DSA model that DeepseekV32ForCausalLM computes (after deepseek.py's checks)."""
    if cfg.get("q_lora_rank") is None:
        refuse("DSA without --q-lora-rank", DEEPSEEK_V32_CLASS)
    return "deepseek_v32"


def deepseek_v32_hf_config(cfg: dict, common: dict, rope_parameters: dict, transformers_class):
    v3 = deepseek_hf_config(cfg, common, rope_parameters, transformers_class)
    kw = {k: v for k, v in v3.to_dict().items() if k not in _V3_ONLY and not k.startswith("_")
          and k not in ("transformers_version", "model_type", "head_dim", "qk_head_dim")}
    kw.update(index_n_heads=cfg["dsa_indexer_n_heads"], index_head_dim=cfg["dsa_indexer_head_dim"],
              index_topk=cfg["dsa_indexer_topk"], architectures=[DEEPSEEK_V32_CLASS])
    if cfg.get("mtp_num_layers"):  # the released checkpoint's name for it (layers past the last: the module docstring)
        kw["num_nextn_predict_layers"] = cfg["mtp_num_layers"]
    return transformers_class("DeepseekV32Config", DEEPSEEK_V32_CLASS)(**kw)


def deepseek_v32_config_from_hf(c, raw: dict, rope: dict, refuse) -> dict:
    dense = min(c.first_k_dense_replace or 0, c.num_hidden_layers)
    want = ["dense"] * dense + ["sparse"] * (c.num_hidden_layers - dense)
    if list(c.mlp_layer_types) != want:
        refuse(f"mlp_layer_types {c.mlp_layer_types} (megalite reads the first first_k_dense_replace layers dense, "
               "then MoE)")
    if any(t != "indexed_attention" for t in c.layer_types):
        refuse(f"layer_types {sorted(set(c.layer_types))} (megalite's DSA is in every layer)")
    return dict(deepseek_config_from_hf(c, raw, rope, refuse), experimental_attention_variant="dsa",
                dsa_indexer_n_heads=c.index_n_heads, dsa_indexer_head_dim=c.index_head_dim,
                dsa_indexer_topk=c.index_topk)


def deepseek_v32_flags(cfg: dict) -> list:
    if cfg.get("experimental_attention_variant") != "dsa":
        return []
    return ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", cfg["dsa_indexer_n_heads"],
            "--dsa-indexer-head-dim", cfg["dsa_indexer_head_dim"], "--dsa-indexer-topk", cfg["dsa_indexer_topk"]]


def _layers(cfg: dict, hf_prefix: str) -> list[tuple[str, str]]:
    """(megalite, Hugging Face) prefixes of each layer with an indexer: the decoder's, then each MTP
    module's transformer layer, stored as layer num_layers + k."""
    layers, depth = cfg["num_layers"], cfg.get("mtp_num_layers") or 0
    return [(f"decoder.layers.{i}.", f"{hf_prefix}layers.{i}.") for i in range(layers)] + \
        [(f"mtp.layers.{k}.transformer_layer.", f"{hf_prefix}layers.{layers + k}.") for k in range(depth)]


def deepseek_v32_tensors(cfg: dict, state: dict) -> dict:
    """DeepseekV32ForCausalLM's tensors of megalite's `state` (popped): the indexers, then DeepSeek-V3's."""
    out = {}
    for ours, theirs in _layers(cfg, "model."):
        out.update(export_tensors(_INDEXER, state, ours, theirs))
    return {**deepseek_tensors(cfg, state), **out}


def deepseek_v32_state(cfg: dict, hf: dict, lm_head=None) -> dict:
    """megalite's tensors of a DeepseekV32 checkpoint (`hf`: "model." stripped), popped from it."""
    out = {}
    for ours, theirs in _layers(cfg, ""):
        out.update(import_tensors(_INDEXER, hf, ours, theirs))
    return {**deepseek_state(cfg, hf, lm_head), **out}


__all__ = ["DEEPSEEK_V32_CLASS", "deepseek_v32_architecture", "deepseek_v32_hf_config", "deepseek_v32_config_from_hf",
           "deepseek_v32_flags", "deepseek_v32_tensors", "deepseek_v32_state"]
