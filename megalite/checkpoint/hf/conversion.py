"""Hugging Face `transformers` interchange: megalite weights <-> a local model directory.

These architectures cover what megalite trains, and each maps tensor by tensor, with no loss:

    GPT-2 style   learned absolute positions, LayerNorm, GeLU, biases, multi-head attention
                  -> GPT2LMHeadModel (activation_function "gelu" for exact GeLU, GPT-2's own
                  "gelu_new" for --openai-gelu's tanh approximation)
    Llama style   RoPE (rotate-half), RMSNorm, SwiGLU, optional GQA / biases / untied output,
                  Llama 3.1 RoPE scaling (--use-rope-scaling), position interpolation
                  (--rotary-seq-len-interpolation-factor) or YaRN (--position-embedding-type yarn)
                  -> LlamaForCausalLM
    Llama style with --qk-layernorm (an RMSNorm over each head's query and key, before RoPE;
                  no biases) -> Qwen3ForCausalLM (`self_attn.q_norm` / `k_norm`)
    Llama style with Mixture-of-Experts layers (moe.py)
                  -> MixtralForCausalLM (every layer MoE, no shared expert), or
                     Qwen2MoeForCausalLM (a gated shared expert; dense layers, q/k/v biases), or
                     Qwen3MoeForCausalLM (--qk-layernorm, no shared expert; dense layers), or
                     GptOssForCausalLM (sinks, sliding windows, biased experts and router, the
                     clamped GLU; gpt_oss.py)
    Multi-latent attention (--multi-latent-attention) with DeepSeek-V3's MoE (deepseek.py)
                  -> DeepseekV3ForCausalLM

Anything else (RoPE with LayerNorm, partial rotary, GQA in a GPT-2 model, ...) is refused with
the setting named: a converter that silently produced a *different* model would be worse than
none. Weights travel as safetensors only (never pickles), all in fp32.

Layouts that differ between the two sides (the only non-trivial part):
- megalite's fused QKV weight is laid out by query group, rows [ng, (np/ng q, 1 k, 1 v), hn];
  GPT-2's c_attn is [all q; all k; all v] and Llama has separate q/k/v projections.
- GPT-2's Conv1D stores weights as [in, out], the transpose of nn.Linear's.
- megalite's SwiGLU fc1 is [gate; up]; Llama has gate_proj and up_proj.

The tokenizer goes along: GPT-2 BPE files, a SentencePiece model or a Hugging Face tokenizer
directory become a `tokenizer.json` that AutoTokenizer loads, checked on text to give the same
ids as megalite's own tokenizer (tokenizer.py). The architecture check, the configs both ways
and the flags of an imported model are in config.py; this module maps the weights.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

import torch

from ...model import pad_vocab_size
from .config import (HF_CLASSES, ConversionError, config_from_hf, hf_architecture, hf_config, hf_rope, rope_from_hf,
                        update_json)
from .deepseek import deepseek_mtp_depth, deepseek_state, deepseek_tensors
from .dequantize import dequantize_weights
from .moe import moe_mlp_rules, moe_pattern, moe_prefix
from .deepseek_v32 import deepseek_v32_state, deepseek_v32_tensors
from .qwen3_next import QWEN3_NEXT_CLASSES, qwen3_next_mtp_depth, qwen3_next_state, qwen3_next_tensors
from .tables import Rule, export_tensors, glu, import_tensors, mapped, same, transposed, under
from .tokenizer import export_tokenizer, has_tokenizer_files, special_ids

WORD_EMBEDDING = "embedding.word_embeddings.weight"
# tensors a transformers checkpoint may carry that are buffers, not weights
_HF_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


# megalite's projection layers and GPT-2's Conv1D names for them (weights transposed both ways)
GPT2_PROJECTIONS = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                    ("mlp.linear_fc2", "mlp.c_proj"))


# --qk-layernorm's per-head norms and Qwen3's names for them (one weight of head_dim, shared by the heads)
QK_NORMS = (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"))


# --softmax-type learnable's sink logits and gpt-oss's name for them (one per head)
SINKS = ("self_attention.core_attention.softmax_offset", "self_attn.sinks")


# -- fused QKV <-> separate Q, K, V ---------------------------------------------------------------
def split_qkv(w: torch.Tensor, heads: int, groups: int, hn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megalite's per-group rows [ng, (np/ng q, k, v), hn] (weight [.., h] or bias) -> q [np·hn],
    k [ng·hn], v [ng·hn], each head-major as Hugging Face expects."""
    rest = tuple(w.shape[1:])
    g = w.reshape(groups, heads // groups + 2, hn, *rest)
    q = g[:, :-2].reshape(heads * hn, *rest)
    return q, g[:, -2].reshape(groups * hn, *rest), g[:, -1].reshape(groups * hn, *rest)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, hn: int) -> torch.Tensor:
    """Inverse of split_qkv."""
    rest = tuple(q.shape[1:])
    q = q.reshape(groups, heads // groups, hn, *rest)
    k, v = k.reshape(groups, 1, hn, *rest), v.reshape(groups, 1, hn, *rest)
    return torch.cat([q, k, v], dim=1).reshape((heads + 2 * groups) * hn, *rest)


# -- the name tables (tables.py), read both ways ---------------------------------------------------
# Hugging Face's names here are under the model's prefix ("transformer." for GPT-2, "model." else),
# which the export writes and the import strips.
def gpt2_outer_rules() -> list[Rule]:
    """GPT2LMHeadModel's tensors outside the layers (the output layer aside: tied, or lm_head)."""
    return [same(WORD_EMBEDDING, "wte.weight"), same("embedding.position_embeddings.weight", "wpe.weight"),
            same("decoder.final_layernorm.weight", "ln_f.weight"), same("decoder.final_layernorm.bias", "ln_f.bias")]


def gpt2_layer_rules(cfg: dict) -> list[Rule]:
    """One GPT-2 layer: Conv1D holds [in, out], so every projection weight is transposed; c_attn is
    [q; k; v] where megalite's QKV rows go by query group."""
    heads, hn, hidden = cfg["num_attention_heads"], cfg["kv_channels"], cfg["hidden_size"]

    def qkv_out(w):
        return torch.cat(split_qkv(w, heads, heads, hn))

    def qkv_back(w):
        return fuse_qkv(*w.split(hidden), heads, heads, hn)

    rules = [same(f"{ours}.{kind}", f"{theirs}.{kind}") for kind in ("weight", "bias")
             for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))]
    rules += [mapped("self_attention.linear_qkv.weight", "attn.c_attn.weight", lambda w: qkv_out(w).t(),
                     lambda w: qkv_back(w.t())),
              mapped("self_attention.linear_qkv.bias", "attn.c_attn.bias", qkv_out, qkv_back)]
    for ours, theirs in GPT2_PROJECTIONS:
        rules += [transposed(ours + ".weight", theirs + ".weight"), same(ours + ".bias", theirs + ".bias")]
    return rules


