"""The one owner of the data-parallel side, for every sharding strategy: the gradient and
parameter buffers and every collective that keeps replicas consistent. The optimizer, the loop
and checkpoints ask it; none of them issues a gradient or parameter collective of its own.

Strategies (Megatron-LM's --data-parallel-sharding-strategy; bytes per parameter and rank with
bf16 parameters and Adam, d = DP size; Rajbhandari et al. 2020, Fig. 1):

  no_shard             2 + 4 + 12        all-reduced gradients, replicated optimizer
  optim (ZeRO-1)       2 + 4 + 12/d      reduce-scatter, sharded optimizer, all-gather after the step
  optim_grads (ZeRO-2) 2 + 4/d + 12/d    ... and only this rank's slice of the gradient lives
  optim_grads_params   (2 + 4 + 12)/d    ... and of the parameters: gathered per layer for
    (ZeRO-3)                             forward and backward, then freed

Per iteration:
  zero_grad() -> backward: gradients go into the fp32 buffer (grad_buffer.py; full size, or a
  bucket-sized staging buffer reduce-scattered per micro-batch under ZeRO-2/3); buckets may
  start reducing early (--overlap-grad-reduce) -> finish_grad_sync():
     1. the tied embedding's two copies (first and last stage), over the embedding group;
        before the reduction of a full buffer (the two stages' buffers are laid out
        differently), after it for sharded gradients (the embedding has a bucket of its own,
        laid out alike on both stages, so each rank's slices line up). Under zbv both ends of
        the V are pipeline rank 0's two chunks: the copies are summed there, no collective;
     2. the DP reduction: all-reduce, or reduce-scatter onto each rank's slice;
     3. weights replicated across TP but fed sequence-sharded activations (norms, row-parallel
        biases under sequence parallelism), over TP. TP ranks share one buffer layout, so after a
        reduce-scatter each rank's own slice is still summed correctly.
  -> the optimizer updates (its slices) -> start_param_sync(): ZeRO-1/2 all-gather each bucket
  of the parameter buffer, at once or (--overlap-param-gather) bucket by bucket just before the
  next forward needs it; ZeRO-3 gathers nothing here (zero3.py gathers on use).

--overlap-param-gather under ZeRO-1/2: a forward pre-hook on every module waits for the
bucket(s) holding its parameters and starts the all-gather of the next bucket, so the gather of
bucket k+1 runs during the forward of bucket k. Buckets are gathered in the order the first
forward asked for them (recorded before the first step, when every parameter is still current);
a module without a forward of its own (a bare nn.Module holding a weight used by its parent)
counts as its parent's. Under ZeRO-3 the flag prefetches the next unit's gather.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import comm
from ..config.parallel import DDPConfig
from ..config.sharding import get_strategy
from ..tensor_parallel.param_info import param_info
from .buckets import BucketLayout
from .grad_buffer import GradBuffer, ShardedGradBuffer
from .param_buffer import FlatParamBuffer, ShardedParams
from .zero3 import Zero3Schedule, unit_of_params


def fusable_weights(model: list[nn.Module], device: torch.device) -> list[nn.Parameter]:
    """The weights whose gradient can skip autograd (tensor_parallel/grad_fusion.py): those each
    module names as used only through the fused products (`fusable_weights(device)`: the
    column- and row-parallel linears, the experts' per-expert loop, the output layer)."""
    return [w for chunk in model for m in chunk.modules() if hasattr(m, "fusable_weights")
            for w in m.fusable_weights(device)]


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
                 num_microbatches: int, device=None, init_fn=None, timers=None, experts: bool = False):
        """`model`: this rank's chunks; `params`: their parameters in model order. `experts`: the
        params are MoE experts' weights, replicated over the expert-data-parallel group only
        (expert_data_parallel.py pairs such a DataParallel with the dense one). Under ZeRO-3
        the parameters may be on the meta device: they are materialised on `device` from
        `init_fn(p)` (the TP-local initial value) one at a time, straight into this rank's slices.
        `timers` (runtime.timers.Timers): times the ZeRO-1/2 parameter gathers."""
        self.ps, self.config = ps, config
        self.timers = timers
        self.strategy = strategy = get_strategy(config.data_parallel_sharding_strategy)
        self.params = list(params)
        device = device if device is not None else self.params[0].device
        # context-parallel ranks are replicas too (same parameters, other tokens): gradients
        # are reduced, and state sharded, over DP x CP (an expert's: over its DP x CP / EP replicas)
        self.experts = experts
        self.group, self.group_size = ((ps.expert_dp_group, ps.expert_dp_size) if experts
                                       else (ps.dp_cp_group, ps.dp_cp_size))
        # --num-distributed-optimizer-instances: shard within this rank's instance of the group, and
        # sum each reduced shard with its copies in the other instances (`across`)
        self.across = None
        if strategy.shards_optimizer and ps.instances > 1:
            self.group, self.across = ps.shard_group(experts), ps.across_group(experts)
            self.group_size = comm.group_size(self.group)
        dp, group = self.group_size, self.group
        # --grad-reduce-in-bf16: gradients accumulate and are reduced in bf16 (half the bytes)
        grad_dtype = torch.bfloat16 if config.grad_reduce_in_bf16 else torch.float32
        self.layout = BucketLayout(self.params, group, config.ddp_bucket_size,
                                   pad_to=dp if strategy.shards_optimizer else 1, unit_of=self._unit_key(model))
        if any(p.device.type == "meta" for p in self.params) and not strategy.shards_params and device.type != "meta":
            raise ValueError("parameters on the meta device are materialised only under optim_grads_params "
                             "(or stay there for a dry run: device meta)")
        # ZeRO-3 first: materialising swaps tensors, which must happen before hooks are registered
        self.param_buffer = (ShardedParams(self.layout, group, device, init_fn) if strategy.shards_params
                             else None)
        if strategy.shards_grads:
            self.grads = ShardedGradBuffer(self.layout, group, config.overlap_grad_reduce, num_microbatches,
                                           config.reduce_grads_every_microbatch, device, dtype=grad_dtype,
                                           on_round_complete=self._on_round_complete)
        else:
            self.grads = GradBuffer(self.layout, group, reduce_scatter=strategy.shards_optimizer,
                                    overlap_grad_reduce=config.overlap_grad_reduce,
                                    num_microbatches=num_microbatches, device=device, dtype=grad_dtype)
        self.zero3 = None
        if strategy.shards_params:
            self.zero3 = Zero3Schedule(model, self.param_buffer, prefetch=config.overlap_param_gather and dp > 1,
                                       keep_gathered=config.keep_params_gathered_in_step,
                                       num_microbatches=num_microbatches, grads=self.grads,
                                       tied_output=not experts)
        elif strategy.shards_optimizer:
            self.param_buffer = FlatParamBuffer(self.layout, group)
        # --gradient-accumulation-fusion: the linears' weight-gradient GEMMs write into the
        # gradient buffer (tensor_parallel/grad_fusion.py); after ZeRO-3's schedule, which
        # decides whether the output layer is the embedding gathered for itself
        self.fused_wgrad = (self.grads.fuse_wgrad(fusable_weights(model, device)) if config.gradient_accumulation_fusion
                            else [])
        self.embedding_params = [p for p in self.params if param_info(p).embedding_group_sync]
        self.sequence_parallel_params = [p for p in self.params if param_info(p).sequence_parallel]
        self._embedding_buckets = sorted({self.layout.param_bucket[p] for p in self.embedding_params})
        # zbv (tied): the embedding (chunk 0) and its output-layer copy (chunk 1) both on this rank
        self._local_tie = bool(getattr(ps, "v_shape", False)) and len(self.embedding_params) == 2
        self._sp_grad_views = [] if not strategy.shards_grads else [
            self.grads.grad_shard(b)[off:off + hi - lo] for b, p, lo, hi, off in self.shard_pieces()
            if param_info(p).sequence_parallel]
        # ZeRO-1/2 --overlap-param-gather
        n = len(self.layout.buckets)
        self.overlap_param_gather = (strategy.shards_optimizer and not strategy.shards_params
                                     and config.overlap_param_gather and dp > 1)
        self._slices = None  # ZeRO-3: param -> [(lo, hi, stored slice)], built on first use
        self._gather_order: list[int] | None = None  # bucket indices, learned on the first step
        self._requested: list[int] = []
        self._handles: list = [None] * n
        self._dispatched = self._waited = n  # positions in _gather_order; n: nothing pending
        self._module_hooks: list = []
        if self.overlap_param_gather:
            self._register_hooks(model)

    def _unit_key(self, model):
        """What a bucket may not mix (buckets.py): nothing for full gradient buffers; model
        chunks and the tied embedding for sharded gradients; every ZeRO-3 unit for sharded
        parameters. The tied embedding gets a bucket of its own so that its slices line up on
        the first and last stage (finish_grad_sync sums them after the reduction)."""
        if not self.strategy.shards_grads:
            return None
        chunk_of = {p: c for c, chunk in enumerate(model) for p in chunk.parameters()}
        unit_of = unit_of_params(model) if self.strategy.shards_params else {}

        def key(p):
            unit = unit_of.get(p)
            return (chunk_of.get(p), id(unit) if unit is not None else None, param_info(p).embedding_group_sync)
        return key

    # -- gradients ---------------------------------------------------------------------------------
    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's fp32 gradient, accumulated over the iteration's micro-batches (a buffer view)."""
        if self.strategy.shards_grads:
            raise RuntimeError(f"under {self.strategy.name} no rank holds a whole gradient: use grad_shard()")
        return self.grads.main_grad[p]

    def zero_grad(self) -> None:
        self.grads.zero()

    def set_num_microbatches(self, n: int) -> None:
        """Micro-batches in the coming iteration (the global batch may ramp up): with
        --overlap-grad-reduce a bucket starts reducing once every parameter in it has accumulated
        the gradient of the n-th."""
        self.grads.num_microbatches = n
        if self.zero3 is not None:
            self.zero3.num_microbatches = n

    def finish_grad_sync(self) -> None:
        """Every gradient sum of the iteration (see the module docstring), waited for."""
        if not self.strategy.shards_grads:
            self.grads.zero_missing()  # before the embedding copies' sum reads them
            self._sum_embedding_copies([self.main_grad(p) for p in self.embedding_params])
            self.grads.finish_grad_sync()
            self._sum_across_instances()
            for p in self.sequence_parallel_params:
                comm.all_reduce(self.main_grad(p), self.ps.tp_group)
            return
        self.grads.finish_grad_sync()
        self._sum_across_instances()
        self._sum_embedding_copies([self.grads.grad_shard(b) for b in self._embedding_buckets])
        if self._sp_grad_views and self.ps.tp_size > 1:
            flat = torch.cat(self._sp_grad_views)
            comm.all_reduce(flat, self.ps.tp_group)
            torch._foreach_copy_(self._sp_grad_views, list(flat.split([v.numel() for v in self._sp_grad_views])))
        if self.strategy.shards_params:
            self.param_buffer.free_all()  # the optimizer is about to change the slices

    def _sum_embedding_copies(self, grads: list[torch.Tensor]) -> None:
        """The tied embedding's gradient (or slices of it), one tensor per copy this rank holds:
        summed over the embedding group, or with each other where both copies are here (zbv)."""
        if self._local_tie:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        for g in grads:
            comm.all_reduce(g, self.ps.embedding_group)

    def _sum_across_instances(self) -> None:
        """--num-distributed-optimizer-instances: each instance reduce-scattered its own ranks'
        gradients; the shards are summed with their copies in the other instances (Megatron-LM's
        two-stage reduction), so every instance steps the whole batch's gradient."""
        if self.across is None or comm.group_size(self.across) < 2:
            return
        if self.strategy.shards_grads:
            comm.all_reduce(self.grads.shard, self.across)
            return
        for b in range(len(self.layout.buckets)):
            comm.all_reduce(self.grads.grad_shard(b), self.across)

    def _on_round_complete(self, b: int, c: int) -> None:
        if self.zero3 is not None:
            self.zero3.on_round_complete(b, c)

    # -- what this rank owns -----------------------------------------------------------------------
    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """(bucket, start, end): this rank's 1/DP slice of every bucket, in buffer elements."""
        return [(b, *self.layout.shard_range(b)) for b in range(len(self.layout.buckets))]

    def shard_pieces(self):
        """(bucket, param, lo, hi, offset): the parameters overlapping this rank's slices; [lo, hi)
        in the parameter's flat elements, at `offset` in the bucket's slice."""
        for b, s, _ in self.owned_ranges():
            for p, lo, hi in self.layout.pieces_in_shard(b):
                yield b, p, lo, hi, self.layout.param_index[p][0] + lo - s

    def grad_shard(self, b: int) -> torch.Tensor:
        """This rank's slice of bucket b's reduced fp32 gradient."""
        return self.grads.grad_shard(b)

    def grad_flats(self) -> list[tuple[torch.Tensor, list[int]]]:
        """(flat tensor, its buckets): the gradient memory the optimizer steps, in as few
        contiguous tensors as the layout allows, so that the step's passes over it (norm, overflow
        check, unscaling, clipping) are a few ops each, not one per parameter: the whole buffer
        (no_shard), this rank's slice of each bucket (ZeRO-1: the slices are strided across the
        buffer), or the one shard tensor holding every slice (ZeRO-2/3). Padding holds zeros."""
        buckets = list(range(len(self.layout.buckets)))
        if not self.strategy.shards_optimizer:
            return [(self.grads.data, buckets)]
        if not self.strategy.shards_grads:
            return [(self.grad_shard(b), [b]) for b in buckets]
        return [(self.grads.shard, buckets)]

    def bucket_of(self, p: nn.Parameter) -> int:
        return self.layout.param_bucket[p]

    def param_shard(self, b: int) -> torch.Tensor:
        """This rank's slice of bucket b's parameters, where the optimizer writes its update."""
        if self.param_buffer is None:
            raise RuntimeError("no_shard keeps no parameter buffer")
        return self.param_buffer.param_shard(b)

    def param_pieces(self) -> list[tuple]:
        """(param, lo, hi, tensor) for what this rank stores of every parameter: whole
        parameters (replicated over DP), or under ZeRO-3 its flat slices. Checkpoints save and
        load through these, so no parameter is gathered for them."""
        if not self.strategy.shards_params:
            return [(p, 0, p.numel(), p) for p in self.params]
        return [(p, lo, hi, self.param_shard(b)[off:off + hi - lo]) for b, p, lo, hi, off in self.shard_pieces()]

    def param_slice(self, p: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """A view of elements [lo, hi) of p's flat values, which this rank must store (any range
        under no_shard/ZeRO-1/2; under ZeRO-3 one inside a slice it owns)."""
        if not self.strategy.shards_params:
            return p.detach().view(-1)[lo:hi]
        if self._slices is None:
            self._slices = {}
            for q, a, z, t in self.param_pieces():
                self._slices.setdefault(q, []).append((a, z, t))
        for a, z, t in self._slices.get(p, ()):
            if a <= lo and hi <= z:
                return t[lo - a:hi - a]
        raise KeyError(f"this rank stores no slice [{lo}, {hi}) of a {tuple(p.shape)} parameter")

    # -- parameters after the step -----------------------------------------------------------------
    def start_param_sync(self) -> None:
        """After the optimizer wrote its slices: ZeRO-1/2 gather every bucket (overlapped with
        the next forward under --overlap-param-gather). ZeRO-3 gathers on use."""
        if not self.strategy.shards_optimizer or self.strategy.shards_params or self.group_size == 1:
            return
        with self._gather_timer():
            if not self.overlap_param_gather:
                for b in range(len(self.layout.buckets)):
                    self.param_buffer.all_gather(b)
                return
            if self._gather_order is None:
                seen = set(self._requested)
                self._gather_order = self._requested + [b for b in reversed(range(len(self.layout.buckets)))
                                                        if b not in seen]
                self._position = {b: i for i, b in enumerate(self._gather_order)}
            self._dispatched = self._waited = 0
            self._dispatch_through(0)

    def finish_param_sync(self) -> None:
        """Wait until every parameter holds the latest update (a no-op unless gathers are
        pending); under ZeRO-3, free what is gathered."""
        if self.strategy.shards_params:
            self.param_buffer.free_all()
        elif self._waited < len(self._handles):
            with self._gather_timer():
                self._wait_through(len(self._handles) - 1)

    def _gather_timer(self):
        """params-all-gather (Megatron-LM's timer): the ZeRO-1/2 gathers after the optimizer step,
        or under --overlap-param-gather their dispatch and the waits outside the forward. The waits
        in the forward pre-hooks, and ZeRO-3's per-unit gathers (zero3.py), run inside
        forward-backward and are timed there."""
        return self.timers("params-all-gather") if self.timers is not None else contextlib.nullcontext()

    def _dispatch_through(self, pos: int) -> None:
        while self._dispatched <= min(pos, len(self._handles) - 1):
            b = self._gather_order[self._dispatched]
            self._handles[self._dispatched] = self.param_buffer.all_gather(b, async_op=True)
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
        for chunk in model:
            for m in chunk.modules():
                if not _has_forward(m):
                    continue
                buckets = sorted({self.layout.param_bucket[p] for p in _params_used_by(m)
                                  if p in self.layout.param_bucket})
                if buckets:
                    self._module_hooks.append(m.register_forward_pre_hook(self._make_hook(buckets)))

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

    def close(self) -> None:
        """Remove every hook this object put on the model and its parameters, so that a finished
        run leaves nothing attached (the gradient hooks would keep its buffers and process group
        alive: grad_buffer._Hooked). Local only: on a run that failed, peers may be gone, so
        gathers still in flight are not waited for (the loop's own end waits for them)."""
        self.grads.close()
        for h in self._module_hooks + (self.zero3.hooks if self.zero3 is not None else []):
            h.remove()
        self._module_hooks = []

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self) -> list[str]:
        parts = []
        if self.strategy.shards_optimizer:
            parts.append(f"{self.strategy.describe()} over DP {self.ps.dp_size}"
                         + (f" x CP {self.ps.cp_size}" if self.ps.cp_size > 1 else "")
                         + (f" in {self.ps.instances} instances of {self.group_size}" if self.across is not None
                            else "")
                         if not self.experts else f"experts over expert-DP {self.group_size}")
        if self.config.overlap_grad_reduce:
            parts.append("overlapped grad reduce")
        if self.overlap_param_gather or (self.zero3 is not None and self.zero3.prefetch):
            parts.append("overlapped param gather" if not self.strategy.shards_params else "prefetched param gather")
        if self.grads.dtype != torch.float32:
            parts.append(f"{str(self.grads.dtype).replace('torch.', '')} grads")
        return parts + [f"{len(self.layout.buckets)} bucket(s)"]

    @property
    def grad_bytes(self) -> int:
        """Gradient memory that lives through the step (ZeRO-2/3: this rank's slices; the
        bucket-sized staging buffers come and go)."""
        return self.grads.nbytes

    @property
    def param_bytes(self) -> int:
        """Parameter memory that lives through the step (the flat buffer with its padding;
        ZeRO-3: this rank's slices, not the per-layer working set gathered on use)."""
        if self.param_buffer is not None:
            return self.param_buffer.nbytes
        return sum(p.numel() * p.element_size() for p in self.params)
