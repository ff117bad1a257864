"""Hugging Face model configs: which transformers architecture a megalite model is
(`hf_architecture`), its config.json and RoPE settings both ways, and the pretrain_gpt.py flags
of an imported model. What maps, and what is refused, is in conversion.py's docstring (and
moe.py's for the Mixture-of-Experts models)."""
from __future__ import annotations

import json

from ...errors import InputError
from .gpt_oss import gpt_oss_architecture, gpt_oss_config_from_hf, is_gpt_oss
from .deepseek import (DEEPSEEK_CLASS, deepseek_architecture, deepseek_config_from_hf, deepseek_flags,
                          deepseek_hf_config, deepseek_yarn)
from .deepseek_v32 import (DEEPSEEK_V32_CLASS, deepseek_v32_architecture, deepseek_v32_config_from_hf,
                           deepseek_v32_flags, deepseek_v32_hf_config)
from .moe import HF_MOE_CLASSES, moe_architecture, moe_config_from_hf, moe_flags, moe_hf_config
from .qwen3_next import (QWEN3_NEXT_CLASSES, is_gated_delta_net, qwen3_next_architecture, qwen3_next_config_from_hf,
                         qwen3_next_flags, qwen3_next_hf_config)

# megalite's name of each architecture -> the transformers class
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", **HF_MOE_CLASSES,
              "deepseek_v3": DEEPSEEK_CLASS, "deepseek_v32": DEEPSEEK_V32_CLASS, **QWEN3_NEXT_CLASSES}
# what transformers calls the q/k norms of --qk-layernorm, by architecture
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")


class ConversionError(InputError):
    """A model or tokenizer the other side cannot represent exactly, or a malformed input."""


