"""The one place that talks to torch.distributed.

Every collective in megalite goes through here, so that (a) a group of size one costs nothing
and needs no initialised process group, (b) the gaps of the gloo backend are bridged once, and
(c) every blocking wait is seen by one monitor (`set_monitor`, installed by the training loop): it
times the waits for --log-straggler, and when a collective fails or outlives
--distributed-timeout-minutes it dumps this rank's stacks and names the collective, its group,
the iteration and the pipeline stage (`CollectiveError`).

Flat reduce-scatter and all-gather (`reduce_scatter_tensor`, `all_gather_into_tensor`: one
contiguous buffer in, one out) are what NCCL runs for sequence parallelism and the distributed
optimizer. gloo has them too (its `_reduce_scatter_base` and `_allgather_base`, since about
torch 2.3, so in every torch setup.cfg admits): sequence parallelism's small [s, b, h] ones use
them on gloo, so the CPU tests run the very calls NCCL runs. Whether the installed gloo has them is
measured once, on a private one-rank gloo group (no peers, no traffic), not assumed; without
them, reduce-scatter is emulated by an all-reduce and all-gather by a list all-gather. ZeRO's
bucket-sized flat collectives run as in-place all-reduces on gloo (`flat_by_all_reduce`: gloo's
own copy through a temporary as large as the bucket, and are slower). Note that a native
reduce-scatter leaves the rest of its input as it was (this rank's unreduced values): only the
returned / `out` chunk holds the sum.
"""
from __future__ import annotations

import datetime
import functools
import os

import torch
import torch.distributed as dist

# torch >= 2.10 renames the flat collectives (the old names warn); same arguments
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

from .errors import UserError
from .rendezvous import attempt_store


class CollectiveError(RuntimeError):
    """A collective that failed or timed out, named with where the run stood."""


# The loop's monitor.CommMonitor, told about every blocking call below; None: no bookkeeping
# (tools and tests that call these functions directly).
_monitor = None


def set_monitor(monitor):
    """Install `monitor` (None: none); returns the one it replaces."""
    global _monitor
    previous, _monitor = _monitor, monitor
    return previous


def _blocking(name: str, group, fn, /, *args, **kwargs):
    """Run a call that blocks until the collective completes, under the monitor."""
    m = _monitor
    if m is None:
        return fn(*args, **kwargs)
    token = m.enter(name, group)
    try:
        out = fn(*args, **kwargs)
    except RuntimeError as e:  # gloo/NCCL errors and timeouts (DistBackendError is one)
        raise m.failed(token, e) from e
    m.exit(token)
    return out


class _Watched:
    """Handle of an asynchronous collective whose wait() the monitor sees (time blocked, failures)."""

    def __init__(self, work, name: str, group):
        self.work, self.name, self.group = work, name, group

    def wait(self) -> None:
        if self.work is not None:
            _blocking(self.name, self.group, self.work.wait)
            self.work = None


def _watch(work, name: str, group):
    return work if work is None or _monitor is None else _Watched(work, name, group)


def init_distributed(backend: str, timeout_minutes: float, device_id=None, store=None) -> None:
    """Initialise the default process group (torchrun's env:// variables). Under torchrun the
    store is this attempt's own (rendezvous.py), so a restarted worker never reads a dead
    worker's address; `store`: the in-process restart generation's (inprocess/worker.py).
    `timeout_minutes` bounds every collective of every group built later too (parallel_state
    passes it to new_group)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = store if store is not None else attempt_store(rank, timeout)
    try:
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device_id)
    except dist.DistNetworkError as e:
        # rank 0 hosts the env:// store on MASTER_PORT; a port some other process holds is the
        # user's to change, not a traceback
        if "EADDRINUSE" not in str(e):
            raise
        raise UserError(f"MASTER_PORT {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} is "
                        "in use by another process: pick a free port (torchrun --master-port, or "
                        "--rdzv-endpoint host:port)") from None


def init_fake_process_group(rank: int, world_size: int) -> None:
    """--fake-process-group: this process is `rank` of `world_size` in torch's "fake" backend,
    where every collective completes at once and communicates nothing (dry runs of large layouts)."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the backend
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


