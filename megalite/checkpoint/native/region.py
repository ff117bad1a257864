"""Reading one region of a saved tensor from any load index (megalite's global or per-rank index,
Megatron-LM's torch_dist or torch seen as one): the elements of a shard in the layout of the run
that reads, found in the saved pieces that overlap them (reshard.py's arithmetic), nearby ranges
of one piece read as one."""
from __future__ import annotations

import numpy as np
import torch

from ...errors import CheckpointError
from .reshard import ShardLayout, coalesce, locate, runs, split_at
from .tensor_file import element_size

READ_GAP_BYTES = 4096  # two ranges of one piece closer than this are read as one (a page)


def read_region(index, name: str, kind: str, target: ShardLayout, tp_rank: int, lo: int, hi: int,
                tied: bool = False) -> torch.Tensor:
    """Elements [lo, hi) of TP rank `tp_rank`'s local shard of `kind` of `name`, in the layout
    `target`, read from the saved pieces that overlap them (fp32; zeros in padded vocabulary
    rows). `tied`: prefer the pieces saved for the tied embedding's last-stage copy."""
    found = index.entry(name)
    pieces = [pc for pc in (found[1] if found else []) if pc.kind == kind]
    pieces = ([pc for pc in pieces if pc.tied] if tied else []) or [pc for pc in pieces if not pc.tied]
    if not pieces:
        raise CheckpointError(f"{index.directory} has no {kind} for {name}")
    lay = found[0]
    old = ShardLayout(tuple(lay["full_shape"]), lay["dim"], lay["stride"], lay["tp_size"])
    row_elems = int(np.prod(target.full_shape[1:], dtype=np.int64))
    if lay["rows"] is None and tuple(target.full_shape) != old.full_shape:
        raise CheckpointError(f"{index.directory}: {name} has shape {old.full_shape} in the checkpoint and "
                              f"{tuple(target.full_shape)} in this run")
    out = torch.zeros(hi - lo, dtype=torch.float32)
    full_start, length = runs(target, tp_rank, lo, hi)
    dest = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    if lay["rows"] is not None:  # padded vocabulary: rows past the real ones stay zero
        limit = lay["rows"] * row_elems
        length = np.clip(limit - full_start, 0, length)
        keep = length > 0
        full_start, length, dest = full_start[keep], length[keep], dest[keep]
    old_rank, start, length, dest = locate(old, full_start, length, dest)
    for r in np.unique(old_rank):
        mine = sorted((pc for pc in pieces if pc.tp_rank == r), key=lambda pc: pc.lo)
        if not mine or mine[0].lo != 0 or mine[-1].hi != old.local_numel or \
                any(a.hi != b.lo for a, b in zip(mine, mine[1:])):
            raise CheckpointError(f"{index.directory}: the saved pieces of {kind} of {name} do not cover TP rank "
                                  f"{int(r)}'s shard (incomplete or duplicated)")
        sel = old_rank == r
        cuts = np.array([pc.lo for pc in mine] + [mine[-1].hi], dtype=np.int64)
        which, s, n, d = split_at(cuts, start[sel], length[sel], dest[sel])
        for k in np.unique(which):
            pc, sk = mine[k], which == k
            s_k, n_k, d_k = s[sk] - pc.lo, n[sk], d[sk]
            gap = READ_GAP_BYTES // (4 if pc.dtype is None else element_size(pc.dtype))  # format 1: dtype unknown
            for a, b, members in coalesce(s_k, n_k, gap):
                data = index.read(pc, a, b)
                for m in members:
                    o = int(s_k[m]) - a
                    out[int(d_k[m]):int(d_k[m]) + int(n_k[m])] = data[o:o + int(n_k[m])]
    return out
