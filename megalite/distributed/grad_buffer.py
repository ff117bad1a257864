"""Gradient buffers: where autograd's per-parameter `.grad` goes, and its data-parallel reduction.

Autograd's `.grad` of every parameter is added into an fp32 buffer (bf16 with
--grad-reduce-in-bf16) as soon as it is accumulated
(post-accumulate-grad hook) and then freed, so gradients accumulate across micro-batches in fp32
whatever the parameter dtype, and the DP reduction is a few large collectives (one per bucket,
buckets.py) instead of one per parameter.

`GradBuffer` (no_shard, ZeRO-1 optim): one full-size buffer that lives for the whole run. Each
bucket is all-reduced, or reduce-scattered onto the slices the ranks own (ZeRO-1: the rest of
the buffer then holds this rank's unreduced values; only the owned slice may be read). A step's
first gradient of a parameter is copied into its view, later ones added, so the buffer is never
zeroed as a whole: zeroing and then adding moved 4 + 10 bytes per parameter and micro-batch step
where the copy moves 6 (and a 16-bit gradient's add into fp32 runs at about half the bandwidth of
the copy's cast, on a GPU); the views of parameters that got no gradient in a step are zeroed
before the reduction (`zero_missing`). The linear layers' weights skip even that pass: their
weight-gradient GEMM writes (β = 0) or adds (β = 1) into the view itself
(--gradient-accumulation-fusion, `fuse_wgrad`, tensor_parallel/grad_fusion.py; in the sharded
buffers below, into the staging buffer's view).

`ShardedGradBuffer` (ZeRO-2 optim_grads, ZeRO-3 optim_grads_params; Rajbhandari et al. 2020,
Sec. 5.2): only this rank's 1/DP slice of every bucket lives through the step, 4/DP bytes per
parameter. Gradients are added into a bucket-sized fp32 staging buffer; once every parameter of
the bucket has its gradient of the micro-batch, the staging buffer is reduce-scattered, its
slice added to the rank's shard, and it is freed. So the collective runs once per micro-batch
(m times per step), not once per step: keeping the step's full gradient until the last
micro-batch would hold the 4-bytes-per-parameter buffer ZeRO-2 exists to remove (the
alternative, `reduce_every_microbatch=False`, is kept for the measurement in
benchmarks/RESULTS_zero.md).
"""
from __future__ import annotations

import weakref

import torch

from .. import comm
from ..tensor_parallel import grad_fusion
from ..tensor_parallel.param_info import param_info
from .buckets import BucketLayout


def _defers_grad_sync(p: torch.nn.Parameter) -> bool:
    """Gradients that another sum must reach before a full buffer's DP reduction: the tied
    embedding's copies across pipeline stages (summed over the embedding group by
    DataParallel.finish_grad_sync). Their buffers have different layouts on the two stages, so
    the sum cannot follow a reduce-scatter. The sharded buffers put the tied embedding in a
    bucket of its own instead (same layout on both stages), so there the sum follows the
    reduction. Sequence-parallel weights need no deferral: TP ranks share one buffer layout."""
    return param_info(p).embedding_group_sync


class _Accumulator:
    """Counts, per bucket, the micro-batches whose gradients have fully arrived ("rounds"):
    round c of bucket b is complete when every parameter of b has accumulated c gradients."""

    def __init__(self, layout: BucketLayout):
        self.layout = layout
        self.reset()

    def reset(self) -> None:
        self.count: dict = {}
        self.arrived = [dict() for _ in self.layout.buckets]
        self.complete = [0] * len(self.layout.buckets)

    def arrive(self, p) -> tuple[int, int] | None:
        """Record one gradient of p; returns (bucket, round) when that completes a round."""
        b = self.layout.param_bucket[p]
        c = self.count.get(p, 0) + 1
        self.count[p] = c
        n = self.arrived[b].get(c, 0) + 1
        self.arrived[b][c] = n
        if n == len(self.layout.bucket_params[b]):
            del self.arrived[b][c]
            self.complete[b] = c
            return b, c
        return None


