"""The distributed optimizer (ZeRO stage 1; Rajbhandari et al. 2020, Sec. 5.1): fp32 master
weights and Adam's moments are sharded over the data-parallel ranks.

Layout (see distributed/grad_buffer.py): parameters and gradients live in two flat buffers with
the same layout, split into buckets, each bucket padded to a multiple of DP. DP rank r owns the
r-th 1/DP slice of every bucket (`DataParallel.owned_ranges`); a slice may begin or end inside a
parameter, so the optimizer steps *pieces*: (parameter, [lo, hi) in the buffer). Per iteration:

  backward -> grads accumulate in the fp32 buffer
  reduce-scatter each bucket      -> rank r holds the summed gradient of its slice   (DataParallel)
  unscale, overflow check, norm   -> all-reduced over DP and the model-parallel group
  AdamW on the slice's fp32 masters (views of the param buffer itself when params are fp32)
  copy masters -> param slice (cast to bf16/fp16), all-gather each bucket         (DataParallel)

Optimizer state per rank is 12 bytes per parameter / DP with 16-bit parameters (fp32 master
4 + Adam m, v 8), instead of 12 per parameter; the gradient buffer stays whole (ZeRO-1).
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor_parallel.param_info import param_info
from .optimizer import MixedPrecisionOptimizer


class DistributedOptimizer(MixedPrecisionOptimizer):
    distributed = True

    def __init__(self, named_params, args, dp, ps):
        if not dp.sharded:
            raise ValueError("the distributed optimizer needs a DataParallel built with use_distributed_optimizer")
        super().__init__(named_params, args, dp, ps)

    # -- what is stepped: this rank's slice of every bucket ----------------------------------------
    def _build_masters(self) -> None:
        buf, tp_rank = self.dp.buffer, self.ps.tp_rank
        self.shards = []  # (slice start, slice end, offset in master_data)
        pieces = []  # (param, lo, hi, offset in master_data)
        offset = 0
        for b, s, e in self.dp.owned_ranges():
            self.shards.append((s, e, offset))
            for p in buf.bucket_params[b]:
                ps_, pe_ = buf.param_index[p]
                lo, hi = max(ps_, s), min(pe_, e)
                if lo < hi:
                    pieces.append((p, lo, hi, offset + lo - s))
            offset += e - s
        if self.fp32_params:
            self.master_data = None  # the optimizer steps the param buffer's slice in place
            self.masters = [buf.param_data[lo:hi] for _, lo, hi, _ in pieces]
        else:
            self.master_data = torch.empty(offset, dtype=torch.float32, device=self.device)
            for s, e, o in self.shards:
                self.master_data[o:o + e - s].copy_(buf.param_data[s:e])
            self.masters = [self.master_data[o:o + hi - lo] for _, lo, hi, o in pieces]
        self.master_ndims = [p.ndim for p, *_ in pieces]
        self.main_grads = [buf.data[lo:hi] for _, lo, hi, _ in pieces]
        self.counted = [param_info(p).is_owner(tp_rank) for p, *_ in pieces]
        self._pieces = [(p, lo - buf.param_index[p][0], hi - buf.param_index[p][0]) for p, lo, hi, _ in pieces]

    def _master_bytes(self) -> int:
        return 0 if self.master_data is None else self.master_data.numel() * self.master_data.element_size()

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """Slices partition each model-parallel rank's buffer: sum over DP (x CP), then over TP x PP."""
        comm.all_reduce(stats, self.ps.dp_cp_group)
        comm.all_reduce(stats, self.ps.mp_group)

    def _update_params(self) -> None:
        """Masters -> this rank's slices of the parameter buffer; the data-parallel module
        gathers the rest."""
        if self.master_data is not None:
            for s, e, o in self.shards:
                self.dp.buffer.param_data[s:e].copy_(self.master_data[o:o + e - s])
        self.dp.start_param_sync()

    def pieces(self) -> list[tuple]:
        return [(p, lo, hi, m) for (p, lo, hi), m in zip(self._pieces, self.masters)]
