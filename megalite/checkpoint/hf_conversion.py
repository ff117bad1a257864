"""Hugging Face `transformers` interchange: megalite weights <-> a local model directory.

Two architectures cover what megalite trains, and each maps tensor by tensor, with no loss:

    GPT-2 style   learned absolute positions, LayerNorm, GeLU, biases, multi-head attention
                  -> GPT2LMHeadModel (activation_function "gelu" for exact GeLU, GPT-2's own
                  "gelu_new" for --openai-gelu's tanh approximation)
    Llama style   RoPE (rotate-half), RMSNorm, SwiGLU, optional GQA / biases / untied output,
                  Llama 3.1 RoPE scaling (--use-rope-scaling) or position interpolation
                  (--rotary-seq-len-interpolation-factor)
                  -> LlamaForCausalLM

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
ids as megalite's own tokenizer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch

from ..errors import InputError
from ..model import pad_vocab_size

WORD_EMBEDDING = "embedding.word_embeddings.weight"
# tensors a transformers checkpoint may carry that are buffers, not weights
_HF_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")
_SP_NORMAL, _SP_USER = 1, 4  # SentencePiece piece types (sentencepiece_model.proto)
SAMPLE_TEXT = ("Hello world! The quick brown fox jumps over the lazy dog.\n\nA second paragraph,  with two "
               "spaces, tabs\tand digits 0123456789; café, naïve, 日本語, emoji 🙂.\n  indented line\n"
               "<|endoftext|> <s> </s> <unk> trailing spaces   ")


class ConversionError(InputError):
    """A model or tokenizer the other side cannot represent exactly, or a malformed input."""


# megalite's projection layers and GPT-2's Conv1D names for them (weights transposed both ways)
GPT2_PROJECTIONS = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                    ("mlp.linear_fc2", "mlp.c_proj"))


# -- which Hugging Face architecture a megalite model is ------------------------------------------
def hf_architecture(cfg: dict) -> str:
    """"gpt2" or "llama" for a megalite model_config; ConversionError naming the flag otherwise."""
    def refuse(setting: str, target: str):
        raise ConversionError(f"cannot export to Hugging Face: {setting}, which {target} cannot express "
                              "(the export would be a different model)")

    heads, groups = cfg["num_attention_heads"], cfg.get("num_query_groups") or cfg["num_attention_heads"]
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
        if cfg["kv_channels"] * heads != cfg["hidden_size"]:
            refuse(f"--kv-channels {cfg['kv_channels']} != --hidden-size / --num-attention-heads "
                   f"({cfg['hidden_size']} / {heads})", gpt2)
        return "gpt2"
    if cfg["position_embedding_type"] == "rope":
        llama = "a RoPE model as LlamaForCausalLM"
        if cfg["normalization"] != "RMSNorm":
            refuse(f"--normalization {cfg['normalization']} with --position-embedding-type rope", llama)
        if not cfg["swiglu"]:
            refuse("a GeLU MLP (no --swiglu) with --position-embedding-type rope", llama)
        if cfg.get("rotary_percent", 1.0) != 1.0:
            refuse(f"--rotary-percent {cfg['rotary_percent']} (Llama rotates every head channel)", llama)
        if cfg.get("use_rope_scaling") and cfg.get("rotary_seq_len_interpolation_factor"):
            refuse("--use-rope-scaling with --rotary-seq-len-interpolation-factor (one rope_type at a time)", llama)
        if cfg.get("openai_gelu"):
            refuse("--openai-gelu with --swiglu", llama)
        return "llama"
    raise ConversionError(f"--position-embedding-type {cfg['position_embedding_type']!r} has no Hugging Face mapping")


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


# -- megalite -> Hugging Face ---------------------------------------------------------------------
def _gpt2_tensors(cfg: dict, state: dict) -> dict:
    heads, hn = cfg["num_attention_heads"], cfg["kv_channels"]
    out = {"transformer.wte.weight": state.pop(WORD_EMBEDDING),
           "transformer.wpe.weight": state.pop("embedding.position_embeddings.weight"),
           "transformer.ln_f.weight": state.pop("decoder.final_layernorm.weight"),
           "transformer.ln_f.bias": state.pop("decoder.final_layernorm.bias")}
    if cfg["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[h + f"ln_1.{kind}"] = state.pop(m + f"input_layernorm.{kind}")
            out[h + f"ln_2.{kind}"] = state.pop(m + f"pre_mlp_layernorm.{kind}")
        # Conv1D holds [in, out]: transpose every projection weight; c_attn is [q; k; v]
        w, b = state.pop(m + "self_attention.linear_qkv.weight"), state.pop(m + "self_attention.linear_qkv.bias")
        out[h + "attn.c_attn.weight"] = torch.cat(split_qkv(w, heads, heads, hn)).t()
        out[h + "attn.c_attn.bias"] = torch.cat(split_qkv(b, heads, heads, hn))
        for ours, theirs in GPT2_PROJECTIONS:
            out[h + theirs + ".weight"] = state.pop(m + ours + ".weight").t()
            out[h + theirs + ".bias"] = state.pop(m + ours + ".bias")
    return out


def _llama_tensors(cfg: dict, state: dict) -> dict:
    heads, groups, hn, ffn = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["kv_channels"], cfg["ffn_hidden_size"]
    kinds = ("weight", "bias") if cfg["add_bias_linear"] else ("weight",)
    out = {"model.embed_tokens.weight": state.pop(WORD_EMBEDDING),
           "model.norm.weight": state.pop("decoder.final_layernorm.weight")}
    if cfg["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = state.pop(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = state.pop(m + "pre_mlp_layernorm.weight")
        for kind in kinds:
            q, k, v = split_qkv(state.pop(m + f"self_attention.linear_qkv.{kind}"), heads, groups, hn)
            out[h + f"self_attn.q_proj.{kind}"], out[h + f"self_attn.k_proj.{kind}"] = q, k
            out[h + f"self_attn.v_proj.{kind}"] = v
            out[h + f"self_attn.o_proj.{kind}"] = state.pop(m + f"self_attention.linear_proj.{kind}")
            fc1 = state.pop(m + f"mlp.linear_fc1.{kind}")  # [gate; up]
            out[h + f"mlp.gate_proj.{kind}"], out[h + f"mlp.up_proj.{kind}"] = fc1[:ffn], fc1[ffn:]
            out[h + f"mlp.down_proj.{kind}"] = state.pop(m + f"mlp.linear_fc2.{kind}")
    return out


# GPT2Config.activation_function -> megalite's openai_gelu. gelu_new, gelu_pytorch_tanh and
# gelu_fast are one function (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), Hendrycks & Gimpel 2016),
# written three ways; "gelu" is the exact erf form.
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
# keys each transformers rope_type may carry, besides rope_type / type / rope_theta
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def hf_rope(cfg: dict) -> tuple[dict, dict | None]:
    """(transformers 5 `rope_parameters`, transformers 4.x `rope_scaling`) of a megalite model_config."""
    if cfg.get("use_rope_scaling"):
        scaling = {"rope_type": "llama3", "factor": float(cfg["rope_scaling_factor"]),
                   "low_freq_factor": float(cfg["rope_scaling_low_freq_factor"]),
                   "high_freq_factor": float(cfg["rope_scaling_high_freq_factor"]),
                   "original_max_position_embeddings": int(cfg["rope_scaling_original_max_position_embeddings"])}
    elif cfg.get("rotary_seq_len_interpolation_factor"):
        scaling = {"rope_type": "linear", "factor": float(cfg["rotary_seq_len_interpolation_factor"])}
    else:
        scaling = None
    params = dict(scaling or {"rope_type": "default"}, rope_theta=float(cfg["rotary_base"]))
    return params, scaling


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
            refuse(f"{field}.rope_type {kind!r} (megalite implements default, linear and llama3 RoPE)")
        allowed = {"rope_type", "type", "rope_theta", *ROPE_TYPES[kind]}
        if d.get("partial_rotary_factor", 1.0) == 1.0:
            allowed.add("partial_rotary_factor")  # every channel rotated: plain RoPE
        extra = sorted(set(d) - allowed)
        if extra:
            refuse(f"{field}.{extra[0]} = {d[extra[0]]!r} with rope_type {kind!r}")
        needed = [k for k in ROPE_TYPES[kind] if k != "original_max_position_embeddings" and d.get(k) is None]
        if needed:
            refuse(f"{field}.rope_type {kind!r} without {field}.{needed[0]}")
        out = dict(rotary_base=float(d.get("rope_theta") or raw.get("rope_theta") or 10000.0),
                   use_rope_scaling=kind == "llama3", rotary_seq_len_interpolation_factor=None)
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


def hf_config(cfg: dict, bos_id: int | None = None, eos_id: int | None = None):
    """The transformers config of a megalite model_config (raises if it has none)."""
    from transformers import GPT2Config, LlamaConfig

    arch = hf_architecture(cfg)
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
    rope_parameters, _ = hf_rope(cfg)
    return LlamaConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["ffn_hidden_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_query_groups"],
        head_dim=cfg["kv_channels"], hidden_act="silu", max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["norm_epsilon"], rope_parameters=rope_parameters,
        attention_bias=cfg["add_bias_linear"], mlp_bias=cfg["add_bias_linear"],
        attention_dropout=cfg.get("attention_dropout", 0.0), architectures=["LlamaForCausalLM"], **common)


def to_hf(meta: dict, state: dict[str, torch.Tensor], out_dir: str, tokenizer=None) -> str:
    """Write a Hugging Face model directory (config.json, generation_config.json,
    model.safetensors, and the tokenizer files when `tokenizer`, a megalite tokenizer, is given).
    Returns the architecture name, "gpt2" or "llama"."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    cfg = meta["model_config"]
    arch = hf_architecture(cfg)  # refuse before writing anything
    if tokenizer is not None and tokenizer.vocab_size > cfg["vocab_size"]:
        raise ConversionError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg['vocab_size']} vocabulary rows (--vocab-size)")
    state = dict(state)
    if cfg.get("apply_layernorm_1p"):  # zero-centred norm weights (w - 1): Hugging Face stores w itself
        state = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in state.items()}
    tensors = (_gpt2_tensors if arch == "gpt2" else _llama_tensors)(cfg, state)
    if state:
        raise ConversionError(f"checkpoint {meta.get('dir', '')} has tensors the {arch} mapping does not place: "
                              f"{', '.join(sorted(state)[:5])}")
    bos, eos = _special_ids(tokenizer)
    config = hf_config(cfg, bos, eos)
    # written beside, renamed into place when complete: a failure leaves no half-written model.
    # A fresh name (never an existing directory, which could be someone's data) that dies with us.
    out_dir = os.path.normpath(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the model directory's
    try:
        config.save_pretrained(tmp)
        if arch == "llama":  # also the 4.x layout, which older transformers and other readers use
            _update_json(os.path.join(tmp, "config.json"), rope_theta=float(cfg["rotary_base"]),
                         rope_scaling=hf_rope(cfg)[1])
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        # safetensors refuses shared or strided storage: give every tensor its own contiguous copy
        save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            export_tokenizer(tokenizer, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)
    return arch


def _update_json(path: str, **values) -> None:
    with open(path) as f:
        d = json.load(f)
    d.update(values)
    with open(path, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)


def _special_ids(tokenizer) -> tuple[int | None, int | None]:
    if tokenizer is None:
        return None, None
    eos = tokenizer.eod
    bos = eos if tokenizer.name == "GPT2BPETokenizer" else None
    if tokenizer.name == "SentencePieceTokenizer":
        bos = tokenizer._sp.bos_id() if tokenizer._sp.bos_id() >= 0 else None
    elif tokenizer.name == "HuggingFaceTokenizer":
        bos = tokenizer._tok.bos_token_id
    return bos, eos


# -- tokenizers -----------------------------------------------------------------------------------
def export_tokenizer(tokenizer, out_dir: str) -> None:
    """Save `tokenizer` (a megalite tokenizer) as Hugging Face files in `out_dir`, then load them
    back with AutoTokenizer and check they give megalite's ids on text."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer.name == "HuggingFaceTokenizer":
        tokenizer._tok.save_pretrained(out_dir)
    else:
        if tokenizer.name == "GPT2BPETokenizer":
            backend = tokenizer._tok  # the same tokenizers.Tokenizer megalite encodes with
            special = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        elif tokenizer.name == "SentencePieceTokenizer":
            backend, special = sentencepiece_to_tokenizers(tokenizer._sp)
        else:
            raise ConversionError(f"--tokenizer-type {tokenizer.name} has no Hugging Face counterpart; "
                                  "export without a tokenizer (--no-tokenizer)")
        # split_special_tokens: like megalite, the text "<|endoftext|>" (or "</s>") in a document is
        # ordinary text, never the end-of-document id
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=True,
                                     clean_up_tokenization_spaces=False, **special)
        hf.save_pretrained(out_dir)
        # a class name every transformers version knows (v5 writes its own "TokenizersBackend")
        _update_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")
    check_tokenizer(tokenizer, AutoTokenizer.from_pretrained(out_dir, local_files_only=True), out_dir)


def check_tokenizer(ours, theirs, where: str, texts: tuple[str, ...] = ()) -> None:
    """Raise unless the Hugging Face tokenizer gives megalite's ids (and text back) on samples."""
    extra = ()
    if ours.name == "SentencePieceTokenizer":  # every piece, and so every merge, in one text
        proto = _sp_proto(ours._sp)
        extra = (" ".join(p.piece.replace("▁", " ") for p in proto.pieces if p.type in (_SP_NORMAL, _SP_USER)),)
    for text in (SAMPLE_TEXT, "", " leading space", "\nleading newline", *extra, *texts):
        a, b = ours.tokenize(text), list(theirs(text, add_special_tokens=True).input_ids)
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ConversionError(f"the Hugging Face tokenizer written to {where} does not reproduce megalite's "
                                  f"{ours.name} on {text[:40]!r}...: from token {i} megalite gives "
                                  f"{a[i:i + 6]} ({ours.detokenize(a[i:i + 6])!r}), Hugging Face {b[i:i + 6]}")
        # unknown pieces decode to a placeholder that differs ("⁇" vs "<unk>"): compare the rest
        if ours.name != "HuggingFaceTokenizer" and theirs.unk_token_id not in a and \
                ours.detokenize(a) != theirs.decode(b):
            raise ConversionError(f"the Hugging Face tokenizer written to {where} decodes {text[:60]!r} "
                                  f"differently from megalite's {ours.name}")


def _sp_proto(sp):
    """The SentencePiece model's settings and pieces (its protobuf)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:  # the generated module needs the protobuf package
        raise ConversionError(f"exporting a SentencePiece tokenizer needs protobuf ({e}): pip install protobuf") from e
    return pb.ModelProto.FromString(sp.serialized_model_proto())


def sentencepiece_to_tokenizers(sp):
    """A `tokenizers.Tokenizer` that encodes exactly as the SentencePiece processor `sp`
    (checked on text afterwards), and the special tokens for the Hugging Face wrapper.

    SentencePiece normalises (character map, optional whitespace cleanup), prepends the dummy
    "▁", turns spaces into "▁", keeps user-defined symbols whole, and then runs BPE (merges by
    piece score) or unigram over the rest, falling back to <0xNN> byte pieces."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = _sp_proto(sp)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.treat_whitespace_as_suffix:
        raise ConversionError("SentencePiece model trained with treat_whitespace_as_suffix: not supported")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    unk = pieces[trainer.unk_id][0]
    if trainer.model_type == 2:  # BPE: a merge (l, r) for every way a piece splits into two pieces
        merges = []
        for p, score, kind in pieces:
            if kind == _SP_NORMAL and len(p) > 1:
                merges += [(score, vocab[p], p[:i], p[i:]) for i in range(1, len(p))
                           if p[:i] in vocab and p[i:] in vocab]
        merges.sort(key=lambda m: (-m[0], m[1]))  # higher score first, as SentencePiece merges
        model = models.BPE(vocab=vocab, merges=[(l_, r) for _, _, l_, r in merges], unk_token=unk,
                           fuse_unk=True, byte_fallback=trainer.byte_fallback, dropout=None)
    elif trainer.model_type == 1:
        # only normal and user-defined pieces may match text; control, unknown, unused and byte
        # pieces are reached by SentencePiece through their own paths, never by the Viterbi search
        model = models.Unigram([(p, s if kind in (_SP_NORMAL, _SP_USER) else -1e9) for p, s, kind in pieces],
                               unk_id=trainer.unk_id,
                               byte_fallback=trainer.byte_fallback)
    else:
        raise ConversionError(f"SentencePiece model type {trainer.model_type} (not BPE or unigram): not supported")
    tok = Tokenizer(model)
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    user = [p.replace(" ", "▁") for p, _, kind in pieces if kind == _SP_USER]
    pre = []
    if user:  # matched whole, before any merge, as SentencePiece's prefix matcher does
        pre.append(pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in sorted(user, key=len, reverse=True))),
                                        behavior="isolated"))
    if trainer.split_digits:
        pre.append(pre_tokenizers.Digits(individual_digits=True))
    # pieces never span a "▁" inside them when trained with split_by_whitespace
    pre.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=trainer.split_by_whitespace))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    special = {"unk_token": unk}
    for key, idx in (("bos_token", trainer.bos_id), ("eos_token", trainer.eos_id), ("pad_token", trainer.pad_id)):
        if idx >= 0:
            special[key] = pieces[idx][0]
    return tok, special


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