class _Hooked:
    """Owns the post-accumulate-grad hooks that route autograd's `.grad` into the buffer. A hook
    lives in C++ on its parameter, so a hook holding the buffer would make parameter -> hook ->
    buffer -> layout -> parameter a cycle Python's gc cannot see: it kept every finished run's
    buffers, model and data-parallel group (with its threads and sockets) alive in a process
    that trains again. So the hooks hold the buffer weakly, and `close` removes them."""

    def _hook_params(self, layout: BucketLayout) -> None:
        self._fused: set = set()  # gradient written by its GEMM since the hook last ran (fuse_wgrad)
        self._fusion_params: list = []
        self._gemm: dict = {}  # weight dtype -> grad_fusion's GEMM into this buffer (None: not fused)
        buffer = weakref.ref(self)

        def accumulate(p: torch.nn.Parameter) -> None:
            b = buffer()
            if b is not None:  # a buffer no one holds any more: the gradient stays in p.grad
                b._accumulate(p)

        self._hooks = [p.register_post_accumulate_grad_hook(accumulate) for p in layout.params]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        grad_fusion.detach(self._fusion_params)
        self._fusion_params = []

    def fuse_wgrad(self, params) -> list:
        """--gradient-accumulation-fusion: the weight-gradient GEMMs of `params` (weights whose
        every use goes through tensor_parallel/grad_fusion.py's products) write into this buffer
        (`add_wgrad`) instead of autograd's `.grad`, which then arrives as a stand-in the hook
        drops (`_fused`). Returns those taken: none where the buffer's dtype cannot be a GEMM's
        output for these weights on this device."""
        self._gemm = {dtype: grad_fusion.gemm_for(dtype, self.dtype, torch.device(self.device))
                      for dtype in {p.dtype for p in params}}
        params = [p for p in params if p in self.layout.param_bucket and self._gemm[p.dtype] is not None]
        grad_fusion.attach(params, self)
        self._fusion_params = params
        return params


