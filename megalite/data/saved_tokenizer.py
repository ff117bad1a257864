"""The tokenizer a checkpoint was trained with (its saved tokenizer section), or the command line's,
checked against the model's vocabulary: what generation and the converters decode and export with.
Reads the checkpoint's metadata only (the caller opened it)."""
from __future__ import annotations

from dataclasses import fields

from ..config import TokenizerConfig, from_saved
from ..errors import InputError, InputNotFound
from .tokenizers import build_tokenizer


def tokenizer_config(saved: dict, overrides: dict | None = None, where: str = "the checkpoint") -> TokenizerConfig:
    """The tokenizer to use: the command line's fields where given (all of them when it names a
    --tokenizer-type), else the saved ones (`saved`: the checkpoint's tokenizer section)."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    names = [f.name for f in fields(TokenizerConfig)]
    base = {"vocab_size": saved.get("vocab_size")} if overrides.get("tokenizer_type") else \
        {k: saved[k] for k in names if saved.get(k) is not None}
    args = TokenizerConfig(**{**base, **{k: v for k, v in overrides.items() if k in names}})
    if not args.tokenizer_type:
        raise InputError(f"{where} was saved without a tokenizer (trained with --mock-data and no "
                         "--tokenizer-type): give --tokenizer-type and its files (--vocab-file/--merge-file, "
                         "--tokenizer-model) on the command line")
    return args


def build_tokenizer_for(meta: dict, overrides: dict | None = None):
    """The tokenizer a checkpoint was trained with (or the command line's), checked against the model."""
    args = tokenizer_config(from_saved(meta)["tokenizer"], overrides, meta.get("dir", "the checkpoint"))
    vocab = meta["model_config"]["vocab_size"]
    if args.tokenizer_type == "NullTokenizer" and not (overrides or {}).get("vocab_size"):
        args.vocab_size = vocab - 1  # its ids and its eod id fill the model's vocabulary (as training sets it)
    try:
        tokenizer = build_tokenizer(args)
    except InputNotFound as e:
        raise InputNotFound(f"{e} (as saved in {meta.get('dir', 'the checkpoint')}'s arguments; give the flag "
                            "on the command line to use another path)") from None
    if tokenizer.vocab_size > vocab:
        raise InputError(f"--tokenizer-type {args.tokenizer_type} has {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocabulary ({vocab}): not the tokenizer this model was trained with")
    return tokenizer