# -- which Hugging Face architecture a megalite model is ------------------------------------------
def hf_architecture(cfg: dict, prefer: str | None = None) -> str:
    """A key of HF_CLASSES for a megalite model_config (`prefer`: convert.py's --hf-architecture, where
    more than one class computes the model); ConversionError naming the flag otherwise."""
    def refuse(setting: str, target: str):
        raise ConversionError(f"cannot export to Hugging Face: {setting}, which {target} cannot express "
                              "(the export would be a different model)")
    if is_gated_delta_net(cfg):  # Qwen3-Next / Qwen3.5: qwen3_next.py
        return qwen3_next_architecture(cfg, refuse, prefer)
    if prefer is not None:
        refuse(f"--hf-architecture {prefer} for a model without gated DeltaNet layers", "the other exports")
    if cfg.get("attention_output_gate"):
        refuse("--attention-output-gate without gated DeltaNet layers", "the GPT-2, Llama, Qwen3 and MoE exports")

    heads, groups = cfg["num_attention_heads"], cfg.get("num_query_groups") or cfg["num_attention_heads"]
    if cfg.get("mtp_num_layers") and not cfg.get("multi_latent_attention"):
        refuse(f"--mtp-num-layers {cfg['mtp_num_layers']} without --multi-latent-attention",
               "every export but DeepseekV3ForCausalLM's and DeepseekV32ForCausalLM's (the MLA ones here that store "
               "MTP modules)")
    if is_gpt_oss(cfg):  # sinks, sliding windows, the clamped GLU: gpt_oss.py
        return gpt_oss_architecture(cfg, refuse)
    # the attention and MLP variants (docs/models.md) without a mapping yet: none of the classes below has them
    for key, flag, plain in (("window_size", "--window-size", None), ("softmax_type", "--softmax-type", "vanilla"),
                             ("quick_geglu", "--quick-geglu", False), ("glu_linear_offset", "--glu-linear-offset", 0.0),
                             ("activation_func_clamp_value", "--activation-func-clamp-value", None),
                             ("squared_relu", "--squared-relu", False),
                             ("rotary_interleaved", "--rotary-interleaved", False)):
        if cfg.get(key, plain) != plain:
            refuse(f"{flag} {cfg[key]}" if cfg[key] is not True else flag, "the GPT-2, Llama, Qwen3 and MoE exports")
    if cfg.get("multi_latent_attention"):  # deepseek.py; with DSA deepseek_v32.py
        arch = deepseek_architecture(cfg, refuse)
        return deepseek_v32_architecture(cfg, refuse) if cfg.get("experimental_attention_variant") == "dsa" else arch
    if cfg["position_embedding_type"] == "learned_absolute":
        gpt2 = "a GPT-2 style model (--position-embedding-type learned_absolute) as GPT2LMHeadModel"
        if cfg["normalization"] != "LayerNorm":
            refuse(f"--normalization {cfg['normalization']} with learned absolute positions", gpt2)
        if cfg["swiglu"]:
            refuse("--swiglu with learned absolute positions", gpt2)
        if not cfg["add_bias_linear"]:
            refuse("--disable-bias-linear with learned absolute positions", gpt2)
        if groups != heads:
            refuse(f"--num-query-groups {groups} (grouped-query attention) with learned absolute positions", gpt2)
        if cfg.get("num_experts"):
            refuse(f"--num-experts {cfg['num_experts']} with learned absolute positions", gpt2)
        if cfg.get("qk_layernorm"):
            refuse("--qk-layernorm with learned absolute positions", gpt2)
        if cfg["kv_channels"] * heads != cfg["hidden_size"]:
            refuse(f"--kv-channels {cfg['kv_channels']} != --hidden-size / --num-attention-heads "
                   f"({cfg['hidden_size']} / {heads})", gpt2)
        return "gpt2"
    if cfg["position_embedding_type"] in ("rope", "yarn"):  # yarn: transformers' rope_type "yarn"
        llama = "a RoPE model as LlamaForCausalLM"
        if cfg["normalization"] != "RMSNorm":
            refuse(f"--normalization {cfg['normalization']} with --position-embedding-type "
                   f"{cfg['position_embedding_type']}", llama)
        if not cfg["swiglu"]:
            refuse(f"a GeLU MLP (no --swiglu) with --position-embedding-type {cfg['position_embedding_type']}", llama)
        if cfg.get("rotary_percent", 1.0) != 1.0:
            refuse(f"--rotary-percent {cfg['rotary_percent']} (Llama rotates every head channel)", llama)
        if cfg.get("use_rope_scaling") and cfg.get("rotary_seq_len_interpolation_factor"):
            refuse("--use-rope-scaling with --rotary-seq-len-interpolation-factor (one rope_type at a time)", llama)
        if cfg.get("openai_gelu"):
            refuse("--openai-gelu with --swiglu", llama)
        if cfg.get("num_experts"):
            return moe_architecture(cfg, refuse)
        if cfg.get("qk_layernorm"):
            return _qwen3_architecture(cfg, refuse)
        if cfg.get("add_qkv_bias") and not cfg["add_bias_linear"]:
            refuse("--add-qkv-bias with --disable-bias-linear (Llama's attention_bias puts a bias on the output "
                   "projection too)", llama)
        return "llama"
    raise ConversionError(f"--position-embedding-type {cfg['position_embedding_type']!r} has no Hugging Face mapping")


def _qwen3_architecture(cfg: dict, refuse) -> str:
    """"qwen3" for a dense Llama-like model with --qk-layernorm: Qwen3's attention_bias biases
    q, k, v and the output projection together and its MLP has none, neither of megalite's bias
    switches."""
    qwen3 = "a model with --qk-layernorm as Qwen3ForCausalLM"
    if cfg["add_bias_linear"]:
        refuse("--qk-layernorm without --disable-bias-linear (biases on every linear layer; Qwen3's MLP has none)",
               qwen3)
    if cfg.get("add_qkv_bias"):
        refuse("--add-qkv-bias with --qk-layernorm (Qwen3's attention_bias puts a bias on the output projection too)",
               qwen3)
    return "qwen3"


# -- configs ---------------------------------------------------------------------------------------
def transformers_class(name: str, architecture: str):
    """transformers.<name>, or a ConversionError saying the installed transformers predates it
    (Qwen3 and Qwen3-MoE came with 4.51)."""
    import transformers

    try:
        return getattr(transformers, name)
    except AttributeError:
        raise ConversionError(f"{architecture} needs a newer transformers than the installed "
                              f"{transformers.__version__} (it has no {name})") from None


# GPT2Config.activation_function -> megalite's openai_gelu. gelu_new, gelu_pytorch_tanh and
# gelu_fast are one function (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), Hendrycks & Gimpel 2016),
# written three ways; "gelu" is the exact erf form.
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}


