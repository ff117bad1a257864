"""Megatron's GPTDataset: fixed-length training samples cut from a stream of shuffled documents.

Three index arrays turn "sample i" into token ranges (Megatron core ``GPTDataset``):

document index  ``[E * n_docs]``  the split's document ids repeated for E epochs, shuffled
                (the last epoch is shuffled separately when it is used for less than 80 %, so a
                partial epoch still covers a uniform random subset of the documents).
sample index    ``[num_samples + 1, 2]``  (position in document index, token offset): the start
                of each sample in the concatenated stream. Sample i covers stream tokens
                ``[i * s, i * s + s + 1)``; the extra token is the last label, so consecutive
                samples share one boundary token.
shuffle index   ``[num_samples]``  the order samples are served in.

Megatron builds the sample index with a compiled helper that walks the documents; here it is a
cumsum over document lengths and one ``searchsorted`` for all sample starts, so 1M documents index
in about a second without a compiler. The arrays are cached as ``.npy`` under a name hashing every
input that changes them, built once by global rank 0, and memory-mapped by every rank.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from megalite.data.reader import DatasetReader
from megalite.errors import InputError

# Bump when the index algorithm changes, so stale caches are never reused.
INDEX_FORMAT_VERSION = 1


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """Write then rename, so a reader never sees a half-written cache file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def build_cached(cache_dir: str, description: dict, names: list[str], build_fn) -> dict[str, np.ndarray]:
    """Return arrays ``names`` from ``cache_dir``, building them with ``build_fn()`` on rank 0 first.

    Collective when torch.distributed is initialized: every rank must call it. The cache directory
    must be visible to all ranks (a shared file system, as in Megatron).
    """
    paths = cache_paths(cache_dir, description, names)
    if _rank() == 0 and not all(os.path.isfile(p) for p in paths.values()):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build_fn()
        for n in names:
            save_npy_atomic(paths[n], np.ascontiguousarray(arrays[n]))
        # For humans: what the hashed file names stand for.
        desc_path = paths[names[0]].rsplit("-", 1)[0] + "-description.json"
        with open(desc_path, "w") as f:
            f.write(json.dumps(description, sort_keys=True, indent=2) + "\n")
    _barrier()
    return load_cached(paths)


def cache_paths(cache_dir: str, description: dict, names: list[str]) -> dict[str, str]:
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    return {n: os.path.join(cache_dir, f"{key}-{description['class']}-{n}.npy") for n in names}