def llama_outer_rules() -> list[Rule]:
    """A Llama-style model's tensors outside the layers (the output layer aside)."""
    return [same(WORD_EMBEDDING, "embed_tokens.weight"), same("decoder.final_layernorm.weight", "norm.weight")]


def llama_layer_rules(cfg: dict, moe: bool, arch: str = "llama", mlp_prefix: str = "mlp.") -> list[Rule]:
    """One Llama-style layer: q, k, v projections from megalite's fused QKV, Qwen3's q_norm /
    k_norm (RMSNorm over head_dim; config.py checks), gpt-oss's sinks (config.py checks), and the
    MLP: [gate; up] as gate_proj and up_proj, or an MoE layer's (moe.py) under `mlp_prefix`."""
    heads, groups, hn = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["kv_channels"]
    kinds = ("weight", "bias") if cfg["add_bias_linear"] else ("weight",)
    qkv_kinds = ("weight", "bias") if cfg["add_bias_linear"] or cfg.get("add_qkv_bias") else ("weight",)
    rules = [same("input_layernorm.weight", "input_layernorm.weight"),
             same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    rules += [Rule((f"self_attention.linear_qkv.{kind}",), tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                   lambda t: list(split_qkv(t[0], heads, groups, hn)), lambda t: [fuse_qkv(*t, heads, groups, hn)])
              for kind in qkv_kinds]
    if cfg.get("qk_layernorm"):
        rules += [same(ours, theirs) for ours, theirs in QK_NORMS]
    if cfg.get("softmax_type") == "learnable":
        rules.append(same(*SINKS))
    rules += [same(f"self_attention.linear_proj.{kind}", f"self_attn.o_proj.{kind}") for kind in kinds]
    if moe:
        return rules + under("mlp.", mlp_prefix, moe_mlp_rules(cfg, arch))
    for kind in kinds:
        rules += [glu(f"mlp.linear_fc1.{kind}", f"mlp.gate_proj.{kind}", f"mlp.up_proj.{kind}"),
                  same(f"mlp.linear_fc2.{kind}", f"mlp.down_proj.{kind}")]
    return rules


# -- megalite -> Hugging Face ---------------------------------------------------------------------
def _gpt2_tensors(cfg: dict, state: dict) -> dict:
    out = gpt2_outer_tensors(cfg, state)
    for i in range(cfg["num_layers"]):
        out.update(gpt2_layer_tensors(cfg, state, i))
    return out


def gpt2_outer_tensors(cfg: dict, state: dict) -> dict:
    """GPT2LMHeadModel's tensors outside the layers (popped from `state`)."""
    return _outer_tensors(cfg, state, gpt2_outer_rules(), "transformer.")


def _outer_tensors(cfg: dict, state: dict, rules: list[Rule], prefix: str) -> dict:
    """The tensors outside the layers, and lm_head when the output layer is untied (tied, it is the
    embedding; the import reads lm_head in from_hf)."""
    out = export_tensors(rules, state, h=prefix)
    if cfg["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    return out


def gpt2_layer_tensors(cfg: dict, state: dict, i: int) -> dict:
    """GPT2LMHeadModel's tensors of layer i (popped from `state`: one layer's is enough, which lets
    a converter stream layer by layer)."""
    return export_tensors(gpt2_layer_rules(cfg), state, f"decoder.layers.{i}.", f"transformer.h.{i}.")


def _llama_tensors(cfg: dict, state: dict, arch: str = "llama") -> dict:
    """LlamaForCausalLM's tensors, or Mixtral's / Qwen2-MoE's (their MoE layers: moe.py)."""
    out = llama_outer_tensors(cfg, state)
    for i in range(cfg["num_layers"]):
        out.update(llama_layer_tensors(cfg, state, i, arch))
    return out


def llama_outer_tensors(cfg: dict, state: dict) -> dict:
    """A Llama-style model's tensors outside the layers (popped from `state`)."""
    return _outer_tensors(cfg, state, llama_outer_rules(), "model.")


def llama_layer_tensors(cfg: dict, state: dict, i: int, arch: str = "llama") -> dict:
    """A Llama-style model's tensors of layer i (popped from `state`; one layer's is enough)."""
    rules = llama_layer_rules(cfg, moe_pattern(cfg)[i], arch, moe_prefix(cfg, arch))
    return export_tensors(rules, state, f"decoder.layers.{i}.", f"model.layers.{i}.")


def to_hf(meta: dict, state: dict[str, torch.Tensor], out_dir: str, tokenizer=None,
          architecture: str | None = None) -> str:
    """Write a Hugging Face model directory (config.json, generation_config.json,
    model.safetensors, and the tokenizer files when `tokenizer`, a megalite tokenizer, is given).
    Returns the architecture name, a key of HF_CLASSES ("gpt2", "llama", "qwen3", "mixtral", "qwen2_moe",
    "qwen3_moe", ...); `architecture` picks one where several compute the model (--hf-architecture)."""
    from safetensors.torch import save_file

    cfg = meta["model_config"]
    arch = export_architecture(cfg, tokenizer, architecture)  # refuse before writing anything
    state = dict(state)
    if cfg.get("apply_layernorm_1p") and arch not in QWEN3_NEXT_CLASSES:
        # zero-centred norm weights (w - 1): Hugging Face stores w itself (Qwen3-Next's tables say their own)
        state = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in state.items()}
    if arch in QWEN3_NEXT_CLASSES:
        try:
            tensors = qwen3_next_tensors(cfg, state, arch)
        except ValueError as e:
            raise ConversionError(f"cannot export to Hugging Face: {e}") from None
    else:
        tensors = {"gpt2": _gpt2_tensors, "deepseek_v3": deepseek_tensors, "deepseek_v32": deepseek_v32_tensors}.get(
            arch, lambda c, s: _llama_tensors(c, s, arch))(cfg, state)
    if state:
        raise ConversionError(f"checkpoint {meta.get('dir', '')} has tensors the {arch} mapping does not place: "
                              f"{', '.join(sorted(state)[:5])}")
    with staged_directory(out_dir) as tmp:
        write_hf_files(cfg, arch, tmp, tokenizer)
        # safetensors refuses shared or strided storage: give every tensor its own contiguous copy
        save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    return arch


def export_architecture(cfg: dict, tokenizer=None, prefer: str | None = None) -> str:
    """The Hugging Face architecture of a model_config, or a ConversionError naming what is not
    expressible (raised before anything is written)."""
    arch = hf_architecture(cfg, prefer)
    if tokenizer is not None and tokenizer.vocab_size > cfg["vocab_size"]:
        raise ConversionError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg['vocab_size']} vocabulary rows (--vocab-size)")
    return arch


