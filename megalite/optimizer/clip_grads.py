"""Global gradient norm and clipping across every model-parallel shard.

The norm is over the whole model: each rank sums the squares of the gradients it owns, the
sums are all-reduced over the model-parallel (TP x PP) group, and every parameter that exists
in several copies (replicated across TP: norms, biases of row-parallel layers; the tied
embedding's copy on the last pipeline stage) is counted once (`ParamInfo.is_owner`). With the
distributed optimizer a rank owns only slices of its model-parallel rank's gradients, so the
sums are all-reduced over the data-parallel group too (the slices partition the buffer, so each
element counts once).
"""
from __future__ import annotations

import torch


def local_grad_stats(grads: list[torch.Tensor], counted: list[bool], device=None) -> torch.Tensor:
    """[sum of squares of the counted grads, number of grads holding an inf or nan] (fp32) on
    this rank, to be all-reduced; one pass over the gradients serves the norm and the overflow
    check (a tensor's norm is inf or nan exactly when it holds one, or overflows fp32)."""
    stats = torch.zeros(2, dtype=torch.float32, device=device)
    if grads:
        norms = torch.stack(torch._foreach_norm([g.float() for g in grads]))
        mask = torch.tensor(counted, dtype=torch.bool, device=norms.device)
        stats[0] = norms[mask].pow(2).sum()
        stats[1] = (~torch.isfinite(norms)).sum()
    return stats


def clip_by_norm(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale `grads` in place so that a global norm `norm` becomes at most `max_norm` (0: off)."""
    if max_norm > 0 and grads:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            torch._foreach_mul_(grads, coeff)
