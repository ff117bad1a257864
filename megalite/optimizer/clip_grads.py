"""Global gradient norm and clipping across every model-parallel shard, over flat gradient memory.

The norm is over the whole model: each rank sums the squares of the gradients it owns, the
sums are all-reduced over the model-parallel (TP x PP) group, and every parameter that exists
in several copies (replicated across TP: norms, biases of row-parallel layers; the tied
embedding's copy on the last pipeline stage) is counted once (`ParamInfo.is_owner`). With the
distributed optimizer a rank owns only slices of its model-parallel rank's gradients, so the
sums are all-reduced over the data-parallel group too (the slices partition the buffer, so each
element counts once).

Host work: the gradients live in a few flat buffers (distributed/grad_buffer.py), so every pass
here is a handful of ops per flat tensor, whatever the number of elements or parameters: the
step launches the same few kernels at 125M and at 175B (the reference, clip_grad_norm_, runs
one norm per parameter). Copies counted twice are few and small (TP-replicated norms and biases,
the tied output layer on the last stage): their squares are computed apart and subtracted.
"""
from __future__ import annotations

import torch

# Elements reduced in fp32 before the fp64 sum. Accuracy: a row's fp32 sum of squares has a
# relative error of at most ~ (elements per accumulator lane) x 2^-24 (a few 1e-7 for 1024
# elements), each row rounds independently, and the rows' squares add up in fp64; measured on a
# 49M-element gradient: 4e-8 relative against the exact fp64 sum, where one fp32 norm of the
# whole tensor was 0.7% off on the CPU. Memory: one fp32 value per row (0.1% of the gradient),
# never an fp64 copy of the gradient. The same code serves every device, so the CPU and a GPU
# compute the same function.
NORM_ROW = 1024
# pieces below this size (norm weights, biases) are concatenated and reduced together
SMALL_PIECE = 64 * NORM_ROW


def sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """sum(x^2) of a contiguous 1-D tensor (any float dtype) as an fp64 0-d tensor, in a constant
    number of ops: [rows, NORM_ROW] fp32 row norms, their squares summed in fp64. inf or nan when
    the tensor holds one, or when a row's squares overflow fp32 (|x| beyond ~1e17: diverged)."""
    n = flat.numel()
    k = n - n % NORM_ROW
    norms = []
    if k:
        norms.append(torch.linalg.vector_norm(flat[:k].view(-1, NORM_ROW), dim=1, dtype=torch.float32))
    if k < n:
        norms.append(torch.linalg.vector_norm(flat[k:], dtype=torch.float32).reshape(1))
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=flat.device)
    rows = norms[0] if len(norms) == 1 else torch.cat(norms)
    return rows.double().square().sum()


def pieces_sum_of_squares(pieces: list[torch.Tensor]) -> torch.Tensor:
    """sum(x^2) over several tensors, fp64: the large ones each by rows, the small ones
    concatenated into one (a copy of a few KB instead of a reduction each)."""
    small = [p.reshape(-1) for p in pieces if p.numel() < SMALL_PIECE]
    parts = [sum_of_squares(p.reshape(-1)) for p in pieces if p.numel() >= SMALL_PIECE]
    if small:
        parts.append(sum_of_squares(torch.cat(small) if len(small) > 1 else small[0]))
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


class GradStats:
    """What one step needs of the local gradients: [sum of squares of what this rank counts,
    number of flat buffers holding an inf or nan, zero elements of the counted gradients (with
    --log-num-zeros-in-grad; else 0)] (fp64) on this rank, to be all-reduced; one pass over the
    gradients serves the norm and the overflow check (a flat buffer's sum of squares is inf or
    nan exactly when it holds one, or overflows).

    `flats`: the flat gradient tensors the optimizer steps (padding holds zeros). `counted`:
    per flat, whether this rank counts it at all (under expert parallelism only one replica
    group's rank does). `duplicates`: views into counted flats of gradients counted on another
    rank (TP-replicated weights on TP ranks other than 0, the tied output layer on the last
    stage): their squares are subtracted. `zero_pieces`: the counted gradients, for
    --log-num-zeros-in-grad (None: not counted)."""

    def __init__(self, flats: list[torch.Tensor], counted: list[bool], duplicates: list[torch.Tensor],
                 zero_pieces: list[torch.Tensor] | None = None):
        self.flats = [f for f in flats if f.numel()]
        counted = [c for f, c in zip(flats, counted) if f.numel()]
        self.device = self.flats[0].device if self.flats else None
        self.all_counted = all(counted)
        self.mask = torch.tensor(counted, dtype=torch.bool, device=self.device)
        self.duplicates = duplicates
        self.zero_pieces = zero_pieces

    def local(self) -> torch.Tensor:
        if not self.flats:
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        sq = torch.stack([sum_of_squares(f) for f in self.flats])  # [flats]
        # no boolean indexing: shapes stay data-independent (meta)
        counted = sq.sum() if self.all_counted else torch.where(self.mask, sq, 0.0).sum()
        if self.duplicates:
            counted = counted - pieces_sum_of_squares(self.duplicates).to(counted.device)
        bad = (~torch.isfinite(sq)).sum().double()
        zeros = (torch.stack([(g == 0).sum() for g in self.zero_pieces]).sum().double()
                 if self.zero_pieces else torch.zeros((), dtype=torch.float64, device=self.device))
        return torch.stack([counted, bad, zeros])


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| over the tensors (0 for none; NaN if one holds a NaN), in fp64: the infinity norm
    from one min/max pass per tensor (torch.aminmax), as exact as it and on the CPU several
    times faster than torch._foreach_norm(tensors, inf) or abs().amax(). Called on the flat
    gradient buffers: a few ops per step."""
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    if not extremes:
        return torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else None)
    both = extremes[0].unsqueeze(0) if len(extremes) == 1 else torch.stack(extremes)  # [n, 2]: min, max
    return torch.maximum(both[:, 1], -both[:, 0]).max().double()


def scale_(flats: list[torch.Tensor], factor: float) -> None:
    """Multiply the flat gradients in place (unscaling, clipping): one multi-tensor op."""
    if flats and factor != 1.0:
        torch._foreach_mul_(flats, factor)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that makes a global norm `norm` at most `max_norm` (0: off), 1.0 when none is needed."""
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            return coeff
    return 1.0
