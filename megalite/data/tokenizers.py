"""Tokenizers behind one small interface, selected by Megatron's ``--tokenizer-type``.

Every tokenizer has ``name``, ``vocab_size`` (unpadded; the model pads it), ``eod`` (the
end-of-document id that ``--append-eod`` writes), ``tokenize(str) -> list[int]``,
``tokenize_batch(list[str]) -> list[list[int]]`` (the same ids, one library call for many texts:
what preprocessing uses) and ``detokenize(list[int]) -> str``. The optional libraries are imported only by the tokenizer that
needs them, so the core install works without them.

``TOKENIZERS`` (at the end) is the one registry of types; every tool takes its flags from
config/data.py's TokenizerConfig (pretrain_gpt.py, tools/preprocess_data.py,
tools/checkpoint/convert.py, tools/generate.py, tools/plan.py).
A file that is missing or that the library cannot read is an ``InputNotFound`` / ``InputError``
naming the flag and the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from megalite.config.data import TOKENIZER_TYPES
from megalite.errors import InputError, InputNotFound, MissingPackage

# TikTokenizer's own flags (argparse dest -> default); refused with any other tokenizer
TIKTOKEN_FLAGS = {"tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000, "tiktoken_special_tokens": None}
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


_FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_tokenizer_args(config) -> list[str]:
    """Refuse tokenizer flags that cannot work together, without reading any file: a type without
    its files, files the type does not read, NullTokenizer without --vocab-size. Returns notices
    for the TikTokenizer flags given with another type: Megatron-LM accepts and ignores them
    there (its Llama-3 script passes --tiktoken-pattern v2 with NullTokenizer on mock data)."""
    kind = getattr(config, "tokenizer_type", None)
    if kind is None:
        given = [_flag(d) for d in _FILE_FLAGS if getattr(config, d, None)]
        if given:
            raise InputError(f"{given[0]} is only read by a tokenizer: give --tokenizer-type too "
                             f"({', '.join(TOKENIZER_TYPES)})")
        return []
    if kind not in TOKENIZER_FILE_FLAGS:
        raise InputError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")
    needs = TOKENIZER_FILE_FLAGS[kind]
    for dest in needs:
        if not getattr(config, dest, None):
            raise InputError(f"--tokenizer-type {kind} needs {_flag(dest)}")
    for dest in _FILE_FLAGS:
        if dest not in needs and getattr(config, dest, None):
            readers = [k for k, v in TOKENIZER_FILE_FLAGS.items() if dest in v]
            raise InputError(f"{_flag(dest)} is not read by --tokenizer-type {kind} (only by {', '.join(readers)}); "
                             f"drop it or change --tokenizer-type")
    if kind == "NullTokenizer" and getattr(config, "vocab_size", None) is None:
        raise InputError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1; N is the end-of-document id)")
    if kind == "TikTokenizer":
        if getattr(config, "tiktoken_pattern", None) is None:
            raise InputError("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2")
        _check_special_tokens(getattr(config, "tiktoken_special_tokens", None),
                              getattr(config, "tiktoken_num_special_tokens", None) or 1000,
                              getattr(config, "vocab_size", None))
        return []
    return [f"{_flag(dest)} has no effect with --tokenizer-type {kind} (only TikTokenizer reads it; Megatron-LM "
            f"accepts and ignores it there)" for dest, default in TIKTOKEN_FLAGS.items()
            if getattr(config, dest, None) not in (None, default)]


def _check_special_tokens(special, num_special: int, vocab_size: int | None) -> None:
    special = list(special or TIKTOKEN_SPECIAL_TOKENS)
    if len(set(special)) != len(special):
        raise InputError(f"--tiktoken-special-tokens has repeats: {special}")
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
    if missing:
        raise InputError(f"--tiktoken-special-tokens must include {' '.join(TIKTOKEN_SPECIAL_TOKENS)} "
                         f"(missing {' '.join(missing)})")
    vocab = TikTokenizer.DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if not len(special) <= num_special < vocab:
        raise InputError(f"TikTokenizer needs {len(special)} special tokens <= --tiktoken-num-special-tokens "
                         f"({num_special}) < --vocab-size ({vocab})")


def model_vocab_size(config, tokenizer) -> int:
    """The model's (unpadded) vocabulary for `tokenizer` and --vocab-size.

    NullTokenizer: --vocab-size N is the tokenizer's own argument (ids 0..N-1 plus the eod id N), so
    the model gets N + 1, as in Megatron-LM. TikTokenizer: --vocab-size is its whole vocabulary.
    Other tokenizers: their vocabulary, or a larger --vocab-size (extra rows never seen in the data)."""
    if tokenizer.name in ("NullTokenizer", "TikTokenizer") or config.vocab_size is None:
        return tokenizer.vocab_size
    if config.vocab_size < tokenizer.vocab_size:
        raise InputError(f"--vocab-size ({config.vocab_size}) is smaller than the vocabulary of --tokenizer-type "
                         f"{config.tokenizer_type} ({tokenizer.vocab_size}); drop --vocab-size to use the tokenizer's")
    return config.vocab_size


def _require_file(path, flag: str, what: str) -> str:
    if not path:
        raise InputError(f"{flag} is required for this --tokenizer-type ({what})")
    if not os.path.isfile(path):
        raise InputNotFound(f"{flag} {path}: file not found ({what})")
    return path


def _import(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError as e:
        hint = f"pip install megalite[{extra}]" if extra else f"pip install {module}"
        raise MissingPackage(f"this tokenizer needs the '{module}' package: {hint}") from e


class NullTokenizer:
    """Text is whitespace-separated token ids; for tests and pre-tokenized corpora.

    Follows Megatron's ``_NullTokenizer``: ``vocab_size`` ids are the data, one more id
    (``vocab_size``) is the eod, so ``.vocab_size`` reports ``vocab_size + 1``.
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise InputError(f"--vocab-size must be a positive integer for NullTokenizer, got {vocab_size}")
        self._vocab_size_without_eod = int(vocab_size)
        self.eod = self._vocab_size_without_eod
        self.vocab_size = self._vocab_size_without_eod + 1

    def tokenize(self, text: str) -> list[int]:
        # Megatron splits on a single space; any whitespace is accepted here (same result on its input).
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise InputError(f"NullTokenizer reads whitespace-separated integer ids, got {word[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"NullTokenizer: token id {bad[0]} outside [0, {self.vocab_size}) "
                             f"(--vocab-size {self._vocab_size_without_eod})")
        return ids

    def tokenize_batch(self, texts) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (Radford et al. 2019, encoder.py), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_CHECK_TEXT = ("Hello world! It's 2024; don't   stop.\n\n  Café naïve 日本語 🙂 <|endoftext|>\tend  ")
