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


NORM_PIECE = 1 << 14  # elements of a gradient per piece of the multi-tensor fp64 norm (not on the CPU)
CPU_SCRATCH = 1 << 20  # CPU: elements of a gradient converted to fp64 at a time, into one 8 MiB buffer


def _pieces(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The flat pieces of at most NORM_PIECE elements each gradient is cut into, and the index of
    the gradient each piece belongs to."""
    pieces, owner = [], []
    for i, g in enumerate(grads):
        parts = g.reshape(-1).split(NORM_PIECE)
        pieces += parts
        owner += [i] * len(parts)
    return pieces, owner


def _sum_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """[len(grads)] fp64: each gradient's sum of squares, accumulated in fp64.

    On the CPU each gradient is copied, CPU_SCRATCH elements at a time, into one fp64 buffer and
    dotted with itself. The multi-tensor norm converts every piece into a fresh fp64 block of its
    own, and on the CPU those 128 KiB blocks come from glibc's heap between the small tensors
    of its results, which they fragment: after the step, up to 0.7 GB of a rank's RSS in the
    memory-wall run (docs/zero.md; 2.06 -> 2.69 GB per rank), held on a varying set of ranks.
    Elsewhere (CUDA, meta) one multi-tensor norm of NORM_PIECE-element pieces, fused there."""
    device = grads[0].device
    if device.type != "cpu":
        pieces, owner = _pieces(grads)
        piece_sq = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square()
        index = torch.tensor(owner, device=piece_sq.device)
        return torch.zeros(len(grads), dtype=torch.float64, device=device).index_add_(0, index, piece_sq)
    scratch = torch.empty(min(CPU_SCRATCH, max(g.numel() for g in grads)), dtype=torch.float64)
    sq = torch.zeros(len(grads), dtype=torch.float64)
    for i, g in enumerate(grads):
        flat = g.reshape(-1)
        for lo in range(0, flat.numel(), CPU_SCRATCH):
            part = scratch[:min(CPU_SCRATCH, flat.numel() - lo)]
            part.copy_(flat[lo:lo + CPU_SCRATCH])
            sq[i] += torch.dot(part, part)
    return sq


def local_grad_stats(grads: list[torch.Tensor], counted: list[bool], device=None,
                     count_zeros: bool = False) -> torch.Tensor:
    """[sum of squares of the counted grads, number of grads holding an inf or nan, zero elements
    of the counted grads (with `count_zeros`, --log-num-zeros-in-grad; else 0)] (fp64) on this
    rank, to be all-reduced; one pass over the gradients serves the norm and the overflow
    check (a tensor's norm is inf or nan exactly when it holds one, or overflows).

    The squares are accumulated in fp64: in fp32 the norm of a 49M-element gradient (a 32000 x
    1536 embedding) came out 0.38% low on the CPU, and by an amount that depends on how the
    tensor is cut, so the norm, and with it clipping, would depend on the layout (ZeRO's slices).
    The fp64 reduction converts its input, so each gradient is reduced in parts (`_sum_squares`):
    converting a whole one allocated an fp64 copy of every gradient (8 bytes per parameter,
    fresh pages each step) and made the norm 3% of an fp32 CPU step; the parts' fp64 squares add
    up to the same sum within fp64 rounding."""
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    if grads:
        sq = _sum_squares(grads)
        mask = torch.tensor(counted, dtype=torch.bool, device=sq.device)
        stats[0] = torch.where(mask, sq, 0.0).sum()  # no boolean indexing: shapes stay data-independent (meta)
        stats[1] = (~torch.isfinite(sq)).sum()
        if count_zeros:
            zeros = [(g == 0).sum() for g, c in zip(grads, counted) if c]
            if zeros:
                stats[2] = torch.stack(zeros).sum().double()
    return stats


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| over the tensors (0 for none; NaN if one holds a NaN), in fp64: the infinity norm
    from one min/max pass per tensor (torch.aminmax), as exact as it and on the CPU several
    times faster than torch._foreach_norm(tensors, inf) or abs().amax()."""
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    if not extremes:
        return torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else None)
    both = torch.stack(extremes)  # [n, 2]: min, max
    return torch.maximum(both[:, 1], -both[:, 0]).max().double()


def clip_by_norm(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale `grads` in place so that a global norm `norm` becomes at most `max_norm` (0: off)."""
    if max_norm > 0 and grads:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            torch._foreach_mul_(grads, coeff)
