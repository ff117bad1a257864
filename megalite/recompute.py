"""Activation recompute: keep a region's inputs, redo its forward during backward.

torch.utils.checkpoint (non-reentrant) restores the default CPU/CUDA generator before the
recomputation; the tensor-parallel RNG tracker keeps its own states in Python, so they are
saved and restored here too. With both restored, dropout masks in the recomputed forward are
the masks of the original forward (Korthikanti et al. 2022, Sec. 5) and gradients are
bit-identical to running without recompute.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint


class _RestoreTracker:
    """Puts the tracker's states saved at the region's forward in place while the region is
    recomputed, and back after. A class, not a generator: torch.utils.checkpoint enters one
    recompute context each time the region is recomputed, which can be more than once (a nested
    region inside, e.g. DSA's per-chunk recompute under full recompute), and a
    contextlib.contextmanager instance can be entered only once."""

    def __init__(self, rng_tracker, saved):
        self.rng_tracker, self.saved, self.outer = rng_tracker, saved, []

    def __enter__(self):
        if self.saved is not None:
            self.outer.append(self.rng_tracker.get_states())
            self.rng_tracker.set_states(self.saved)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.rng_tracker.set_states(self.outer.pop())
        return False


@torch.compiler.disable  # Dynamo's checkpoint cannot take a context_fn: run the region eagerly under --compile
def recompute(fn, *args, rng_tracker=None):
    def context_fn():
        saved = rng_tracker.get_states() if rng_tracker is not None else None
        return contextlib.nullcontext(), _RestoreTracker(rng_tracker, saved)

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)


class SavedActivations:
    """Counts the bytes autograd keeps for backward while active (a context manager).

    Every tensor saved for backward goes through `torch.autograd.graph.saved_tensors_hooks`;
    each storage is counted once (q, k, v views of one fused QKV output are one storage) and
    parameters are left out, so `nbytes` is the activation memory held at the end of a forward
    pass: what Korthikanti et al. 2022 (Sec. 4, Eq. 1-2) estimate as s·b·h·(34 + 5·a·s/h) bytes
    per layer. Inside a recompute region torch.utils.checkpoint installs its own hooks, so only
    the region's inputs are seen: they are what recompute keeps. `region` tags each record (set
    it from module hooks) to attribute bytes to a part of the model.
    """

    def __init__(self, params=()):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.region = None
        self.records: list[tuple[tuple[int, ...], torch.dtype, int, object]] = []  # shape, dtype, bytes, region
        self._seen: dict[int, torch.UntypedStorage] = {}  # held until exit, so no address is reused

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr not in self._seen:
            self._seen[ptr] = storage
            self.records.append((tuple(t.shape), t.dtype, storage.nbytes(), self.region))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen.clear()
        return False

    def nbytes(self, region=all) -> int:
        return sum(n for _, _, n, r in self.records if region is all or r == region)