def _config_from_hf(c, raw: dict) -> dict:
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
        if c.hidden_act != "silu":
            refuse(f"hidden_act {c.hidden_act!r} (megalite's SwiGLU uses silu)")
        rope = rope_from_hf(raw, c.model_type)
        if bool(c.attention_bias) != bool(c.mlp_bias):
            refuse(f"attention_bias {c.attention_bias} with mlp_bias {c.mlp_bias} (megalite has one switch, "
                   "--disable-bias-linear)")
        heads = c.num_attention_heads
        return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
                    num_query_groups=c.num_key_value_heads or heads,
                    kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
                    ffn_hidden_size=c.intermediate_size, seq_length=c.max_position_embeddings,
                    max_position_embeddings=c.max_position_embeddings, position_embedding_type="rope",
                    rotary_percent=1.0, **rope,
                    normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True,
                    add_bias_linear=bool(c.attention_bias), hidden_dropout=0.0,
                    attention_dropout=float(c.attention_dropout or 0.0), **common)
    raise ConversionError(f"model_type {c.model_type!r}: only gpt2 (GPT2LMHeadModel) and llama "
                          "(LlamaForCausalLM) directories can be imported")


def _gpt2_state(cfg: dict, hf: dict) -> dict:
    heads, hn = cfg["num_attention_heads"], cfg["kv_channels"]
    hid = cfg["hidden_size"]
    out = {WORD_EMBEDDING: hf.pop("wte.weight"), "embedding.position_embeddings.weight": hf.pop("wpe.weight"),
           "decoder.final_layernorm.weight": hf.pop("ln_f.weight"), "decoder.final_layernorm.bias": hf.pop("ln_f.bias")}
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"h.{i}."
        for kind in ("weight", "bias"):
            out[m + f"input_layernorm.{kind}"] = hf.pop(h + f"ln_1.{kind}")
            out[m + f"pre_mlp_layernorm.{kind}"] = hf.pop(h + f"ln_2.{kind}")
        w, b = hf.pop(h + "attn.c_attn.weight").t(), hf.pop(h + "attn.c_attn.bias")
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(*w.split(hid), heads, heads, hn)
        out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(*b.split(hid), heads, heads, hn)
        for ours, theirs in GPT2_PROJECTIONS:
            out[m + ours + ".weight"] = hf.pop(h + theirs + ".weight").t()
            out[m + ours + ".bias"] = hf.pop(h + theirs + ".bias")
    return out