class OfflineGroup:
    """A group's size and this rank's place in it, with no processes behind it: lets one
    process build the shard shapes of any rank offline (checkpoint conversion)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def group_size(group) -> int:
    if isinstance(group, OfflineGroup):
        return group.size
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if isinstance(group, OfflineGroup):
        return group.rank
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@functools.cache
def gloo_has_tensor_collectives() -> bool:
    """True when this torch's gloo backend implements the flat reduce-scatter and all-gather.
    Asked once per process of a one-rank gloo group built on a private store: an unsupported
    operation raises there at once, without peers that could hang."""
    try:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
        x = torch.ones(2)
        pg._reduce_scatter_base(torch.empty(2), x).wait()
        pg._allgather_base(torch.empty(2), x).wait()
        return True
    except Exception:  # noqa: BLE001 - "does not support", or no gloo device here: emulate
        return False


def native_tensor_collectives(group) -> bool:
    """Whether `group` runs reduce-scatter and all-gather natively (NCCL, and gloo on torch that
    has them) rather than through the gloo emulation below."""
    return dist.get_backend(group) != "gloo" or gloo_has_tensor_collectives()


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; returns `tensor` for chaining."""
    if group_size(group) > 1:
        _blocking("all_reduce", group, dist.all_reduce, tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (rank order)."""
    n = group_size(group)
    if n == 1:
        return tensor
    tensor = tensor.contiguous()
    if not native_tensor_collectives(group):
        parts = [torch.empty_like(tensor) for _ in range(n)]
        _blocking("all_gather", group, dist.all_gather, parts, tensor, group=group)
        return torch.cat(parts, dim=dim)
    # ranks' blocks end to end along dim 0 (the output shape gloo and NCCL both accept)
    out = torch.empty((n * tensor.size(0),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _blocking("all_gather", group, _all_gather_into_tensor, out, tensor, group=group)
    if dim % tensor.dim() == 0:
        return out
    return torch.cat(out.view((n,) + tuple(tensor.shape)).unbind(0), dim=dim)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this rank's 1/n chunk along `dim`."""
    n = group_size(group)
    if n == 1:
        return tensor
    if tensor.size(dim) % n:
        raise ValueError(f"reduce_scatter: size {tensor.size(dim)} along dim {dim} not divisible by {n}")
    if not native_tensor_collectives(group):
        # all-reduce and keep our chunk (same result, twice the traffic)
        full = tensor.clone()
        _blocking("reduce_scatter (all_reduce on gloo)", group, dist.all_reduce, full, group=group)
        return full.chunk(n, dim=dim)[group_rank(group)].contiguous()
    if dim != 0:
        tensor = tensor.movedim(dim, 0)
    tensor = tensor.contiguous()
    out = torch.empty((tensor.size(0) // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _blocking("reduce_scatter", group, _reduce_scatter_tensor, out, tensor, group=group)
    return out.movedim(0, dim) if dim != 0 else out


def all_to_all(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows [sum(input_splits[:j]), +input_splits[j]) of `tensor` go to group rank j; rank j's
    rows for this rank arrive in block j of the result (uneven splits: MoE token dispatch)."""
    if group_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    _blocking("all_to_all", group, dist.all_to_all_single, out, tensor, output_split_sizes=list(output_splits),
              input_split_sizes=list(input_splits), group=group)
    return out


def flat_by_all_reduce(group) -> bool:
    """Whether the flat reduce-scatter and all-gather of ZeRO's buckets run as in-place
    all-reduces on `group`: on gloo. Its reduce-scatter and all-gather (flat or list form, sync
    or async) copy through a temporary as large as the whole buffer (+188 MiB RSS for a
    32000 x 1536 fp32 embedding's bucket), while its all-reduce works in place, and is faster
    too: 155 ms against 237 (reduce-scatter) and 173 (all-gather) for 40 MB over 8 ranks on 2
    cores (benchmarks/RESULTS_zero.md, "The memory wall"). Old torch's gloo has no flat
    collectives at all (native_tensor_collectives)."""
    return dist.get_backend(group) == "gloo" or not native_tensor_collectives(group)


def reduce_scatter_flat(full: torch.Tensor, out: torch.Tensor, group, async_op: bool = False):
    """Flat reduce-scatter of `full` (numel = n * out.numel()) into `out`; `out` may be this
    rank's chunk of `full` (in place). Only `out` is defined afterwards: the rest of `full` keeps
    this rank's unreduced values (native) or holds the full sum (gloo: an all-reduce of `full` in
    place, flat_by_all_reduce). With async_op, returns a handle whose wait() completes the
    operation; otherwise None."""
    n = group_size(group)
    if n == 1:
        out.copy_(full)
        return None
    if flat_by_all_reduce(group):
        rank = group_rank(group)
        name = "reduce_scatter (all_reduce on gloo)"
        if async_op:
            work = _watch(dist.all_reduce(full, group=group, async_op=True), name, group)
        else:
            work = _blocking(name, group, dist.all_reduce, full, group=group)
        pending = _Pending(work, lambda: out.copy_(full.view(n, -1)[rank]))
        return pending if async_op else pending.wait()
    if async_op:
        return _watch(_reduce_scatter_tensor(out, full, group=group, async_op=True), "reduce_scatter", group)
    return _blocking("reduce_scatter", group, _reduce_scatter_tensor, out, full, group=group)


def all_gather_flat(shard: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """Flat all-gather of every rank's `shard` into `full` (numel = n * shard.numel()); `shard`
    may be this rank's chunk of `full` (in place). With async_op, returns a handle to wait() on.
    On gloo an all-reduce of `full` holding this rank's block and zeros elsewhere (exact: every
    element is one value plus zeros; flat_by_all_reduce)."""
    n = group_size(group)
    if n == 1:
        full.copy_(shard)
        return None
    if flat_by_all_reduce(group):
        blocks = full.view(n, -1)
        rank = group_rank(group)
        if shard.data_ptr() != blocks[rank].data_ptr():
            blocks[rank].copy_(shard)
        blocks[:rank].zero_()
        blocks[rank + 1:].zero_()
        fn, fn_args, name = dist.all_reduce, (full,), "all_gather (all_reduce on gloo)"
    else:
        fn, fn_args, name = _all_gather_into_tensor, (full, shard), "all_gather"
    if async_op:
        return _watch(fn(*fn_args, group=group, async_op=True), name, group)
    return _blocking(name, group, fn, *fn_args, group=group)


def all_reduce_async(tensor: torch.Tensor, group):
    """Start an in-place sum over the group; returns a handle to wait() on (None for size one)."""
    if group_size(group) == 1:
        return None
    return _watch(dist.all_reduce(tensor, group=group, async_op=True), "all_reduce", group)


class _Pending:
    """Handle of a collective emulated as another one plus a local step (old gloo's
    reduce-scatter: an all-reduce, then keep our chunk): wait() waits for the collective, then runs `finish`."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.finish()
            self.finish = None


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """`src` is a global rank, as torch.distributed expects."""
    if group_size(group) > 1:
        _blocking("broadcast", group, dist.broadcast, tensor, src=src, group=group)
    return tensor


def world_group():
    """The default group, or None (size one) when torch.distributed is not initialised."""
    return dist.group.WORLD if dist.is_initialized() else None


def all_gather_object(obj, group) -> list:
    if group_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    _blocking("all_gather_object", group, dist.all_gather_object, out, obj, group=group)
    return out


def gather_object(obj, dst: int, group) -> list | None:
    """Every rank's `obj` on global rank `dst` (a list in group order), None elsewhere."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    _blocking("gather_object", group, dist.gather_object, obj, out, dst=dst, group=group)
    return out


def barrier(group=None) -> None:
    if dist.is_initialized():
        _blocking("barrier", group if group is not None else dist.group.WORLD, dist.barrier, group=group)


def exchange(ops: list) -> None:
    """Post point-to-point sends and receives (dist.P2POp) as one batch and wait for all of them."""
    # the fake backend (--fake-process-group) sends nothing, and knows no meta device (--dry-run)
    if ops and dist.get_backend() != "fake":
        works = dist.batch_isend_irecv(ops)
        peers = sorted({op.peer for op in ops})
        _blocking(f"send/recv with rank(s) {peers}", None, lambda: [w.wait() for w in works])


def isend(tensor: torch.Tensor, dst: int, tag: int):
    """Start sending `tensor` to global rank `dst` under `tag` (a stream of messages matched in
    order); returns the work, or None on the fake backend. `tensor` must stay unchanged until
    the work completes."""
    if dist.get_backend() == "fake":
        return None
    return dist.isend(tensor, dst, tag=tag)


def recv(tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    """Receive into `tensor` from global rank `src` the next message under `tag`, blocking."""
    if dist.get_backend() != "fake":
        _blocking(f"recv from rank {src}", None, dist.recv, tensor, src, tag=tag)
    return tensor


class _Works:
    """The handles of one batch of sends and receives, waited for together under the monitor."""

    def __init__(self, works, name: str):
        self.works, self.name = works, name

    def wait(self) -> None:
        if self.works:
            works, self.works = self.works, []
            _blocking(self.name, None, lambda: [w.wait() for w in works])


def exchange_async(ops: list) -> _Works:
    """As `exchange`, returning at once: wait() on the result completes every send and receive
    (ring attention posts the next block's transfer, then computes on the block it holds)."""
    if not ops or dist.get_backend() == "fake":
        return _Works([], "")
    return _Works(dist.batch_isend_irecv(ops), f"send/recv with rank(s) {sorted({op.peer for op in ops})}")

