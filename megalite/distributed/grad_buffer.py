"""Contiguous gradient (and parameter) buffers, split into buckets, reduced over data-parallel ranks.

Every parameter's `main_grad[p]` is a view into one flat fp32 buffer. Autograd's per-parameter
`.grad` is added into it as soon as it is accumulated (post-accumulate hook) and then freed, so
gradients accumulate across micro-batches in fp32 whatever the parameter dtype, and the DP
reduction is a few large collectives (one per bucket) instead of one per parameter. Buckets
follow the reverse of the parameters' order, roughly the order backward produces them, which is
what lets a bucket's reduction overlap the rest of backward (--overlap-grad-reduce).

Layout, in elements of the buffer (the same for grads and, with the distributed optimizer,
for the parameters themselves):

    | bucket 0 (params n-1, n-2, ...) pad | bucket 1 ... pad | ...
    |<- rank 0 ->|<- rank 1 ->| ...          each bucket padded to a multiple of `pad_to` = DP

A parameter never straddles two buckets, but a rank's 1/DP slice of a bucket may start or end
inside a parameter: the distributed optimizer (ZeRO-1) owns slices, not parameters.

Reduction modes: all-reduce (every rank gets the summed gradient), or reduce-scatter (each
rank gets the sum only on the slice it owns; the rest of the buffer then holds this rank's
unreduced values, on gloo as on NCCL: only the owned slice may be read afterwards).
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor_parallel.param_info import param_info


def _defers_grad_sync(p: torch.nn.Parameter) -> bool:
    """Gradients that another sum must reach before the DP reduction: the tied embedding's copies
    across pipeline stages (summed over the embedding group by DataParallel.finish_grad_sync).
    Their buffers have different layouts on the two stages, so the sum cannot follow a
    reduce-scatter. Sequence-parallel weights need no deferral: TP ranks share one buffer
    layout, so their TP sum can follow the DP reduction."""
    return param_info(p).embedding_group_sync


class GradBuffer:
    def __init__(self, params: list[torch.nn.Parameter], dp_group, bucket_size: int = 40_000_000,
                 dtype: torch.dtype = torch.float32, pad_to: int = 1, reduce_scatter: bool = False,
                 overlap_grad_reduce: bool = False, num_microbatches: int = 1):
        """`pad_to`: each bucket's size is rounded up to a multiple of this (the DP size for the
        distributed optimizer, so every bucket splits into equal slices). `reduce_scatter`:
        reduce each bucket onto the slices the ranks own instead of all-reducing it.
        `overlap_grad_reduce`: start a bucket's reduction from the backward hook as soon as
        every parameter in it has accumulated the gradient of the `num_microbatches`-th
        micro-batch."""
        self.params, self.dp_group = list(params), dp_group
        self.dp_size, self.dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
        if reduce_scatter and pad_to % self.dp_size:
            raise ValueError(f"pad_to ({pad_to}) must be a multiple of the data-parallel size ({self.dp_size})")
        self.reduce_scatter, self.overlap = reduce_scatter, overlap_grad_reduce
        self.num_microbatches = num_microbatches
        device = self.params[0].device
        self.buckets: list[tuple[int, int]] = []  # [start, end) in elements, padded
        self.bucket_params: list[list[torch.nn.Parameter]] = []
        self.param_index: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self.param_bucket: dict[torch.nn.Parameter, int] = {}
        offset, bucket_start, members = 0, 0, []
        for i, p in enumerate(reversed(self.params)):
            self.param_index[p] = (offset, offset + p.numel())
            self.param_bucket[p] = len(self.buckets)
            members.append(p)
            offset += p.numel()
            if offset - bucket_start >= bucket_size or i == len(self.params) - 1:
                offset = bucket_start + -(-(offset - bucket_start) // pad_to) * pad_to
                self.buckets.append((bucket_start, offset))
                self.bucket_params.append(members)
                bucket_start, members = offset, []
        self.numel = offset
        self.data = torch.zeros(offset, dtype=dtype, device=device)
        self.param_data: torch.Tensor | None = None  # see make_param_buffer
        # buckets whose reduction must wait for finalize_model_grads (never started early)
        self.deferred = [any(_defers_grad_sync(p) for p in ps) for ps in self.bucket_params]
        self._handles: list = [None] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        self._ready_count: dict[torch.nn.Parameter, int] = {}
        self._bucket_waiting = [len(ps) for ps in self.bucket_params]
        self.main_grad: dict[torch.nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            start, end = self.param_index[p]
            self.main_grad[p] = self.data[start:end].view(p.shape)
            p.register_post_accumulate_grad_hook(self._accumulate)

    # -- layout --------------------------------------------------------------------------------
    def shard_range(self, bucket: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of `rank`'s (default: this rank's) 1/DP slice of `bucket`."""
        start, end = self.buckets[bucket]
        size = (end - start) // self.dp_size
        rank = self.dp_rank if rank is None else rank
        return start + rank * size, start + (rank + 1) * size

    def make_param_buffer(self) -> torch.Tensor:
        """Move the parameters into one flat buffer of their dtype with the gradient buffer's
        layout (p.data becomes a view), so a bucket's parameters can be all-gathered at once."""
        if self.param_data is None:
            p0 = self.params[0]
            self.param_data = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)
            for p in self.params:
                if p.dtype != p0.dtype:
                    raise ValueError(f"parameters of mixed dtypes ({p0.dtype}, {p.dtype}) cannot share a buffer")
                start, end = self.param_index[p]
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view
        return self.param_data

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def param_nbytes(self) -> int:
        """Bytes the parameters occupy: the flat buffer (with padding) when there is one."""
        if self.param_data is not None:
            return self.param_data.numel() * self.param_data.element_size()
        return sum(p.numel() * p.element_size() for p in self.params)

    # -- accumulation ----------------------------------------------------------------------------
    def _accumulate(self, p: torch.nn.Parameter) -> None:
        self.main_grad[p].add_(p.grad)
        p.grad = None
        if not self.overlap:
            return
        b = self.param_bucket[p]
        if self._started[b]:
            raise RuntimeError("a gradient was accumulated after its bucket's reduction had started "
                               "(a parameter used more than once per micro-batch outside one autograd graph?); "
                               "run without --overlap-grad-reduce")
        n = self._ready_count.get(p, 0) + 1
        self._ready_count[p] = n
        if n == self.num_microbatches:
            self._bucket_waiting[b] -= 1
            if self._bucket_waiting[b] == 0 and not self.deferred[b]:
                self.start_grad_sync(b)

    def zero(self) -> None:
        self.finish_grad_sync(start_missing=False)
        self.data.zero_()
        self._ready_count.clear()
        self._bucket_waiting = [len(ps) for ps in self.bucket_params]
        self._started = [False] * len(self.buckets)

    # -- reduction -------------------------------------------------------------------------------
    def start_grad_sync(self, b: int) -> None:
        """Start the DP sum of bucket `b` (asynchronously with --overlap-grad-reduce). The loss
        is already normalised by the global token count, so a sum, not a mean, is the gradient
        of the global-batch loss."""
        start, end = self.buckets[b]
        full = self.data[start:end]
        if self.reduce_scatter:
            s, e = self.shard_range(b)
            self._handles[b] = comm.reduce_scatter_flat(full, self.data[s:e], self.dp_group, async_op=self.overlap)
        elif self.overlap:
            self._handles[b] = comm.all_reduce_async(full, self.dp_group)
        else:
            comm.all_reduce(full, self.dp_group)
        self._started[b] = True

    def finish_grad_sync(self, start_missing: bool = True) -> None:
        """Start the buckets not started yet (in bucket order, the same on every DP rank), then
        wait for every reduction."""
        if start_missing:
            for b in range(len(self.buckets)):
                if not self._started[b]:
                    self.start_grad_sync(b)
        for b, h in enumerate(self._handles):
            if h is not None:
                h.wait()
                self._handles[b] = None
