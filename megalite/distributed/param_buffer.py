"""Parameter storage of the sharded strategies.

`FlatParamBuffer` (ZeRO-1 optim, ZeRO-2 optim_grads): every parameter stays whole on every DP
rank, as a view into one flat buffer with the gradient layout (buckets.py), so that after the
optimizer has written its slices a bucket is all-gathered in one collective.

`ShardedParams` (ZeRO-3 optim_grads_params; Rajbhandari et al. 2020, Sec. 5.3): a rank stores
only its 1/DP slice of every bucket, 2/DP bytes per bf16 parameter. Each bucket also has a
full-size tensor whose *storage* is allocated while the bucket is gathered and released
(resized to zero bytes) when it is freed; the parameters are permanent views into it, so a
parameter object never changes while its memory comes and goes (the technique of PyTorch's
FSDP1). Autograd saves parameters by reference: a backward that needs them finds them
re-gathered into the same storage. Parameters built on the `meta` device are materialised
straight into their slices, one at a time (`init_fn`), so no rank ever holds the whole model.
"""
from __future__ import annotations

import torch

from .. import comm
from .buckets import BucketLayout


def _dtype_of(params) -> torch.dtype:
    dtype = params[0].dtype
    for p in params:
        if p.dtype != dtype:
            raise ValueError(f"parameters of mixed dtypes ({dtype}, {p.dtype}) cannot share a buffer")
    return dtype


class FlatParamBuffer:
    """Whole parameters as views of one flat buffer (ZeRO-1/2)."""

    def __init__(self, layout: BucketLayout, dp_group):
        self.layout, self.dp_group = layout, dp_group
        params = layout.params
        self.data = torch.zeros(layout.numel, dtype=_dtype_of(params), device=params[0].device)
        for p in params:
            start, end = layout.param_index[p]
            view = self.data[start:end].view(p.shape)
            view.copy_(p.data)
            p.data = view

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def param_shard(self, b: int) -> torch.Tensor:
        s, e = self.layout.shard_range(b)
        return self.data[s:e]

    def all_gather(self, b: int, async_op: bool = False):
        """Every rank's slice of bucket b into everyone's copy of it."""
        start, end = self.layout.buckets[b]
        return comm.all_gather_flat(self.param_shard(b), self.data[start:end], self.dp_group, async_op=async_op)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


class ShardedParams:
    """This rank's slices of the parameters, and per-bucket gather / free (ZeRO-3)."""

    FREE, GATHERING, READY = 0, 1, 2

    def __init__(self, layout: BucketLayout, dp_group, device, init_fn=None):
        """`init_fn(p)`: the TP-local initial value of a parameter built on the meta device."""
        self.layout, self.dp_group = layout, dp_group
        params = layout.params
        dtype = _dtype_of(params)
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.full: list[torch.Tensor] = []
        self.state = [self.FREE] * len(layout.buckets)
        self._handles: list = [None] * len(layout.buckets)
        self.gathers = 0  # all-gathers issued, and the most bytes gathered at once (benchmarks, tests)
        self.peak_gathered_bytes = 0
        for b, (start, end) in enumerate(layout.buckets):
            full = torch.zeros(end - start, dtype=dtype, device=device)
            for p in layout.bucket_params[b]:
                lo, hi = layout.param_index[p]
                view = full[lo - start:hi - start]
                if p.device.type == "meta":
                    if init_fn is None:
                        raise ValueError("parameters on the meta device need an init_fn to be materialised")
                    view.copy_(init_fn(p).reshape(-1))
                    _swap_in(p, view.view(p.shape))
                else:
                    view.copy_(p.data.reshape(-1))
                    p.data = view.view(p.shape)
            s, e = layout.shard_range(b)
            self.param_shard(b).copy_(full[s - start:e - start])
            _free(full)
            self.full.append(full)

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def full_bytes(self, b: int) -> int:
        return self.full[b].numel() * self.full[b].element_size()

    def param_shard(self, b: int) -> torch.Tensor:
        o = self.layout.shard_offset(b)
        s, e = self.layout.shard_range(b)
        return self.shard[o:o + e - s]

    def gathered_bytes(self) -> int:
        return sum(self.full_bytes(b) for b, st in enumerate(self.state) if st != self.FREE)

    # -- gather / free ---------------------------------------------------------------------------
    def gather(self, b: int, async_op: bool = False) -> None:
        """Start (or, without async_op, complete) the all-gather of bucket b; a no-op if it is
        gathered or on its way."""
        if self.state[b] != self.FREE:
            if not async_op:
                self.wait(b)
            return
        _alloc(self.full[b])
        self.state[b] = self.GATHERING
        self.gathers += 1
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        self._handles[b] = comm.all_gather_flat(self.param_shard(b), self.full[b], self.dp_group, async_op=async_op)
        self.state[b] = self.GATHERING if async_op else self.READY

    def wait(self, b: int) -> None:
        if self.state[b] == self.GATHERING:
            if self._handles[b] is not None:
                self._handles[b].wait()
                self._handles[b] = None
            self.state[b] = self.READY

    def free(self, b: int) -> None:
        if self.state[b] == self.FREE:
            return
        self.wait(b)
        _free(self.full[b])
        self.state[b] = self.FREE

    def free_all(self) -> None:
        for b in range(len(self.full)):
            self.free(b)


def _swap_in(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Turn the meta-device parameter `p` into one whose data is `value`, keeping the Python
    object (modules, optimizer lists and ParamInfo all refer to it). `set_data` cannot cross
    from meta to a real device, so first swap in an empty tensor of the real device."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device),
                                                   requires_grad=p.requires_grad))
    p.__dict__.update(attrs)
    p.data = value
