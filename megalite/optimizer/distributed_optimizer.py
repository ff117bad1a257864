"""The distributed optimizer (ZeRO stage 1; Rajbhandari et al. 2020, Sec. 5.1): fp32 master
weights and Adam's moments are sharded over the data-parallel ranks.

Layout (see distributed/grad_buffer.py): parameters and gradients live in two flat buffers with
the same layout, split into buckets, each bucket padded to a multiple of DP. DP rank r owns the
r-th 1/DP slice of every bucket; a slice may begin or end inside a parameter, so the optimizer
steps *pieces*: (parameter, [lo, hi) in the buffer). Per iteration:

  backward -> grads accumulate in the fp32 buffer
  reduce-scatter each bucket      -> rank r holds the summed gradient of its slice
  unscale, overflow check, norm   -> all-reduced over DP and the model-parallel group
  AdamW on the slice's fp32 masters (views of the param buffer itself when params are fp32)
  copy masters -> param slice (cast to bf16/fp16), all-gather each bucket -> every rank has
  the whole updated model

Optimizer state per rank is 12 bytes per parameter / DP with 16-bit parameters (fp32 master
4 + Adam m, v 8), instead of 12 per parameter; the gradient buffer stays whole (ZeRO-1).

--overlap-param-gather: the all-gathers are not waited for in step(). A forward pre-hook on
every module waits for the bucket(s) holding its parameters and starts the all-gather of the
next bucket, so the gather of bucket k+1 runs during the forward of bucket k. Buckets are
gathered in the order the first forward pass asked for them (recorded before the first step,
when every parameter is still current); a module without a forward of its own (a bare
nn.Module holding a weight used by its parent) counts as part of its parent.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .clip_grads import is_counted
from .optimizer import MixedPrecisionOptimizer


def _has_forward(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward


def _params_used_by(m: nn.Module):
    """m's own parameters and those of descendants reachable through modules without a forward."""
    yield from m.parameters(recurse=False)
    for child in m.children():
        if not _has_forward(child):
            yield from _params_used_by(child)


class DistributedOptimizer(MixedPrecisionOptimizer):
    distributed = True

    def __init__(self, named_params, args, grad_buffer, ps, model=None):
        if not grad_buffer.reduce_scatter:
            raise ValueError("the distributed optimizer needs a GradBuffer built with reduce_scatter=True")
        grad_buffer.make_param_buffer()
        self.overlap_param_gather = bool(getattr(args, "overlap_param_gather", False))
        super().__init__(named_params, args, grad_buffer, ps, model)
        n = len(grad_buffer.buckets)
        self._gather_order: list[int] | None = None  # bucket indices, learned on the first step
        self._requested: list[int] = []
        self._handles: list = [None] * n
        self._dispatched = self._waited = n  # positions in _gather_order; n: nothing pending
        self._hooks = []
        if self.overlap_param_gather and ps.dp_size > 1:
            if model is None:
                raise ValueError("--overlap-param-gather needs the model chunks to hook their forward")
            self._register_hooks(model)

    # -- what is stepped: this rank's slice of every bucket ----------------------------------------
    def _build_masters(self) -> None:
        buf, tp_rank = self.grad_buffer, self.ps.tp_rank
        self.shards = []  # (bucket, slice start, slice end, offset in master_data)
        pieces = []  # (param, lo, hi, offset in master_data)
        offset = 0
        for b in range(len(buf.buckets)):
            s, e = buf.shard_range(b)
            self.shards.append((b, s, e, offset))
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
            for _, s, e, o in self.shards:
                self.master_data[o:o + e - s].copy_(buf.param_data[s:e])
            self.masters = [self.master_data[o:o + hi - lo] for _, lo, hi, o in pieces]
        self.master_ndims = [p.ndim for p, *_ in pieces]
        self.main_grads = [buf.data[lo:hi] for _, lo, hi, _ in pieces]
        self.counted = [is_counted(p, tp_rank) for p, *_ in pieces]
        self.pieces = [(p, lo, hi) for p, lo, hi, _ in pieces]

    def _master_bytes(self) -> int:
        return 0 if self.master_data is None else self.master_data.numel() * self.master_data.element_size()

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """Slices partition each model-parallel rank's buffer: sum over DP, then over TP x PP."""
        comm.all_reduce(stats, self.ps.dp_group)
        comm.all_reduce(stats, self.ps.mp_group)

    # -- from the updated slices to every rank's parameters ---------------------------------------
    def _update_params(self) -> None:
        buf = self.grad_buffer
        if self.master_data is not None:
            for _, s, e, o in self.shards:
                buf.param_data[s:e].copy_(self.master_data[o:o + e - s])
        if self.ps.dp_size == 1:
            return
        if self.overlap_param_gather:
            if self._gather_order is None:
                seen = set(self._requested)
                self._gather_order = self._requested + [b for b in reversed(range(len(buf.buckets)))
                                                        if b not in seen]
                self._position = {b: i for i, b in enumerate(self._gather_order)}
            self._dispatched = self._waited = 0
            self._dispatch_through(0)
            return
        for b, s, e, _ in self.shards:
            start, end = buf.buckets[b]
            comm.all_gather_flat(buf.param_data[s:e], buf.param_data[start:end], self.ps.dp_group)

    def _dispatch_through(self, pos: int) -> None:
        buf = self.grad_buffer
        while self._dispatched <= min(pos, len(self._handles) - 1):
            b = self._gather_order[self._dispatched]
            start, end = buf.buckets[b]
            s, e = buf.shard_range(b)
            self._handles[self._dispatched] = comm.all_gather_flat(
                buf.param_data[s:e], buf.param_data[start:end], self.ps.dp_group, async_op=True)
            self._dispatched += 1

    def _wait_through(self, pos: int) -> None:
        """Make the buckets at gather positions <= pos current; start the next one's gather."""
        self._dispatch_through(pos + 1)
        while self._waited <= pos:
            h = self._handles[self._waited]
            if h is not None:
                h.wait()
                self._handles[self._waited] = None
            self._waited += 1

    def finish_param_sync(self) -> None:
        if self._waited < len(self._handles):
            self._wait_through(len(self._handles) - 1)

    def _register_hooks(self, model) -> None:
        buf = self.grad_buffer
        for chunk in model:
            for m in chunk.modules():
                if not _has_forward(m):
                    continue
                buckets = sorted({buf.param_bucket[p] for p in _params_used_by(m) if p in buf.param_bucket})
                if buckets:
                    self._hooks.append(m.register_forward_pre_hook(self._make_hook(buckets)))

    def _make_hook(self, buckets: list[int]):
        def hook(module, inputs):
            if self._gather_order is None:  # before the first step: record the order of use
                for b in buckets:
                    if b not in self._requested:
                        self._requested.append(b)
                return
            if self._waited < len(self._handles):
                self._wait_through(max(self._position[b] for b in buckets))
        return hook