def load_cached(paths: dict[str, str]) -> dict[str, np.ndarray]:
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"dataset index cache {missing[0]} not found after rank 0 built it: "
                                f"--data-cache-path must be on a file system shared by all ranks")
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Document ids for ``num_epochs`` epochs, shuffled (Megatron ``_build_document_index``)."""
    if not separate_final_epoch or num_epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` (document index position, offset) of each sample start.

    Sample boundary j sits at stream position ``j * seq_length``; it lies in the document whose
    cumulative-length interval ``[cum[k], cum[k+1])`` contains it. ``side="right"`` skips empty
    documents (their interval is empty), like Megatron's helper.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    cum = np.zeros(doc_lengths.size + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=cum[1:])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples and starts[-1] + 1 > cum[-1]:
        raise ValueError(f"{num_samples} samples of {seq_length}+1 tokens need {starts[-1] + 1} tokens, "
                         f"the document index has {cum[-1]}")
    pos = np.searchsorted(cum, starts, side="right") - 1
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = pos
    sample_index[:, 1] = starts - cum[pos]
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle ``[0, num_samples)`` and ``[num_samples, total_size)`` separately (Megatron's rule:
    samples of a separate final epoch stay at the end, so a short run sees whole epochs first)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from sequences ``[doc_begin, doc_end)`` of a dataset.

    ``num_samples`` is a lower bound: enough epochs are indexed to provide it, and ``len(ds)`` is
    the number of whole samples those epochs hold (Megatron's behaviour). ``None`` means one epoch.
    Megatron indexes *sequences* as its documents (one per JSONL line unless sentences were split);
    so does this class.
    """

    def __init__(self, indexed_dataset: DatasetReader, doc_begin: int, doc_end: int, num_samples: int | None,
                 seq_length: int, seed: int, cache_dir: str, split_name: str = "train"):
        self.dataset = indexed_dataset
        self.seq_length = int(seq_length)
        self.documents = np.arange(doc_begin, doc_end, dtype=np.int32)
        if self.seq_length < 1:
            raise InputError(f"--seq-length must be >= 1, got {seq_length}")
        prefix = indexed_dataset.path_prefix
        tokens_per_epoch = int(indexed_dataset.sequence_lengths[doc_begin:doc_end].sum(dtype=np.int64))
        if tokens_per_epoch < self.seq_length + 1:
            raise InputError(f"dataset {prefix}: the {split_name} split (documents [{doc_begin}, {doc_end})) "
                             f"has {tokens_per_epoch} tokens, fewer than one sample of --seq-length "
                             f"{self.seq_length} + 1; use a larger dataset, a smaller --seq-length, or change --split")
        self.tokens_per_epoch = tokens_per_epoch
        self.num_samples_requested = num_samples
        self.seed = int(seed)
        description = {
            "class": "GPTDataset",
            "format_version": INDEX_FORMAT_VERSION,
            "path_prefix": os.path.abspath(prefix),
            # A re-preprocessed corpus under the same prefix must not reuse stale indices.
            "idx_size": indexed_dataset.cache_stamp(),
            "num_sequences": len(indexed_dataset),
            "tokens_per_epoch": tokens_per_epoch,
            "split": split_name,
            "documents": [int(doc_begin), int(doc_end)],
            "seq_length": self.seq_length,
            "seed": self.seed,
            "num_samples": None if num_samples is None else int(num_samples),
        }
        self.description = description
        self.cache_dir = cache_dir
        names = ["document_index", "sample_index", "shuffle_index"]
        arrays = build_cached(cache_dir, description, names, self._build_indices)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build_indices(self) -> dict[str, np.ndarray]:
        s, tpe = self.seq_length, self.tokens_per_epoch
        if self.num_samples_requested is None:
            num_epochs = 1
        else:
            # Enough epochs that num_samples samples (+1 token for the last label) fit.
            needed = int(self.num_samples_requested) * s + 1
            num_epochs = max(1, -(-needed // tpe))
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final = ((num_epochs - 1) * tpe - 1) // s
            samples_from_final = int(self.num_samples_requested) - samples_before_final
            samples_per_epoch = (tpe - 1) // s
            separate_final_epoch = samples_from_final < int(0.80 * samples_per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate_final_epoch)
        num_samples = (num_epochs * tpe - 1) // s
        sample_index = build_sample_index(self.dataset.sequence_lengths, document_index, s, num_samples)
        shuffle_index = build_shuffle_index(samples_before_final if separate_final_epoch else num_samples,
                                            num_samples, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return self.shuffle_index.shape[0]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[i])
        doc_end, off_end = (int(x) for x in self.sample_index[i + 1])
        get = self.dataset.get
        if doc_beg == doc_end:
            tokens = get(int(self.document_index[doc_beg]), offset=off_beg, length=off_end - off_beg + 1)
        else:
            # First document from its offset, whole middle documents, last one up to and including
            # the shared boundary token.
            parts = [get(int(self.document_index[doc_beg]), offset=off_beg)]
            parts += [get(int(self.document_index[j])) for j in range(doc_beg + 1, doc_end)]
            parts.append(get(int(self.document_index[doc_end]), length=off_end + 1))
            tokens = np.concatenate(parts)
        return {"text": tokens.astype(np.int64)}

    # Memory maps are reopened, not copied, when a DataLoader worker receives the dataset.
    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("document_index", "sample_index", "shuffle_index"):
            state[k] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        names = ["document_index", "sample_index", "shuffle_index"]
        for n, a in load_cached(cache_paths(self.cache_dir, self.description, names)).items():
            setattr(self, n, a)