# keys each transformers rope_type may carry, besides rope_type / type / rope_theta
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "mscale",
                       "mscale_all_dim", "attention_factor")}
# transformers' YaRN keys that may be left out (its defaults, as megalite's flags')
YARN_OPTIONAL = {"beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "attention_factor"}


def hf_rope(cfg: dict) -> tuple[dict, dict | None]:
    """(transformers 5 `rope_parameters`, transformers 4.x `rope_scaling`) of a megalite model_config."""
    if cfg.get("use_rope_scaling"):
        scaling = {"rope_type": "llama3", "factor": float(cfg["rope_scaling_factor"]),
                   "low_freq_factor": float(cfg["rope_scaling_low_freq_factor"]),
                   "high_freq_factor": float(cfg["rope_scaling_high_freq_factor"]),
                   "original_max_position_embeddings": int(cfg["rope_scaling_original_max_position_embeddings"])}
    elif cfg["position_embedding_type"] == "yarn" or deepseek_yarn(cfg):  # MLA's: --rope-type yarn
        scaling = hf_yarn(cfg)
    elif cfg.get("rotary_seq_len_interpolation_factor"):
        scaling = {"rope_type": "linear", "factor": float(cfg["rotary_seq_len_interpolation_factor"])}
    else:
        scaling = None
    params = dict(scaling or {"rope_type": "default"}, rope_theta=float(cfg["rotary_base"]))
    return params, scaling


def hf_yarn(cfg: dict) -> dict:
    """transformers' rope_type "yarn" of --position-embedding-type yarn. The concentration factor is
    written out as attention_factor: transformers reads mscale / mscale_all_dim only when both are
    non-zero (Megatron-LM's --mscale-all-dim defaults to 0), so they alone could not say it."""
    from ...model.attention import yarn_concentration
    factor, mscale, mscale_all_dim = (float(cfg[k]) for k in ("rotary_scaling_factor", "mscale", "mscale_all_dim"))
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(cfg["yarn_original_max_position_embeddings"]),
            "beta_fast": float(cfg["yarn_beta_fast"]), "beta_slow": float(cfg["yarn_beta_slow"]),
            "truncate": bool(cfg["yarn_correction_range_round_to_int"]), "mscale": mscale,
            "mscale_all_dim": mscale_all_dim, "attention_factor": yarn_concentration(factor, mscale, mscale_all_dim)}


def yarn_from_hf(d: dict, refuse) -> dict:
    """megalite's YaRN settings of transformers' rope_type "yarn" (its `_compute_yarn_parameters`
    rules: beta_fast 32, beta_slow 1 and truncate True by default; attention_factor, else
    mscale / mscale_all_dim when both are non-zero, else 0.1·ln(factor) + 1). An attention_factor
    that mscale / mscale_all_dim do not give is written as --mscale with --mscale-all-dim 0."""
    import math
    from ...model.attention import yarn_concentration
    factor = float(d["factor"])
    mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
    pair = (float(mscale), float(mscale_all_dim)) if (mscale and mscale_all_dim) else (1.0, 0.0)
    wanted = d.get("attention_factor")
    if wanted is not None and not math.isclose(yarn_concentration(factor, *pair), wanted, rel_tol=1e-12):
        if factor <= 1:
            refuse(f"rope_parameters.attention_factor {wanted} with factor {factor} (YaRN scales cos/sin only when "
                   "factor > 1)")
        pair = ((wanted - 1.0) / (0.1 * math.log(factor)), 0.0)
    return dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                yarn_beta_fast=float(d.get("beta_fast") or 32.0), yarn_beta_slow=float(d.get("beta_slow") or 1.0),
                yarn_correction_range_round_to_int=bool(d.get("truncate", True)), mscale=pair[0],
                mscale_all_dim=pair[1])