def _llama_state(cfg: dict, hf: dict) -> dict:
    heads, groups, hn = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["kv_channels"]
    out = {WORD_EMBEDDING: hf.pop("embed_tokens.weight"), "decoder.final_layernorm.weight": hf.pop("norm.weight")}
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"layers.{i}."
        out[m + "input_layernorm.weight"] = hf.pop(h + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = hf.pop(h + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if cfg["add_bias_linear"] else ("weight",):
            q, k, v = (hf.pop(h + f"self_attn.{p}_proj.{kind}") for p in "qkv")
            out[m + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, heads, groups, hn)
            out[m + f"self_attention.linear_proj.{kind}"] = hf.pop(h + f"self_attn.o_proj.{kind}")
            out[m + f"mlp.linear_fc1.{kind}"] = torch.cat([hf.pop(h + f"mlp.gate_proj.{kind}"),
                                                           hf.pop(h + f"mlp.up_proj.{kind}")])
            out[m + f"mlp.linear_fc2.{kind}"] = hf.pop(h + f"mlp.down_proj.{kind}")
    return out


def has_tokenizer_files(in_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(in_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model", "vocab.json"))


def from_hf(in_dir: str) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """(model_config, run config record, state) of a local GPT2LMHeadModel / LlamaForCausalLM directory:
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
    if raw.get("model_type") == "llama":
        rope_from_hf(raw)  # refuse what megalite cannot compute before transformers validates (or drops) it
    try:
        hf_cfg = AutoConfig.from_pretrained(in_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # transformers' ways of saying the config is unreadable
        raise ConversionError(f"--load-dir {in_dir}: config.json cannot be read ({type(e).__name__}: {e})") from None
    cfg = _config_from_hf(hf_cfg, raw)
    hf = read_safetensors(in_dir)
    # GPT2LMHeadModel prefixes "transformer.", LlamaForCausalLM "model."; the original GPT-2 files have none
    prefix = "transformer." if cfg["position_embedding_type"] == "learned_absolute" else "model."
    lm_head = hf.pop("lm_head.weight", None)
    hf = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in hf.items() if not _HF_BUFFERS.search(k)}
    try:
        state = (_gpt2_state if prefix == "transformer." else _llama_state)(cfg, hf)
    except KeyError as e:
        raise ConversionError(f"--load-dir {in_dir}: weight {prefix}{e.args[0]} is missing") from None
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
    from ..config import RunConfig, TokenizerConfig
    from ..model import GPTConfig
    tokenizer = TokenizerConfig()
    if has_tokenizer_files(in_dir):
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(in_dir))
    run = RunConfig(model=GPTConfig.from_dict(cfg), tokenizer=tokenizer)
    run.model.group_query_attention = run.model.num_query_groups != run.model.num_attention_heads
    return cfg, run.to_dict(), state


def pretrain_flags(cfg: dict) -> list[str]:
    """pretrain_gpt.py model flags that build `cfg` (to continue training with --load --finetune)."""
    flags = ["--num-layers", cfg["num_layers"], "--hidden-size", cfg["hidden_size"],
             "--num-attention-heads", cfg["num_attention_heads"], "--ffn-hidden-size", cfg["ffn_hidden_size"],
             "--kv-channels", cfg["kv_channels"], "--max-position-embeddings", cfg["max_position_embeddings"],
             "--position-embedding-type", cfg["position_embedding_type"], "--normalization", cfg["normalization"],
             "--norm-epsilon", cfg["norm_epsilon"], "--vocab-size", cfg["vocab_size"]]
    if cfg["num_query_groups"] != cfg["num_attention_heads"]:
        flags += ["--group-query-attention", "--num-query-groups", cfg["num_query_groups"]]
    if cfg["position_embedding_type"] == "rope":
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
    if cfg.get("openai_gelu"):
        flags.append("--openai-gelu")
    if cfg["swiglu"]:
        flags.append("--swiglu")
    if not cfg["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if cfg["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]