class GradBuffer(_Hooked):
    """A full-size fp32 gradient buffer (no_shard, ZeRO-1)."""

    sharded = False

    def __init__(self, layout: BucketLayout, dp_group, reduce_scatter: bool = False,
                 overlap_grad_reduce: bool = False, num_microbatches: int = 1, device=None,
                 dtype=torch.float32):
        """`reduce_scatter`: reduce each bucket onto the slices the ranks own instead of
        all-reducing it (needs buckets padded to DP). `overlap_grad_reduce`: start a bucket's
        reduction from the backward hook as soon as every parameter in it has accumulated the
        gradient of the `num_microbatches`-th micro-batch."""
        self.layout, self.dp_group = layout, dp_group
        if reduce_scatter and layout.pad_to % layout.dp_size:
            raise ValueError("reduce-scatter needs buckets padded to a multiple of the data-parallel size")
        self.reduce_scatter, self.overlap = reduce_scatter, overlap_grad_reduce
        self.num_microbatches = num_microbatches
        self.dtype = dtype
        self.data = torch.zeros(layout.numel, dtype=dtype, device=device)
        # buckets whose reduction must wait for finish_grad_sync (never started early)
        self.deferred = [any(_defers_grad_sync(p) for p in ps) for ps in layout.bucket_params]
        self._handles: list = [None] * len(layout.buckets)
        self._started = [False] * len(layout.buckets)
        self._acc = _Accumulator(layout)
        self._fresh = set(layout.params)  # no gradient yet this step: the next one is copied, not added
        self.device = self.data.device
        self.main_grad: dict = {}
        for p in layout.params:
            start, end = layout.param_index[p]
            self.main_grad[p] = self.data[start:end].view(p.shape)
        self._hook_params(layout)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def grad_shard(self, b: int) -> torch.Tensor:
        s, e = self.layout.shard_range(b)
        return self.data[s:e]

    # -- accumulation ----------------------------------------------------------------------------
    def add_wgrad(self, p: torch.nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        """p's gradient a·b ([out, tokens]·[tokens, in]), from its GEMM straight into its view:
        written on the step's first arrival (β = 0), added on later ones. The stand-in `.grad`
        autograd then hands the hook is dropped there (`_fused`)."""
        self._gemm[p.dtype](self.main_grad[p], a, b, overwrite=p in self._fresh)
        self._fresh.discard(p)
        self._fused.add(p)

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        if p in self._fused:  # already in the view: p.grad is the fused GEMM's uninitialised stand-in
            self._fused.discard(p)
        elif p in self._fresh:
            self.main_grad[p].copy_(p.grad)
            self._fresh.discard(p)
        else:
            self.main_grad[p].add_(p.grad)
        p.grad = None
        if not self.overlap:
            return
        b = self.layout.param_bucket[p]
        if self._started[b]:
            raise RuntimeError("a gradient was accumulated after its bucket's reduction had started "
                               "(a parameter used more than once per micro-batch outside one autograd graph?); "
                               "run without --overlap-grad-reduce")
        done = self._acc.arrive(p)
        if done is not None and done[1] == self.num_microbatches and not self.deferred[b]:
            self.start_grad_sync(b)

    def zero(self) -> None:
        """A new step: every parameter's next gradient is copied over what its view holds."""
        self.finish_grad_sync(start_missing=False)
        self._fresh = set(self.layout.params)
        self._acc.reset()
        self._started = [False] * len(self.layout.buckets)

    def zero_missing(self) -> None:
        """Zero the views of the parameters that got no gradient this step (before any read)."""
        for p in self._fresh:
            self.main_grad[p].zero_()
        self._fresh = set()

    # -- reduction -------------------------------------------------------------------------------
    def start_grad_sync(self, b: int) -> None:
        """Start the DP sum of bucket `b` (asynchronously with --overlap-grad-reduce). The loss
        is already normalised by the global token count, so a sum, not a mean, is the gradient
        of the global-batch loss."""
        self._started[b] = True
        if self.layout.dp_size == 1:  # nothing to sum (and no op to spend on it)
            return
        start, end = self.layout.buckets[b]
        full = self.data[start:end]
        if self.reduce_scatter:
            self._handles[b] = comm.reduce_scatter_flat(full, self.grad_shard(b), self.dp_group, async_op=self.overlap)
        elif self.overlap:
            self._handles[b] = comm.all_reduce_async(full, self.dp_group)
        else:
            comm.all_reduce(full, self.dp_group)

    def finish_grad_sync(self, start_missing: bool = True) -> None:
        """Start the buckets not started yet (in bucket order, the same on every DP rank), then
        wait for every reduction."""
        if start_missing:
            self.zero_missing()
            for b in range(len(self.layout.buckets)):
                if not self._started[b]:
                    self.start_grad_sync(b)
        for b, h in enumerate(self._handles):
            if h is not None:
                h.wait()
                self._handles[b] = None


class ShardedGradBuffer(_Hooked):
    """This rank's slice of every bucket's reduced fp32 gradient (ZeRO-2, ZeRO-3), and the
    bucket-sized staging buffers the micro-batches' gradients pass through (module docstring).

    `on_round_complete(b, c)` is called when bucket b has every gradient of micro-batch round c
    (ZeRO-3 frees the bucket's gathered parameters there)."""

    sharded = True

    def __init__(self, layout: BucketLayout, dp_group, overlap_grad_reduce: bool = False,
                 num_microbatches: int = 1, reduce_every_microbatch: bool = True, device=None,
                 on_round_complete=None, max_in_flight: int = 2, dtype=torch.float32):
        if layout.pad_to % layout.dp_size:
            raise ValueError("sharded gradients need buckets padded to a multiple of the data-parallel size")
        self.layout, self.dp_group, self.device = layout, dp_group, device
        self.overlap, self.num_microbatches = overlap_grad_reduce, num_microbatches
        self.reduce_every_microbatch = reduce_every_microbatch
        self.on_round_complete, self.max_in_flight = on_round_complete, max_in_flight
        self.dtype = dtype
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self._staging: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._whole = [len(ps) == 1 and ps[0].numel() == e - s for ps, (s, e) in zip(layout.bucket_params,
                                                                                    layout.buckets)]
        self._in_flight: list[tuple[int, torch.Tensor, object]] = []  # (bucket, staging, handle), oldest first
        self._acc = _Accumulator(layout)
        self.peak_staging_bytes = 0  # most staging memory held at once (benchmarks report it)
        self._hook_params(layout)

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def grad_shard(self, b: int) -> torch.Tensor:
        o = self.layout.shard_offset(b)
        s, e = self.layout.shard_range(b)
        return self.shard[o:o + e - s]

    def _staging_bytes(self) -> int:
        held = [t for t in self._staging if t is not None] + [t for _, t, _ in self._in_flight]
        return sum(t.numel() * t.element_size() for t in held)

    # -- accumulation ----------------------------------------------------------------------------
    def _staged_view(self, p: torch.nn.Parameter, staging: list, b: int, make=torch.zeros) -> torch.Tensor:
        """p's view of staging[b], which `make` allocates on first use."""
        start, end = self.layout.buckets[b]
        if staging[b] is None:
            staging[b] = make(end - start, dtype=self.dtype, device=self.device)
        lo, hi = self.layout.param_index[p]
        return staging[b][lo - start:hi - start].view(p.shape)

    def _stage(self, p: torch.nn.Parameter, grad: torch.Tensor, staging: list, b: int) -> None:
        """Add `grad` (p's shape) into staging[b], allocating it on first use."""
        if staging[b] is None and self._whole[b] and grad.dtype == self.dtype and grad.is_contiguous():
            # a bucket that is exactly this parameter: autograd's gradient becomes the
            # staging buffer, no copy (for a vocabulary-sized embedding, the step's largest tensor)
            staging[b] = grad.detach().view(-1)
        else:
            self._staged_view(p, staging, b).add_(grad)

    def add_partial(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """A part of p's gradient delivered outside autograd (ZeRO-3's tied output projection,
        zero3.TiedOutputGather), while autograd still accumulates the rest: reduced at once, in
        a bucket-sized buffer of its own (the same collective, in the same order, on every DP
        rank, completed before returning), so that it is not held until p's other part arrives.
        It does not count as p's arrival. Without reduce_every_microbatch it waits in the
        bucket's staging buffer."""
        b = self.layout.param_bucket[p]
        if not self.reduce_every_microbatch:
            self._stage(p, grad, self._staging, b)
            return
        own: list = [None] * len(self.layout.buckets)
        self._stage(p, grad, own, b)
        self.peak_staging_bytes = max(self.peak_staging_bytes,
                                      self._staging_bytes() + own[b].numel() * own[b].element_size())
        self._reduce(b, own[b])
        while self._in_flight:  # not left in flight: the point is to drop the [V, h] gradient now
            self._finish_oldest()

    def add_wgrad(self, p: torch.nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        """p's gradient a·b ([out, tokens]·[tokens, in]) from its GEMM straight into its view of
        the bucket's staging buffer (written into a bucket of its own alone, added otherwise:
        the buffer starts at zero); the hook then drops autograd's stand-in (`_fused`)."""
        k = self.layout.param_bucket[p]
        alone = self._staging[k] is None and self._whole[k]
        view = self._staged_view(p, self._staging, k, torch.empty if alone else torch.zeros)
        self._gemm[p.dtype](view, a, b, overwrite=alone)
        self._fused.add(p)

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        b = self.layout.param_bucket[p]
        if p in self._fused:  # already staged by its GEMM: p.grad is the uninitialised stand-in
            self._fused.discard(p)
        else:
            self._stage(p, p.grad, self._staging, b)
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes())
        p.grad = None
        done = self._acc.arrive(p)
        if done is None:
            return
        b, c = done
        if self.reduce_every_microbatch or c == self.num_microbatches:
            self._start(b)
        if self.on_round_complete is not None:
            self.on_round_complete(b, c)

    def _start(self, b: int) -> None:
        """Reduce-scatter bucket b's staging buffer; its slice is added to the shard when the
        collective is waited for (at once without --overlap-grad-reduce)."""
        staging, self._staging[b] = self._staging[b], None
        self._reduce(b, staging)

    def _reduce(self, b: int, staging: torch.Tensor) -> None:
        start = self.layout.buckets[b][0]
        s, e = self.layout.shard_range(b)
        handle = comm.reduce_scatter_flat(staging, staging[s - start:e - start], self.dp_group, async_op=self.overlap)
        self._in_flight.append((b, staging, handle))
        while len(self._in_flight) > (self.max_in_flight if self.overlap else 0):
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        b, staging, handle = self._in_flight.pop(0)
        if handle is not None:
            handle.wait()
        start = self.layout.buckets[b][0]
        s, e = self.layout.shard_range(b)
        self.grad_shard(b).add_(staging[s - start:e - start])

    def zero(self) -> None:
        self.finish_grad_sync(start_missing=False)
        self._staging = [None] * len(self.layout.buckets)
        self.shard.zero_()
        self._acc.reset()

    def finish_grad_sync(self, start_missing: bool = True) -> None:
        """Reduce what is still staged (in bucket order, the same on every DP rank), then wait
        for every reduction."""
        if start_missing:
            for b in range(len(self.layout.buckets)):
                if self._staging[b] is not None:
                    self._start(b)
        while self._in_flight:
            self._finish_oldest()
