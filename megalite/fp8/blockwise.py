"""Block scaling (--fp8-recipe blockwise): DeepSeek-V3's fine-grained quantization (technical
report arXiv 2412.19437, Sec. 3.3.2): a scale per 1x128 tile of the activations and their
gradients (one token, 128 channels along the reduced dimension) and per 128x128 block of the
weights, so that one outlier costs the precision of its tile only. The weight gradient reduces
over tokens, so there X and dY are cast in 128x1 tiles (128 tokens, one channel; Fig. 7).

Tiles are cut in the one process's coordinates: a dimension split over ranks (a tensor-parallel
weight's rows, a row-parallel linear's input channels) maps each local position to its place in
the whole tensor (`Axis`), and a tile that straddles two ranks gets its amax from both (one MAX
all-reduce of the tile grid over the splitting group; none where every tile a rank touches is
wholly its own, as at real sizes where shards are multiples of 128). The token tiles of the
weight gradient are cut in this rank's token order: they match one process's where each GEMM sees
the one process's tokens (tensor, sequence, pipeline and data parallelism; not context or expert
parallelism, which give a rank other tokens: docs/fp8.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from .operand import Operand, amax_to_scale, cast
from .recipe import Role

BLOCK = 128


@dataclass
class Axis:
    """One dimension of an operand: `index`, the whole-tensor position of each local one (None:
    the dimension is whole here); `group`, the ranks holding the rest; `whole_tiles`, every tile
    this rank touches is wholly its own (no collective)."""
    size: int  # the whole dimension
    index: torch.Tensor | None = None
    group: object = None
    whole_tiles: bool = True

    @classmethod
    def split(cls, local: int, rank: int, size: int, stride: int, group, device) -> "Axis":
        """A dimension split over `size` ranks (this one `rank`), the whole being `stride`
        blocks stacked, each split separately (ParamInfo.partition_stride: [gate; up])."""
        if size == 1:
            return cls(local)
        whole = local * size
        per_block, part = whole // stride, local // stride
        j = torch.arange(local)  # on the host: a few integers a dimension (and the meta device has no bincount)
        index = (j // part) * per_block + rank * part + j % part
        counts = torch.bincount(index // BLOCK, minlength=-(-whole // BLOCK))
        full = torch.clamp(whole - torch.arange(counts.numel()) * BLOCK, max=BLOCK)
        touched = counts > 0
        return cls(whole, index.to(device), group, bool((counts[touched] == full[touched]).all()))

    def tile_ids(self, local: int, device) -> torch.Tensor:
        index = self.index if self.index is not None else torch.arange(local, device=device)
        return index // BLOCK

    @property
    def num_tiles(self) -> int:
        return -(-self.size // BLOCK)


def _tile_amax(a: torch.Tensor, ids: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The max of |a| over each tile along `dim` (ids: each position's tile) -> n along dim."""
    shape = list(a.shape)
    shape[dim] = n
    out = torch.zeros(shape, dtype=a.dtype, device=a.device)
    index = ids.view([-1 if d == dim else 1 for d in range(a.dim())]).expand_as(a)
    return out.scatter_reduce_(dim, index, a, "amax", include_self=True)


def quantize(x: torch.Tensor, dtype: torch.dtype, role: Role, rows: Axis | None, cols: Axis | None) -> Operand:
    """x [R, C] cast with one scale per tile: `rows` / `cols` tile that dimension by 128 (None:
    a tile per position along it). 1x128: rows=None; 128x128: both; 128x1: cols=None."""
    a = x.detach().abs().float()
    r, c = x.shape
    row_ids = col_ids = None
    if cols is not None:
        col_ids = cols.tile_ids(c, x.device)
        a = _tile_amax(a, col_ids, cols.num_tiles, 1)
        if not cols.whole_tiles:
            comm.all_reduce(a, cols.group, op=torch.distributed.ReduceOp.MAX)
    if rows is not None:
        row_ids = rows.tile_ids(r, x.device)
        a = _tile_amax(a, row_ids, rows.num_tiles, 0)
        if not rows.whole_tiles:
            comm.all_reduce(a, rows.group, op=torch.distributed.ReduceOp.MAX)
    scale = amax_to_scale(a, dtype)  # the tile grid
    if row_ids is not None:
        scale = scale.index_select(0, row_ids)
    if col_ids is not None:
        scale = scale.index_select(1, col_ids)
    return cast(x, scale, dtype, role)


def token_axis(tokens: int) -> Axis:
    """The token dimension of a weight gradient's operands: 128-token tiles in this rank's order."""
    return Axis(tokens)


__all__ = ["Axis", "BLOCK", "quantize", "token_axis"]