def rope_from_hf(raw: dict, model_type: str = "llama") -> dict:
    """megalite's RoPE settings of a config.json in either layout: transformers 5's `rope_parameters`,
    or 4.x's `rope_theta` + `rope_scaling` (with "rope_type" or the older "type"). Read from the
    file itself, so that the installed transformers version cannot drop or default a field."""
    def refuse(what: str):
        raise ConversionError(f"cannot import {model_type} model: {what}, which megalite does not implement")

    def parse(field: str, d: dict) -> dict:
        kind = d.get("rope_type", d.get("type", "default"))
        if "type" in d and "rope_type" in d and d["type"] != d["rope_type"]:
            refuse(f"{field}.type {d['type']!r} with {field}.rope_type {d['rope_type']!r}")
        if kind not in ROPE_TYPES:
            refuse(f"{field}.rope_type {kind!r} (megalite implements default, linear, llama3 and yarn RoPE)")
        allowed = {"rope_type", "type", "rope_theta", *ROPE_TYPES[kind]}
        if d.get("partial_rotary_factor", 1.0) == 1.0:
            allowed.add("partial_rotary_factor")  # every channel rotated: plain RoPE
        extra = sorted(set(d) - allowed)
        if extra:
            refuse(f"{field}.{extra[0]} = {d[extra[0]]!r} with rope_type {kind!r}")
        needed = [k for k in ROPE_TYPES[kind] if d.get(k) is None and k not in YARN_OPTIONAL
                  and (k != "original_max_position_embeddings" or kind == "yarn")]
        if needed:
            refuse(f"{field}.rope_type {kind!r} without {field}.{needed[0]}")
        out = dict(rotary_base=float(d.get("rope_theta") or raw.get("rope_theta") or 10000.0),
                   use_rope_scaling=kind == "llama3", rotary_seq_len_interpolation_factor=None,
                   position_embedding_type="rope")
        if kind == "yarn":
            out.update(yarn_from_hf(d, refuse))
        if kind == "linear":
            out["rotary_seq_len_interpolation_factor"] = float(d["factor"])
        if kind == "llama3":  # transformers falls back to max_position_embeddings, as here
            out.update(rope_scaling_factor=float(d["factor"]), rope_scaling_low_freq_factor=float(d["low_freq_factor"]),
                       rope_scaling_high_freq_factor=float(d["high_freq_factor"]),
                       rope_scaling_original_max_position_embeddings=int(
                           d.get("original_max_position_embeddings") or raw["max_position_embeddings"]))
        return out

    layouts = [(f, raw[f]) for f in ("rope_parameters", "rope_scaling") if raw.get(f) is not None]
    for f, d in layouts:
        if not isinstance(d, dict) or any(isinstance(v, dict) for v in d.values()):
            refuse(f"{f} {d!r} (one RoPE setting for every layer expected)")
    parsed = [parse(f, d) for f, d in layouts] or [parse("rope_scaling", {})]
    if len(parsed) == 2 and parsed[0] != parsed[1]:
        raise ConversionError(f"cannot import {model_type} model: its config.json's rope_parameters {raw['rope_parameters']} "
                              f"and rope_scaling {raw['rope_scaling']} (with rope_theta {raw.get('rope_theta')}) disagree")
    return parsed[0]


def hf_config(cfg: dict, bos_id: int | None = None, eos_id: int | None = None, arch: str | None = None):
    """The transformers config of a megalite model_config (raises if it has none)."""
    from transformers import GPT2Config, LlamaConfig

    arch = arch or hf_architecture(cfg)
    common = dict(vocab_size=cfg["vocab_size"], bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
                  initializer_range=cfg.get("init_method_std", 0.02),
                  tie_word_embeddings=not cfg["untie_embeddings_and_output_weights"])
    if arch == "gpt2":
        return GPT2Config(
            n_embd=cfg["hidden_size"], n_layer=cfg["num_layers"], n_head=cfg["num_attention_heads"],
            n_inner=cfg["ffn_hidden_size"], n_positions=cfg["max_position_embeddings"],
            activation_function="gelu_new" if cfg.get("openai_gelu") else "gelu",  # tanh approximation or exact erf
            layer_norm_epsilon=cfg["norm_epsilon"], resid_pdrop=cfg.get("hidden_dropout", 0.0),
            embd_pdrop=cfg.get("hidden_dropout", 0.0), attn_pdrop=cfg.get("attention_dropout", 0.0),
            architectures=["GPT2LMHeadModel"], **common)
    if arch in QWEN3_NEXT_CLASSES:
        return qwen3_next_hf_config(cfg, arch, common, transformers_class)
    rope_parameters, _ = hf_rope(cfg)
    if arch == "deepseek_v3":
        return deepseek_hf_config(cfg, common, rope_parameters, transformers_class)
    if arch == "deepseek_v32":
        return deepseek_v32_hf_config(cfg, common, rope_parameters, transformers_class)
    rope_model = dict(  # what every Llama-style config takes
        hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_query_groups"],
        head_dim=cfg["kv_channels"], hidden_act="silu", max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["norm_epsilon"], rope_parameters=rope_parameters,
        attention_dropout=cfg.get("attention_dropout", 0.0), **common)
    if arch in HF_MOE_CLASSES:
        return moe_hf_config(cfg, arch, rope_model, transformers_class)
    if arch == "qwen3":
        Qwen3Config = transformers_class("Qwen3Config", "Qwen3ForCausalLM")
        return Qwen3Config(intermediate_size=cfg["ffn_hidden_size"], attention_bias=False, use_sliding_window=False,
                           architectures=[HF_CLASSES[arch]], **rope_model)
    return LlamaConfig(intermediate_size=cfg["ffn_hidden_size"], attention_bias=cfg["add_bias_linear"],
                       mlp_bias=cfg["add_bias_linear"], architectures=["LlamaForCausalLM"], **rope_model)


