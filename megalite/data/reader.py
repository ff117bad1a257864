"""What a tokenized corpus on disk must offer (`DatasetReader`), the formats a prefix may name
(`FORMATS`), and the one check that opens a prefix for a flag (`open_dataset`, used by the
argument checks at start-up and by the dataset builder).

A corpus is a sequence of *sequences* of token ids (a sequence is what GPTDataset concatenates
and cuts into samples, usually one document); consecutive sequences form *documents*. The
`.bin/.idx` reader (indexed_dataset.IndexedDataset) implements the interface; a new format is
one class implementing it plus one entry in FORMATS.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from megalite.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megalite.errors import InputError, InputNotFound


@runtime_checkable
class DatasetReader(Protocol):
    """Read-only access to one tokenized corpus. Readers are opened again in DataLoader workers
    (they must pickle cheaply: no data in their state) and never write."""

    path_prefix: str
    """The prefix the corpus was opened from: names it in messages and keys its index caches."""

    dtype: np.dtype
    """The dtype of the token ids as stored (an integer dtype for a GPT corpus; `open_dataset`
    refuses any other); `get` and `head` return arrays of it."""

    sequence_lengths: np.ndarray
    """Tokens per sequence: an int array of len(self) entries, each >= 0."""

    document_indices: np.ndarray
    """Document boundaries as sequence indices: int64, starting at 0, non-decreasing, ending at
    len(self); document d is sequences [document_indices[d], document_indices[d + 1])."""

    def __len__(self) -> int:
        """The number of sequences."""

    @property
    def num_documents(self) -> int:
        """len(document_indices) - 1."""

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (length None: to its end), reading
        no more than those. A negative idx counts from the end; a range outside the sequence
        raises IndexError. The array may be a read-only view: copy it before modifying."""

    def head(self, count: int) -> np.ndarray:
        """The first `count` tokens of the corpus, sequences in order (for checks of the ids;
        count <= sequence_lengths.sum())."""

    def cache_stamp(self) -> int:
        """A number that changes when the corpus under `path_prefix` is rewritten: the index
        caches built over it (gpt_dataset.build_cached) are keyed by it, so a re-preprocessed
        corpus never reuses stale ones."""


@dataclass(frozen=True)
class ReaderFormat:
    """One on-disk format: the files a prefix names in it, and how to open them."""
    name: str
    files: Callable[[str], tuple[str, ...]]  # prefix -> the files that must exist
    open: Callable[[str, bool], DatasetReader]  # (prefix, mmap) -> reader; InputError if corrupt
    made_by: str  # what makes one, for the message when a prefix names no dataset


# Tried in order: the first format whose files all exist opens the prefix.
FORMATS = (
    ReaderFormat("indexed", lambda prefix: (data_file_path(prefix), index_file_path(prefix)),
                 lambda prefix, mmap: IndexedDataset(prefix, mmap=mmap),
                 "a .bin/.idx pair made by tools/preprocess_data.py"),
)

# tokens read per dataset to check their ids against the vocabulary: a bounded cost at any corpus size
_TOKEN_CHECK_LIMIT = 1 << 22


def open_dataset(prefix: str, flag: str, vocab_size: int | None = None, mmap: bool = True) -> DatasetReader:
    """The reader of the dataset `prefix` given to `flag`, after checking that its files exist,
    its header, sizes and dtype (a bounded cost for any corpus size) and, with `vocab_size`,
    that its first token ids are in the vocabulary. Raises InputNotFound / InputError naming
    the flag and the file."""
    fmt = next((f for f in FORMATS if all(map(os.path.isfile, f.files(prefix)))), None)
    if fmt is None:
        missing = [p for p in FORMATS[0].files(prefix) if not os.path.isfile(p)]
        raise InputNotFound(f"{flag} {prefix}: dataset not found (missing {', '.join(missing)}); a prefix names "
                            f"{' or '.join(f.made_by for f in FORMATS)}")
    try:
        ds = fmt.open(prefix, mmap)
    except InputError as e:
        raise InputError(f"{flag} {prefix}: {e}") from None
    if not np.issubdtype(ds.dtype, np.integer):
        raise InputError(f"{flag} {prefix}: {prefix}.idx declares {ds.dtype.name} tokens; a GPT dataset holds "
                         f"integer token ids")
    n = min(int(ds.sequence_lengths.sum(dtype=np.int64)), _TOKEN_CHECK_LIMIT)
    if vocab_size is not None and n:
        # an id outside the embedding would fail deep inside the model; a dataset made with another
        # tokenizer is the usual cause
        head = ds.head(n)
        lo, hi = int(head.min()), int(head.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"{flag} {prefix}: token id {bad} in {prefix}.bin is outside the model's vocabulary "
                             f"[0, {vocab_size}); was the dataset made with another tokenizer (--tokenizer-type)?")
    return ds