# GPT-2's pre-tokenizer regex (the one tokenizers' ByteLevel uses)
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _tiktoken_gpt2(vocab_file: str, merge_file: str, eod_token: str):
    """A tiktoken Encoding equal to this GPT-2 BPE, or None (tiktoken not installed, or a vocabulary
    it cannot express). tiktoken merges the pair whose *merged token* has the lowest id, while
    GPT-2 merges the pair listed first in merges.txt; they agree when the 256 bytes come first and
    merge i makes token 256 + i, as in OpenAI's GPT-2 files (tiktoken checks the same for its own
    "gpt2"). About 2-3x the tokenizers library's speed on one core."""
    try:
        import tiktoken
    except ImportError:
        return None
    u2b = _bytes_to_unicode()
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [ln.split() for ln in lines[1 if lines and lines[0].startswith("#version") else 0:] if ln.strip()]
    if any(len(m) != 2 for m in merges):
        return None
    tokens = list(u2b) + [a + b for a, b in merges]  # in rank order, as GPT-2's printable strings
    if len(vocab) != len(tokens) + 1 or vocab.get(eod_token) != len(tokens) or \
            any(vocab.get(t) != i for i, t in enumerate(tokens)):
        return None
    ranks = {bytes(u2b[c] for c in t): i for i, t in enumerate(tokens)}
    return tiktoken.Encoding("megalite_gpt2", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={eod_token: vocab[eod_token]})


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt).

    Uses the Rust ``tokenizers`` BPE with GPT-2's byte-level pre-tokenizer (its regex, no prefix
    space), which yields exactly the ids of the reference GPT-2 tokenizer. Like Megatron, the text
    "<|endoftext|>" inside a document is *not* turned into the eod id: only --append-eod writes it,
    so documents cannot inject document boundaries.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        _require_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        _require_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        tk = _import("tokenizers", "hf")
        from tokenizers import decoders, models, pre_tokenizers

        try:
            self._tok = tk.Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as e:  # the library's own message says what is wrong with the file
            raise InputError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2 BPE files ({e})") from e
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise InputError(f"--vocab-file {vocab_file}: no '<|endoftext|>' token, not a GPT-2 vocabulary")
        self.eod = eod
        self.vocab_size = self._tok.get_vocab_size()
        self._tiktoken = _tiktoken_gpt2(vocab_file, merge_file, "<|endoftext|>")
        if self._tiktoken is not None:
            # insurance: the two must give the same ids
            if self._tiktoken.encode_ordinary(_CHECK_TEXT) != self._tok.encode(_CHECK_TEXT).ids:
                self._tiktoken = None
        self.backend = "tiktoken" if self._tiktoken is not None else "tokenizers"

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts) -> list[list[int]]:
        if self._tiktoken is not None:  # one core per worker: its thread pool would only add overhead
            return [self._tiktoken.encode_ordinary(t) for t in texts]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (``--tokenizer-model``), GPT style: eod is the model's eos id.

    This matches Megatron's ``GPTSentencePieceTokenizer`` (no extra special tokens, no bos/eos added
    to each text). Megatron's BERT-oriented ``SentencePieceTokenizer`` appends <CLS>/<SEP>/<EOD>/...
    ids to the vocabulary instead; the ordinary piece ids are the same in both.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        _require_file(model_file, "--tokenizer-model", "SentencePiece .model file")
        spm = _import("sentencepiece", None)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as e:
            raise InputError(f"--tokenizer-model {model_file}: not a SentencePiece model ({e})") from e
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise InputError(f"--tokenizer-model {model_file}: the model has no eos piece to use as "
                             f"end-of-document (train it with eos_id >= 0, e.g. tools/train_tokenizer.py)")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int, num_threads=1)  # parallelism: preprocess --workers

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: a SentencePiece ``.model`` whose ``tokenize`` puts the bos id
    before each text (Megatron-LM's ``_Llama2Tokenizer.tokenize(s, bos=True, eos=False)``, as Llama
    2 was trained); eod is the eos id (``--append-eod`` adds it)."""

    name = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos = self._sp.bos_id()
        if self.bos < 0:
            raise InputError(f"--tokenizer-model {model_file}: the model has no bos piece, which Llama2Tokenizer "
                             f"puts before each text (train it with bos_id >= 0, e.g. tools/train_tokenizer.py)")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + super().tokenize(text)

    def tokenize_batch(self, texts) -> list[list[int]]:
        return [[self.bos] + ids for ids in super().tokenize_batch(texts)]


class HuggingFaceTokenizer:
    """``transformers.AutoTokenizer`` from a local directory (``--tokenizer-model``), offline only.

    As in Megatron, ``tokenize`` calls the tokenizer with its defaults, so models whose tokenizer
    adds a bos token (e.g. Llama) get one per document; eod is ``eos_token_id``.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, model_dir: str):
        if not model_dir:
            raise InputError("--tokenizer-model (a local tokenizer directory) is required for HuggingFaceTokenizer")
        if not os.path.isdir(model_dir):
            raise InputNotFound(f"--tokenizer-model {model_dir}: not a directory (HuggingFaceTokenizer "
                                f"loads a local tokenizer directory; nothing is downloaded)")
        _import("transformers", "hf")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as e:
            raise InputError(f"--tokenizer-model {model_dir}: not a Hugging Face tokenizer directory "
                             f"({type(e).__name__}: {e})") from e
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise InputError(f"--tokenizer-model {model_dir}: tokenizer has no eos token to use as end-of-document")
        self.eod = self._tok.eos_token_id

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def tokenize_batch(self, texts) -> list[list[int]]:
        return [list(ids) for ids in self._tok(list(texts)).input_ids] if texts else []

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class TikTokenizer:
    """Megatron-LM's TikTokenizer: a byte-level BPE in tiktoken's format.

    ``--tokenizer-model`` is Megatron-LM's JSON vocabulary: a list of ``{"rank": i, "token_bytes":
    base64, "token_str": ...}`` in rank order, the first 256 being the single bytes. Ids 0..S-1
    (S = ``--tiktoken-num-special-tokens``, default 1000) are special tokens (``--tiktoken-special-tokens``,
    default ``<unk> <s> </s>``, then ``<SPECIAL_i>`` fillers); rank r is id S + r. The vocabulary is
    ``--vocab-size`` (default 2^17): its first vocab_size - S ranks are used. ``</s>`` is the eod.
    Text is split by ``--tiktoken-pattern`` (v1, or v2 which also splits camel case) and encoded
    with ``encode_ordinary``: special-token text inside a document stays text.
    """

    name = "TikTokenizer"
    DEFAULT_VOCAB_SIZE = 2**17
    PATTERNS = {
        "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    }

    def __init__(self, path: str, pattern: str, vocab_size: int | None = None, num_special_tokens: int = 1000,
                 special_tokens: list[str] | None = None):
        import base64
        import json
        _require_file(path, "--tokenizer-model", "TikTokenizer JSON vocabulary")
        if pattern not in self.PATTERNS:
            raise InputError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        tiktoken = _import("tiktoken", "tiktoken")
        self.vocab_size = self.DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        _check_special_tokens(special_tokens, num_special_tokens, self.vocab_size)
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        inner = self.vocab_size - num_special_tokens
        try:
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
            if not isinstance(entries, list):
                raise ValueError("not a JSON list")
            ranks = {}
            for i, e in enumerate(entries[:inner]):
                if set(e) != {"rank", "token_bytes", "token_str"} or e["rank"] != i:
                    raise ValueError(f"entry {i} is not {{rank: {i}, token_bytes, token_str}}")
                token = base64.b64decode(e["token_bytes"])
                if i < 256 and token != bytes([i]):
                    raise ValueError(f"rank {i} must be the single byte {i}")
                ranks[token] = num_special_tokens + i
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise InputError(f"--tokenizer-model {path}: not a TikTokenizer vocabulary ({e})") from e
        if len(ranks) != inner:
            raise InputError(f"--tokenizer-model {path}: {len(ranks)} distinct tokens, but --vocab-size "
                             f"{self.vocab_size} - {num_special_tokens} special tokens needs {inner}")
        self._special = {t: i for i, t in enumerate(special)}
        self.eod = self._special["</s>"]
        self._model = tiktoken.Encoding(name=os.path.basename(path), pat_str=self.PATTERNS[pattern],
                                        mergeable_ranks=ranks, special_tokens=self._special)

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])