def _rope_model_from_hf(c, raw: dict, refuse) -> dict:
    """The settings a Llama-style config (Llama, Mixtral, Qwen2-MoE) states alike."""
    if c.hidden_act != "silu":
        refuse(f"hidden_act {c.hidden_act!r} (megalite's SwiGLU uses silu)")
    heads = c.num_attention_heads
    return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
                num_query_groups=c.num_key_value_heads or heads,
                kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
                seq_length=c.max_position_embeddings, max_position_embeddings=c.max_position_embeddings,
                rotary_percent=1.0, **rope_from_hf(raw, c.model_type),
                normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True, hidden_dropout=0.0,
                attention_dropout=float(c.attention_dropout or 0.0))


def _refuse_qwen3_attention(c, refuse) -> None:
    """What a Qwen3 / Qwen3-MoE attention may have that megalite's cannot."""
    if c.attention_bias:
        refuse("attention_bias true (biases on q, k, v and o_proj; megalite's --add-qkv-bias has none on the "
               "output projection)")
    if getattr(c, "use_sliding_window", False) or "sliding_attention" in (getattr(c, "layer_types", None) or []):
        refuse("use_sliding_window / layer_types 'sliding_attention' (the import does not map Hugging Face's "
               "sliding windows to --window-size)")


def config_from_hf(c, raw: dict) -> dict:
    """megalite model_config (without padded_vocab_size) of a transformers config and its config.json."""
    def refuse(what: str):
        raise ConversionError(f"cannot import {c.model_type} model: {what}, which megalite does not implement")

    common = dict(vocab_size=c.vocab_size, init_method_std=getattr(c, "initializer_range", 0.02),
                  untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", True))
    if c.model_type == "gpt2":
        if c.activation_function not in GPT2_ACTIVATIONS:
            refuse(f"activation_function {c.activation_function!r} (megalite's GeLU MLP computes "
                   f"{', '.join(repr(a) for a in GPT2_ACTIVATIONS)})")
        if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn or not c.scale_attn_weights:
            refuse("non-default attention scaling (scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn / "
                   "scale_attn_weights)")
        if getattr(c, "add_cross_attention", False):
            refuse("cross-attention")
        return dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                    num_query_groups=c.n_head, kv_channels=c.n_embd // c.n_head,
                    ffn_hidden_size=c.n_inner or 4 * c.n_embd, seq_length=c.n_positions,
                    max_position_embeddings=c.n_positions, position_embedding_type="learned_absolute",
                    normalization="LayerNorm", norm_epsilon=c.layer_norm_epsilon, swiglu=False,
                    add_bias_linear=True, hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
                    openai_gelu=GPT2_ACTIVATIONS[c.activation_function], **common)
    if c.model_type == "llama":
        if bool(c.attention_bias) != bool(c.mlp_bias):
            refuse(f"attention_bias {c.attention_bias} with mlp_bias {c.mlp_bias} (megalite has one switch, "
                   "--disable-bias-linear)")
        return dict(_rope_model_from_hf(c, raw, refuse), ffn_hidden_size=c.intermediate_size,
                    add_bias_linear=bool(c.attention_bias), **common)
    if c.model_type in QK_NORM_ARCHS:
        _refuse_qwen3_attention(c, refuse)
    if c.model_type == "qwen3":
        return dict(_rope_model_from_hf(c, raw, refuse), ffn_hidden_size=c.intermediate_size, add_bias_linear=False,
                    qk_layernorm=True, **common)
    if c.model_type == "gpt_oss":
        return {**_rope_model_from_hf(c, raw, refuse), **common, **gpt_oss_config_from_hf(c, refuse)}
    if c.model_type == "deepseek_v3":
        return dict(deepseek_config_from_hf(c, raw, rope_from_hf(raw, c.model_type), refuse), **common)
    if c.model_type == "deepseek_v32":
        return dict(deepseek_v32_config_from_hf(c, raw, rope_from_hf(raw, c.model_type), refuse), **common)
    if c.model_type in QWEN3_NEXT_CLASSES:
        return dict(qwen3_next_config_from_hf(c, raw, refuse), **common)
    if c.model_type in HF_MOE_CLASSES:
        return dict(_rope_model_from_hf(c, raw, refuse), add_bias_linear=False, **moe_config_from_hf(c, refuse),
                    **common)
    raise ConversionError(f"model_type {c.model_type!r}: only " + ", ".join(f"{k} ({v})" for k, v in HF_CLASSES.items())
                          + " directories can be imported")


