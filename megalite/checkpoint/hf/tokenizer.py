"""Tokenizers to Hugging Face: a megalite tokenizer (GPT-2 BPE files, a SentencePiece model, a
Hugging Face tokenizer directory) becomes a `tokenizer.json` that AutoTokenizer loads, checked on
text to give the same ids as megalite's own."""
from __future__ import annotations

import os
import re

from .config import ConversionError, update_json

_SP_NORMAL, _SP_USER = 1, 4  # SentencePiece piece types (sentencepiece_model.proto)
SAMPLE_TEXT = ("Hello world! The quick brown fox jumps over the lazy dog.\n\nA second paragraph,  with two "
               "spaces, tabs\tand digits 0123456789; café, naïve, 日本語, emoji 🙂.\n  indented line\n"
               "<|endoftext|> <s> </s> <unk> trailing spaces   ")


HF_COUNTERPARTS = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer")


def exportable(tokenizer, where: str = "") -> object:
    """`tokenizer` if Hugging Face has a counterpart of it; else None, with a notice that the
    weights go without one (NullTokenizer's ids are the text: there is nothing to write)."""
    if tokenizer is None or tokenizer.name in HF_COUNTERPARTS:
        return tokenizer
    print(f"> note: --tokenizer-type {tokenizer.name}{' of ' + where if where else ''} has no Hugging Face "
          f"counterpart: the weights are exported without a tokenizer", flush=True)
    return None


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
        update_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")
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


def has_tokenizer_files(in_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(in_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model", "vocab.json"))


def special_ids(tokenizer) -> tuple[int | None, int | None]:
    if tokenizer is None:
        return None, None
    eos = tokenizer.eod
    bos = eos if tokenizer.name == "GPT2BPETokenizer" else None
    if tokenizer.name == "SentencePieceTokenizer":
        bos = tokenizer._sp.bos_id() if tokenizer._sp.bos_id() >= 0 else None
    elif tokenizer.name == "HuggingFaceTokenizer":
        bos = tokenizer._tok.bos_token_id
    return bos, eos
