"""The one owner of the data-parallel side: the gradient (and, with ZeRO-1, parameter) buffers
and every collective that keeps replicas consistent. The optimizer, the loop and checkpoints ask
it; none of them issues a gradient or parameter collective of its own.

Per iteration:
  zero_grad() -> backward accumulates into the fp32 buffer (buckets may start reducing early,
  --overlap-grad-reduce) -> finish_grad_sync():
     1. the tied embedding's two copies (first and last stage), over the embedding group; before
        the DP reduction, since the two stages' buffers are laid out differently;
     2. the DP reduction: all-reduce, or reduce-scatter onto each rank's slice (ZeRO-1);
     3. weights replicated across TP but fed sequence-sharded activations (norms, row-parallel
        biases under sequence parallelism), over TP. TP ranks share one buffer layout, so after a
        reduce-scatter each rank's own slice is still summed correctly.
  -> the optimizer updates (its slices) -> start_param_sync(): ZeRO-1 all-gathers each bucket of
  the parameter buffer, at once or (--overlap-param-gather) bucket by bucket just before the next
  forward needs it.

--overlap-param-gather: a forward pre-hook on every module waits for the bucket(s) holding its
parameters and starts the all-gather of the next bucket, so the gather of bucket k+1 runs during
the forward of bucket k. Buckets are gathered in the order the first forward asked for them
(recorded before the first step, when every parameter is still current); a module without a
forward of its own (a bare nn.Module holding a weight used by its parent) counts as its parent's.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..config import DDPConfig
from ..tensor_parallel.param_info import param_info
from .grad_buffer import GradBuffer


def _has_forward(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward


def _params_used_by(m: nn.Module):
    """m's own parameters and those of descendants reachable through modules without a forward."""
    yield from m.parameters(recurse=False)
    for child in m.children():
        if not _has_forward(child):
            yield from _params_used_by(child)


class DataParallel:
    def __init__(self, model: list[nn.Module], params: list[nn.Parameter], ps, config: DDPConfig,
                 num_microbatches: int):
        self.ps, self.config = ps, config
        self.sharded = config.use_distributed_optimizer
        # context-parallel ranks are replicas too (same parameters, other tokens): reduce and shard over DP x CP
        self.buffer = GradBuffer(params, ps.dp_cp_group, config.ddp_bucket_size,
                                 dtype=torch.bfloat16 if config.grad_reduce_in_bf16 else torch.float32,
                                 pad_to=ps.dp_cp_size if self.sharded else 1, reduce_scatter=self.sharded,
                                 overlap_grad_reduce=config.overlap_grad_reduce, num_microbatches=num_microbatches)
        if self.sharded:
            self.buffer.make_param_buffer()  # parameters become views of one flat buffer per dtype
        self.embedding_params = [p for p in params if param_info(p).embedding_group_sync]
        self.sequence_parallel_params = [p for p in params if param_info(p).sequence_parallel]
        n = len(self.buffer.buckets)
        self.overlap_param_gather = self.sharded and config.overlap_param_gather and ps.dp_cp_size > 1
        self._gather_order: list[int] | None = None  # bucket indices, learned on the first step
        self._requested: list[int] = []
        self._handles: list = [None] * n
        self._dispatched = self._waited = n  # positions in _gather_order; n: nothing pending
        if self.overlap_param_gather:
            self._register_hooks(model)

    # -- gradients ---------------------------------------------------------------------------------
    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's fp32 gradient, accumulated over the iteration's micro-batches (a buffer view)."""
        return self.buffer.main_grad[p]

    def zero_grad(self) -> None:
        self.buffer.zero()

    def set_num_microbatches(self, n: int) -> None:
        """Micro-batches in the coming iteration (the global batch may ramp up): with
        --overlap-grad-reduce a bucket starts reducing once every parameter in it has accumulated
        the gradient of the n-th."""
        self.buffer.num_microbatches = n

    def finish_grad_sync(self) -> None:
        """Every gradient sum of the iteration (see the module docstring), waited for."""
        for p in self.embedding_params:
            comm.all_reduce(self.main_grad(p), self.ps.embedding_group)
        self.buffer.finish_grad_sync()
        for p in self.sequence_parallel_params:
            comm.all_reduce(self.main_grad(p), self.ps.tp_group)

    # -- ZeRO-1: which slices this rank owns, and the parameter all-gather -------------------------
    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """(bucket, start, end): this rank's 1/DP slice of every bucket, in buffer elements."""
        return [(b, *self.buffer.shard_range(b)) for b in range(len(self.buffer.buckets))]

    def start_param_sync(self) -> None:
        """After the optimizer wrote its slices into the parameter buffer: gather every bucket
        (overlapped with the next forward under --overlap-param-gather)."""
        if not self.sharded or self.ps.dp_cp_size == 1:
            return
        buf = self.buffer
        if self.overlap_param_gather:
            if self._gather_order is None:
                seen = set(self._requested)
                self._gather_order = self._requested + [b for b in reversed(range(len(buf.buckets)))
                                                        if b not in seen]
                self._position = {b: i for i, b in enumerate(self._gather_order)}
            self._dispatched = self._waited = 0
            self._dispatch_through(0)
            return
        for b, s, e in self.owned_ranges():
            start, end = buf.buckets[b]
            comm.all_gather_flat(buf.param_data[s:e], buf.param_data[start:end], self.ps.dp_cp_group)

    def finish_param_sync(self) -> None:
        """Wait until every parameter holds the latest update (a no-op unless gathers are pending)."""
        if self._waited < len(self._handles):
            self._wait_through(len(self._handles) - 1)

    def _dispatch_through(self, pos: int) -> None:
        buf = self.buffer
        while self._dispatched <= min(pos, len(self._handles) - 1):
            b = self._gather_order[self._dispatched]
            start, end = buf.buckets[b]
            s, e = buf.shard_range(b)
            self._handles[self._dispatched] = comm.all_gather_flat(
                buf.param_data[s:e], buf.param_data[start:end], self.ps.dp_cp_group, async_op=True)
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

    def _register_hooks(self, model) -> None:
        buf = self.buffer
        for chunk in model:
            for m in chunk.modules():
                if not _has_forward(m):
                    continue
                buckets = sorted({buf.param_bucket[p] for p in _params_used_by(m) if p in buf.param_bucket})
                if buckets:
                    m.register_forward_pre_hook(self._make_hook(buckets))

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

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self) -> list[str]:
        parts = [f"distributed over DP {self.ps.dp_size}" + (f" x CP {self.ps.cp_size}" if self.ps.cp_size > 1 else "") + " (ZeRO-1)"] if self.sharded else []
        if self.buffer.overlap:
            parts.append("overlapped grad reduce")
        if self.overlap_param_gather:
            parts.append("overlapped param gather")
        if self.buffer.data.dtype != torch.float32:
            parts.append(f"{str(self.buffer.data.dtype).replace('torch.', '')} grads")
        return parts + [f"{len(self.buffer.buckets)} bucket(s)"]

    @property
    def grad_bytes(self) -> int:
        return self.buffer.nbytes

    @property
    def param_bytes(self) -> int:
        return self.buffer.param_nbytes