def update_json(path: str, **values) -> None:
    with open(path) as f:
        d = json.load(f)
    d.update(values)
    with open(path, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)


def pretrain_flags(cfg: dict) -> list[str]:
    """pretrain_gpt.py model flags that build `cfg` (to continue training with --load --finetune)."""
    flags = ["--num-layers", cfg["num_layers"], "--hidden-size", cfg["hidden_size"],
             "--num-attention-heads", cfg["num_attention_heads"], "--ffn-hidden-size", cfg["ffn_hidden_size"],
             "--kv-channels", cfg["kv_channels"], "--max-position-embeddings", cfg["max_position_embeddings"],
             "--position-embedding-type", cfg["position_embedding_type"], "--normalization", cfg["normalization"],
             "--norm-epsilon", cfg["norm_epsilon"], "--vocab-size", cfg["vocab_size"]]
    if cfg["num_query_groups"] != cfg["num_attention_heads"]:
        flags += ["--group-query-attention", "--num-query-groups", cfg["num_query_groups"]]
    if cfg["position_embedding_type"] in ("rope", "yarn"):
        flags += ["--rotary-base", cfg["rotary_base"]]
        if cfg.get("rotary_percent", 1.0) != 1.0:
            flags += ["--rotary-percent", cfg["rotary_percent"]]
        if cfg.get("use_rope_scaling"):
            flags += ["--use-rope-scaling", "--rope-scaling-factor", cfg["rope_scaling_factor"],
                      "--rope-scaling-low-freq-factor", cfg["rope_scaling_low_freq_factor"],
                      "--rope-scaling-high-freq-factor", cfg["rope_scaling_high_freq_factor"],
                      "--rope-scaling-original-max-position-embeddings",
                      cfg["rope_scaling_original_max_position_embeddings"]]
        if cfg.get("rotary_seq_len_interpolation_factor"):
            flags += ["--rotary-seq-len-interpolation-factor", cfg["rotary_seq_len_interpolation_factor"]]
    if cfg.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    if cfg["position_embedding_type"] == "yarn":
        flags += ["--rotary-scaling-factor", cfg["rotary_scaling_factor"], "--yarn-original-max-position-embeddings",
                  cfg["yarn_original_max_position_embeddings"], "--yarn-beta-fast", cfg["yarn_beta_fast"],
                  "--yarn-beta-slow", cfg["yarn_beta_slow"], "--mscale", cfg["mscale"],
                  "--mscale-all-dim", cfg["mscale_all_dim"]]
        if not cfg["yarn_correction_range_round_to_int"]:
            flags.append("--no-yarn-correction-range-round-to-int")
    if cfg.get("openai_gelu"):
        flags.append("--openai-gelu")
    if cfg["swiglu"]:
        flags.append("--swiglu")
    if not cfg["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if cfg["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += moe_flags(cfg) + deepseek_flags(cfg) + deepseek_v32_flags(cfg) + qwen3_next_flags(cfg)
    return [str(f) for f in flags]