@dataclass(frozen=True)
class TokenizerSpec:
    """One --tokenizer-type: the TokenizerConfig fields naming the files it reads (checked before
    any process starts) and how it is built from a TokenizerConfig."""
    files: tuple[str, ...]
    build: Callable


# The registry: adding a tokenizer is its class and one entry here (and its flags, if it has new
# ones, in config/data.py's TokenizerConfig). GPTSentencePieceTokenizer is Megatron's name for
# SentencePiece used for GPT; here it is the same tokenizer as SentencePieceTokenizer.
TOKENIZERS: dict[str, TokenizerSpec] = {
    "GPT2BPETokenizer": TokenizerSpec(("vocab_file", "merge_file"),
                                      lambda c: GPT2BPETokenizer(c.vocab_file, c.merge_file)),
    "SentencePieceTokenizer": TokenizerSpec(("tokenizer_model",), lambda c: SentencePieceTokenizer(c.tokenizer_model)),
    "GPTSentencePieceTokenizer": TokenizerSpec(("tokenizer_model",),
                                               lambda c: SentencePieceTokenizer(c.tokenizer_model)),
    "Llama2Tokenizer": TokenizerSpec(("tokenizer_model",), lambda c: Llama2Tokenizer(c.tokenizer_model)),
    "HuggingFaceTokenizer": TokenizerSpec(("tokenizer_model",), lambda c: HuggingFaceTokenizer(c.tokenizer_model)),
    "TikTokenizer": TokenizerSpec(("tokenizer_model",), lambda c: TikTokenizer(
        c.tokenizer_model, c.tiktoken_pattern, c.vocab_size, c.tiktoken_num_special_tokens or 1000,
        c.tiktoken_special_tokens)),
    "NullTokenizer": TokenizerSpec((), lambda c: NullTokenizer(c.vocab_size)),
}
TOKENIZER_FILE_FLAGS = {name: spec.files for name, spec in TOKENIZERS.items()}


def build_tokenizer(config):
    """The tokenizer of a TokenizerConfig (or any object with its fields)."""
    kind = getattr(config, "tokenizer_type", None)
    if kind not in TOKENIZERS:
        raise InputError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZERS[kind].build(_Fields(config))


class _Fields:
    """A TokenizerConfig's fields, None where an object built elsewhere lacks one."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name, None)