def write_hf_files(cfg: dict, arch: str, out_dir: str, tokenizer=None) -> None:
    """config.json, generation_config.json and (with `tokenizer`) the tokenizer files."""
    from transformers import GenerationConfig
    bos, eos = special_ids(tokenizer)
    config = hf_config(cfg, bos, eos, arch)
    config.save_pretrained(out_dir)
    if arch != "gpt2" and arch not in QWEN3_NEXT_CLASSES:  # also the 4.x layout, which older transformers reads
        update_json(os.path.join(out_dir, "config.json"), rope_theta=float(cfg["rotary_base"]),
                    rope_scaling=hf_rope(cfg)[1])
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    if tokenizer is not None:
        export_tokenizer(tokenizer, out_dir)


@contextlib.contextmanager
def staged_directory(out_dir: str):
    """A fresh directory beside `out_dir`, renamed to it when the block completes: a failure leaves
    no half-written model. A fresh name (never an existing directory, which could be someone's
    data) that dies with us."""
    out_dir = os.path.normpath(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the model directory's
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)


# -- Hugging Face -> megalite ---------------------------------------------------------------------
def read_safetensors(in_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as fp32."""
    from safetensors.torch import load_file

    index = os.path.join(in_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(in_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"--load-dir {in_dir}: no model.safetensors (or model.safetensors.index.json); "
                              "only safetensors weights are read (pickled .bin files are not trusted)")
    out = {}
    for name in files:
        path = os.path.join(in_dir, name)
        try:
            tensors = load_file(path)
        except Exception as e:  # safetensors' own error for a truncated or foreign file
            raise ConversionError(f"--load-dir {in_dir}: {path} cannot be read as safetensors "
                                  f"({type(e).__name__}: {e})") from None
        for k, v in tensors.items():
            out[k] = v.float()
    return out


def _gpt2_state(cfg: dict, hf: dict) -> dict:
    out = import_tensors(gpt2_outer_rules(), hf)
    for i in range(cfg["num_layers"]):
        out.update(import_tensors(gpt2_layer_rules(cfg), hf, f"decoder.layers.{i}.", f"h.{i}."))
    return out


def _llama_state(cfg: dict, hf: dict, arch: str = "llama") -> dict:
    out = import_tensors(llama_outer_rules(), hf)
    for i, moe in enumerate(moe_pattern(cfg)):
        h = f"layers.{i}."
        rules = llama_layer_rules(cfg, moe, arch, moe_prefix(cfg, arch, hf, h) if moe else "mlp.")
        out.update(import_tensors(rules, hf, f"decoder.layers.{i}.", h))
    return out


def _refuse_import(in_dir: str, what: str):
    raise ConversionError(f"--load-dir {in_dir}: {what}, which megalite cannot import")


def from_hf(in_dir: str) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """(model_config, run config record, state) of a local Hugging Face directory of one of HF_CLASSES:
    everything save_full_state_dict needs. The args name the directory as the tokenizer
    (HuggingFaceTokenizer) when it holds tokenizer files."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(in_dir, "config.json")):
        raise ConversionError(f"--load-dir {in_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(os.path.join(in_dir, "config.json")) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConversionError(f"--load-dir {in_dir}: config.json cannot be read ({type(e).__name__}: {e})") from None
    if raw.get("model_type") in HF_CLASSES and raw["model_type"] not in ("gpt2", *QWEN3_NEXT_CLASSES):
        # refuse what megalite cannot compute before transformers validates (or drops) it
        rope_from_hf(raw, raw["model_type"])
    try:
        hf_cfg = AutoConfig.from_pretrained(in_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # transformers' ways of saying the config is unreadable
        raise ConversionError(f"--load-dir {in_dir}: config.json cannot be read ({type(e).__name__}: {e})") from None
    cfg = config_from_hf(hf_cfg, raw)
    hf = dequantize_weights(read_safetensors(in_dir), raw.get("quantization_config"),
                            lambda what: _refuse_import(in_dir, what))  # released FP8 checkpoints
    # GPT2LMHeadModel prefixes "transformer.", the others "model."; the original GPT-2 files have none
    prefix = "transformer." if cfg["position_embedding_type"] == "learned_absolute" else "model."
    lm_head = hf.pop("lm_head.weight", None)
    hf = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in hf.items() if not _HF_BUFFERS.search(k)}
    if hf_cfg.model_type in ("deepseek_v3", "deepseek_v32"):  # their MTP modules, stored as layers past the last
        cfg["mtp_num_layers"] = deepseek_mtp_depth(hf_cfg, hf, lambda what: _refuse_import(in_dir, what))
    elif hf_cfg.model_type in QWEN3_NEXT_CLASSES:  # its MTP modules, under mtp.*
        cfg["mtp_num_layers"] = qwen3_next_mtp_depth(cfg, raw, hf, lambda what: _refuse_import(in_dir, what))
    try:
        state = (_gpt2_state(cfg, hf) if prefix == "transformer." else deepseek_state(cfg, hf, lm_head)
                 if hf_cfg.model_type == "deepseek_v3" else deepseek_v32_state(cfg, hf, lm_head)
                 if hf_cfg.model_type == "deepseek_v32" else qwen3_next_state(cfg, hf, hf_cfg.model_type)
                 if hf_cfg.model_type in QWEN3_NEXT_CLASSES else _llama_state(cfg, hf, hf_cfg.model_type))
    except KeyError as e:
        raise ConversionError(f"--load-dir {in_dir}: weight {prefix}{e.args[0]} is missing") from None
    except ValueError as e:
        raise ConversionError(f"--load-dir {in_dir}: {e}") from None
    if hf:
        raise ConversionError(f"--load-dir {in_dir}: weights the mapping does not place: {', '.join(sorted(hf)[:5])}")
    if cfg["untie_embeddings_and_output_weights"]:
        if lm_head is None:
            raise ConversionError(f"--load-dir {in_dir}: tie_word_embeddings is false but lm_head.weight is missing")
        state["output_layer.weight"] = lm_head
    rows = state[WORD_EMBEDDING].shape[0]
    if rows != cfg["vocab_size"]:
        raise ConversionError(f"--load-dir {in_dir}: vocab_size {cfg['vocab_size']} but the embedding has {rows} rows")
    cfg["padded_vocab_size"] = pad_vocab_size(cfg["vocab_size"], 128, 1)
    from ...config import RunConfig, TokenizerConfig
    from ...model import GPTConfig
    tokenizer = TokenizerConfig()
    if has_tokenizer_files(in_dir):
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(in_dir))
    run = RunConfig(model=GPTConfig.from_dict(cfg), tokenizer=tokenizer)
    run.model.group_query_attention = run.model.num_query_groups != run.model.num_attention_heads
    return cfg, run.to_dict(), state
