"""Train/valid/test datasets from Megatron's data flags (``--data-path``, ``--split``, ...).

Two ways to name data, as in Megatron:

``--data-path`` (+ ``--split``)  one list of prefixes, each cut into contiguous train/valid/test
    document ranges by ``--split`` ("969,30,1", normalised to fractions). Forms accepted:
    ``A`` (one dataset), ``0.3 A 0.7 B`` (weight/prefix pairs; weights are normalised), or
    ``A B`` (several prefixes without weights). For the last form Megatron concatenates each
    dataset's single epoch; here the prefixes are weighted by their token counts in the split,
    which gives the same proportions but also extends to more samples than one epoch holds.
``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``  a list per split, in the
    same forms, each dataset used whole for its split.

Every rank must call ``build_train_valid_test_datasets``: index caches are built by global rank 0
while the others wait at a barrier.
"""

from __future__ import annotations

import math
import os

from megalite.data.blended_dataset import BlendedDataset
from megalite.data.data_paths import parse_and_normalize_split, parse_blend  # noqa: F401 (also imported from here)
from megalite.data.gpt_dataset import GPTDataset, _rank
from megalite.data.reader import open_dataset
from megalite.errors import InputError

SPLIT_NAMES = ("train", "valid", "test")


def split_document_ranges(split: list[float], num_documents: int) -> list[tuple[int, int] | None]:
    """Contiguous ``[begin, end)`` document range per split; None for a split of weight 0.
    Megatron-LM's rule (so a --split selects the same documents there): round each split's size,
    then shift the boundaries by the total rounding excess so that the last ends at num_documents."""
    bounds = [0]
    for w in split:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    bounds[1:] = [b - (bounds[-1] - num_documents) for b in bounds[1:]]
    return [None if w == 0 else (lo, hi) for w, lo, hi in zip(split, bounds, bounds[1:])]


def _mmap(config) -> bool:
    """False with --no-mmap-bin-files: .bin files are read, not memory-mapped."""
    return getattr(config, "mmap_bin_files", True)


def _cache_dir(config, prefix: str) -> str:
    explicit = getattr(config, "data_cache_path", None)
    if explicit:
        return explicit
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def _build_split(config, prefixes, weights, ranges, num_samples, split_name, flag):
    """One split's dataset: a GPTDataset, or a BlendedDataset over several."""
    indexed = [open_dataset(p, flag, getattr(config, "vocab_size", None), _mmap(config)) for p in prefixes]
    doc_ranges = [r if r is not None else (0, len(d)) for r, d in zip(ranges, indexed)]
    seq_length, seed = int(config.seq_length), int(config.seed)

    def gpt(i, n):
        b, e = doc_ranges[i]
        return GPTDataset(indexed[i], b, e, n, seq_length, seed, _cache_dir(config, prefixes[i]), split_name)

    if len(prefixes) == 1:
        ds = gpt(0, num_samples)
    else:
        if weights is None:
            weights = [int(d.sequence_lengths[b:e].sum(dtype="int64")) for d, (b, e) in zip(indexed, doc_ranges)]
        total = float(sum(weights))
        weights = [w / total for w in weights]
        keep = [i for i, w in enumerate(weights) if w > 0]
        if num_samples is None:
            # One pass: as many samples as the blend can serve without repeating any dataset.
            subs = [gpt(i, None) for i in keep]
            size = int(min(len(d) / weights[i] for i, d in zip(keep, subs)))
        else:
            size = int(num_samples)
            # Upper bound on what the blend takes from dataset i within `size` samples
            # (see blended_dataset: w_i * size + K/2 + 1.5).
            subs = [gpt(i, int(math.ceil(weights[i] * size)) + len(keep) + 1) for i in keep]
        ds = BlendedDataset(subs, [weights[i] for i in keep], size,
                            getattr(config, "data_cache_path", None) or _cache_dir(config, prefixes[0]), split_name)
    if _rank() == 0:
        print(f"> {split_name} dataset: {len(ds)} samples of {seq_length}+1 tokens from "
              f"{', '.join(prefixes)}", flush=True)
    return ds


def build_train_valid_test_datasets(config, train_valid_test_num_samples):
    """(train, valid, test) datasets, each ``None`` when its split is empty or asks for 0 samples.

    ``config`` (a DataConfig): data_path, split, data_cache_path, train_data_path, valid_data_path, test_data_path,
    seq_length, seed. ``ds[i]`` is ``{"text": int64 array [seq_length + 1]}``.
    """
    num_samples = list(train_valid_test_num_samples)
    if len(num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples must have 3 entries, got {num_samples}")
    data_path = getattr(config, "data_path", None)
    per_split = [getattr(config, f"{n}_data_path", None) for n in SPLIT_NAMES]
    if data_path and any(per_split):
        raise InputError("give either --data-path (with --split) or --train-data-path/--valid-data-path/"
                         "--test-data-path, not both")
    out = [None, None, None]
    if data_path:
        prefixes, weights = parse_blend(data_path, "--data-path")
        split = parse_and_normalize_split(getattr(config, "split", None) or "969,30,1")
        # all files checked before any build
        indexed = [open_dataset(p, "--data-path", getattr(config, "vocab_size", None), _mmap(config)) for p in prefixes]
        ranges = [split_document_ranges(split, len(d)) for d in indexed]
        for i, name in enumerate(SPLIT_NAMES):
            if ranges[0][i] is None or num_samples[i] == 0:
                continue
            out[i] = _build_split(config, prefixes, weights, [r[i] for r in ranges], num_samples[i], name,
                                  "--data-path")
    elif any(per_split):
        parsed = [parse_blend(p, f"--{n}-data-path") if p else None for n, p in zip(SPLIT_NAMES, per_split)]
        for (name, blend) in zip(SPLIT_NAMES, parsed):
            if blend:
                for p in blend[0]:
                    open_dataset(p, f"--{name}-data-path", getattr(config, "vocab_size", None), _mmap(config))
        for i, (name, blend) in enumerate(zip(SPLIT_NAMES, parsed)):
            if blend is None or num_samples[i] == 0:
                continue
            prefixes, weights = blend
            out[i] = _build_split(config, prefixes, weights, [None] * len(prefixes), num_samples[i], name,
                                  f"--{name}-data-path")
    else:
        raise InputError("no training data: pass --data-path (or --train-data-path/--valid-data-path/"
                         "--test-data-path)")
    return tuple(out)
