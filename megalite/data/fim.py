"""--fim-data: fill-in-the-middle samples (Bavarian et al. 2022, "Efficient Training of Language
Models to Fill in the Middle"), as Megatron-LM's GPTFIMDataset makes them.

Each sample's documents (its stretches between end-of-document tokens; with --fim-split-sample,
the fragments between that token) are, with probability --fim-rate, detokenized, cut at two
random character positions into prefix, middle and suffix, retokenized and reordered:

    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle   (with probability --fim-spm-rate)

The sample keeps its length: cut at the end, or padded with <fim_pad>. The sentinel tokens are
looked up in the tokenizer's vocabulary; one it lacks is its unknown token, as Megatron-LM's
tokens_to_ids (GPT-2's unknown token is <|endoftext|>, so there every sentinel is the end of
document). Megatron-LM draws from one random stream per dataset, in the order samples are read;
here each sample draws from its own stream, seeded by (--seed, split, sample index), so a sample is
the same whichever worker reads it and whenever (a resumed run reads the same samples)."""
from __future__ import annotations

import numpy as np
import torch


def token_id(tokenizer, token: str) -> int:
    """The id of `token` in the tokenizer's vocabulary; its unknown token (the end of document
    where it has none, GPT-2's) if the vocabulary lacks it."""
    vocab = getattr(tokenizer, "_tok", None)  # tokenizers' Tokenizer (GPT2BPETokenizer), transformers' (HF)
    if vocab is not None and hasattr(vocab, "token_to_id"):
        found = vocab.token_to_id(token)
        return tokenizer.eod if found is None else int(found)
    if vocab is not None and hasattr(vocab, "convert_tokens_to_ids"):
        found = vocab.convert_tokens_to_ids(token)
        return tokenizer.eod if found is None else int(found)
    sp = getattr(tokenizer, "_sp", None)  # SentencePiece: piece_to_id gives its unk id for unknown pieces
    if sp is not None:
        return int(sp.piece_to_id(token))
    ids = tokenizer.tokenize(token)
    return int(ids[0]) if len(ids) == 1 else tokenizer.eod


class FIMDataset(torch.utils.data.Dataset):
    """`base`'s samples ({"text": [s + 1] int64}) made fill-in-the-middle. The tokenizer is built
    where the samples are read (a data-loader worker builds its own)."""

    def __init__(self, base, data_config, tokenizer_config, split: int):
        self.base, self.config, self.tokenizer_config, self.split = base, data_config, tokenizer_config, split
        self._tokenizer = None

    def __len__(self) -> int:
        return len(self.base)

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    def _ids(self):
        if self._tokenizer is None:
            from .tokenizers import build_tokenizer
            t = self._tokenizer = build_tokenizer(self.tokenizer_config)
            c = self.config
            self.prefix, self.middle, self.suffix, self.pad, self.eod = (
                token_id(t, name) for name in (c.fim_prefix_token, c.fim_middle_token, c.fim_suffix_token,
                                               c.fim_pad_token, c.fim_eod_token))
            self.split_id = token_id(t, c.fim_split_sample) if c.fim_split_sample else None
        return self._tokenizer

    def __getitem__(self, idx: int) -> dict:
        sample = self.base[idx]
        tokens = sample["text"]
        self._ids()
        seed = np.random.SeedSequence([int(self.config.seed), self.split, int(idx) % len(self)]).generate_state(1)
        rng = np.random.RandomState(seed)
        out = []
        start = 0
        for end in list(np.flatnonzero(tokens == self.eod)) + [len(tokens)]:
            if end > start:
                out.append(self._split_and_permute(tokens[start:end], rng))
            if end < len(tokens):
                out.append(np.array([self.eod], dtype=np.int64))
            start = end + 1
        new = np.concatenate(out) if out else tokens
        if len(new) >= len(tokens):
            new = new[:len(tokens)]
        else:
            new = np.concatenate([new, np.full(len(tokens) - len(new), self.pad, dtype=np.int64)])
        return {**sample, "text": new.astype(np.int64)}

    def _split_and_permute(self, seq: np.ndarray, rng) -> np.ndarray:
        """--fim-split-sample: the fragments between that token permuted each (at
        --fim-fragment-rate, once the whole sequence is chosen at --fim-rate); else the sequence."""
        c = self.config
        breaks = np.flatnonzero(seq == self.split_id) if self.split_id is not None else []
        if self.split_id is None or len(breaks) == 0:
            return self._permute(seq, c.fim_rate, rng)
        if not rng.binomial(1, c.fim_rate):
            return seq
        out, start = [], 0
        for end in list(breaks) + [len(seq)]:
            if end > start:
                out.append(self._permute(seq[start:end], c.fim_fragment_rate, rng))
            if end < len(seq):
                out.append(np.array([self.split_id], dtype=np.int64))
            start = end + 1
        return np.concatenate(out)

    def _permute(self, seq: np.ndarray, rate: float, rng) -> np.ndarray:
        """One document (fragment): with probability `rate`, cut its text at two random places and
        reorder as PSM or SPM (Megatron-LM's _permute without truncate_or_pad)."""
        c, t = self.config, self._tokenizer
        if not rng.binomial(1, rate):
            return seq
        text = t.detokenize(seq.tolist())
        if c.fim_no_prefix is not None and text.startswith(c.fim_no_prefix):
            return seq
        a, b = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.array(t.tokenize(part), dtype=np.int64)
                                  for part in (text[:a], text[a:b], text[b:]))
        if rng.binomial(1, c.fim_spm_rate):
            parts = [[self.prefix, self.suffix], suffix, [self.middle], prefix, middle]
        else:
            parts = [[self.prefix], prefix, [self.suffix], suffix, [self.middle], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
