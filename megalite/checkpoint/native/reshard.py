"""Which saved elements a rank needs: flat-index arithmetic between two tensor-parallel layouts.

A tensor-parallel shard is cut from the whole tensor along dimension `dim`, after splitting it
into `stride` blocks along that dimension (SwiGLU's [gate; up], see model.init.shard). With
A = prod(full_shape[:dim]), B = prod(full_shape[dim+1:]) and c = full_shape[dim] / (stride·T),
view the whole tensor as [A·stride, T, c·B]: TP rank r holds [:, r, :]. So its local flat
index l and the whole tensor's flat index f are related by

    l = o·R + i,    f = (o·T + r)·R + i,    R = c·B (a "row": contiguous in both), 0 <= i < R.

A local flat range [lo, hi) (the whole shard, or a ZeRO-1 slice of it) is therefore a list of
contiguous runs in the whole tensor, at most one per row. Mapping those runs into another
layout (another T, hence another R) cuts them at that layout's row boundaries; each piece then
lies in one old TP rank's shard at contiguous local positions. Everything here is vectorised
with NumPy: a row-parallel weight has one row per output feature.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np


@dataclass(frozen=True)
class ShardLayout:
    full_shape: tuple[int, ...]  # the whole tensor (vocabulary padded as this layout pads it)
    dim: int = 0
    stride: int = 1
    tp_size: int = 1  # 1: replicated (every rank holds the whole tensor)

    @property
    def row(self) -> int:
        """R: elements per contiguous row of a shard."""
        if self.tp_size == 1:
            return prod(self.full_shape) or 1
        c = self.full_shape[self.dim] // (self.stride * self.tp_size)
        return c * prod(self.full_shape[self.dim + 1:])

    @property
    def local_numel(self) -> int:
        return prod(self.full_shape) // self.tp_size


def runs(layout: ShardLayout, tp_rank: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Local flat [lo, hi) of TP rank `tp_rank` as runs of the whole tensor: (full start, length),
    in local order (so the runs' lengths, concatenated, fill [lo, hi))."""
    if hi <= lo:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if layout.tp_size == 1:
        return np.array([lo], np.int64), np.array([hi - lo], np.int64)
    R, T = layout.row, layout.tp_size
    o = np.arange(lo // R, (hi - 1) // R + 1, dtype=np.int64)
    start = np.maximum(o * R, lo)
    end = np.minimum((o + 1) * R, hi)
    return (o * T + tp_rank) * R + (start - o * R), end - start


def locate(layout: ShardLayout, full_start: np.ndarray, length: np.ndarray, dest: np.ndarray):
    """Cut whole-tensor runs (each to land at `dest` in the caller's buffer) at the rows of
    `layout`: returns (TP rank, local start, length, dest) of each piece."""
    if layout.tp_size == 1:
        return np.zeros_like(full_start), full_start, length, dest
    R, T = layout.row, layout.tp_size
    k0, k1 = full_start // R, (full_start + length - 1) // R  # first and last row of each run
    count = k1 - k0 + 1
    idx = np.repeat(np.arange(len(full_start)), count)
    k = k0[idx] + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    start = np.maximum(k * R, full_start[idx])
    end = np.minimum((k + 1) * R, full_start[idx] + length[idx])
    o, r = k // T, k % T
    return r, o * R + (start - k * R), end - start, dest[idx] + (start - full_start[idx])


def split_at(cuts: np.ndarray, start: np.ndarray, length: np.ndarray, dest: np.ndarray):
    """Cut ranges [start, start + length) at the sorted points `cuts` (cuts[0] <= every start,
    cuts[-1] >= every end). Returns (interval index i, with cuts[i] <= start' < cuts[i + 1];
    start', length', dest')."""
    end = start + length
    i0 = np.searchsorted(cuts, start, side="right") - 1
    i1 = np.searchsorted(cuts, end - 1, side="right") - 1
    count = i1 - i0 + 1
    idx = np.repeat(np.arange(len(start)), count)
    i = i0[idx] + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    s = np.maximum(cuts[i], start[idx])
    e = np.minimum(cuts[i + 1], end[idx])
    return i, s, e - s, dest[idx] + (s - start[idx])


def coalesce(start: np.ndarray, length: np.ndarray, gap: int) -> list[tuple[int, int, np.ndarray]]:
    """Group ranges (sorted by start) whose gaps are at most `gap` elements: one read each.
    Returns (read start, read end, indices of the ranges it serves)."""
    if len(start) == 0:
        return []
    order = np.argsort(start, kind="stable")
    s, e = start[order], start[order] + length[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > reach[:-1] + gap
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], len(s))
    return [(int(s[a]), int(reach[b - 1]), order[a:b]) for a, b in zip(firsts, lasts)]
