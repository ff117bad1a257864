"""Activation recompute: keep a region's inputs, redo its forward during backward.

torch.utils.checkpoint (non-reentrant) restores the default CPU/CUDA generator before the
recomputation; the tensor-parallel RNG tracker keeps its own states in Python, so they are
saved and restored here too. With both restored, dropout masks in the recomputed forward are
the masks of the original forward (Korthikanti et al. 2022, Sec. 5) and gradients are
bit-identical to running without recompute.
"""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import checkpoint


def recompute(fn, *args, rng_tracker=None):
    def context_fn():
        saved = rng_tracker.get_states() if rng_tracker is not None else None

        @contextlib.contextmanager
        def restore():
            if saved is None:
                yield
                return
            current = rng_tracker.get_states()
            rng_tracker.set_states(saved)
            try:
                yield
            finally:
                rng_tracker.set_states(current)

        return contextlib.nullcontext(), restore()

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)
