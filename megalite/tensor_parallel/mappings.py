"""Autograd-aware collectives that enter and leave a tensor-parallel region.

Megatron-LM paper (Shoeybi et al. 2019, Sec. 3, Fig. 3): `f` is the identity forward and an
all-reduce backward; `g` is the all-reduce forward and identity backward. A column-parallel
linear starts with `f`, a row-parallel linear ends with `g`, so one transformer block costs two
all-reduces forward and two backward. The scatter/gather pairs split or join the last dimension.

The sequence-parallel variants (Korthikanti et al. 2022, Sec. 4.2.2) work on the first
dimension of [s, b, h] activations: `g` becomes a reduce-scatter along s and `f` an all-gather.
"""
from __future__ import annotations

import torch

from .. import comm
from . import grad_fusion
from .wgrad import defer_or_fail, deferrable, linear as wgrad_linear


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[comm.group_rank(group)].contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.size(0) % n:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {n}")
    # a chunk along the first dimension is already contiguous, so .contiguous() would return a
    # view that keeps the whole [s, b, h] storage alive for as long as the shard is saved for
    # backward (e.g. by the first layer norm): clone, as Megatron-LM does after this scatter
    return x.chunk(n, dim=0)[comm.group_rank(group)].clone()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Split [s, b, h] along s; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0), None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along s. Backward reduce-scatters when the consumer is a tensor-parallel
    region (its input gradient is a partial sum), else just splits."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return comm.all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return comm.reduce_scatter(grad, ctx.group, dim=0), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0), None


class _LinearWithSPGather(torch.autograd.Function):
    """Y = all_gather_s(X)·Wᵀ + b that keeps only this rank's X [s/tp, b, h] for backward and
    all-gathers it again there (Korthikanti et al. 2022, Sec. 4.2.2; Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication): the gathered [s, b, h] input of every
    column-parallel linear (QKV, fc1) would otherwise stay in memory until backward, tp times
    what sequence parallelism means to keep. Backward reduce-scatters the input gradient (a
    partial sum over the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store=None, params=None, sink=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.store, ctx.params = store, params
        ctx.sink, ctx.param = sink, weight  # --gradient-accumulation-fusion (grad_fusion.py)
        return torch.nn.functional.linear(comm.all_gather(x, group, dim=0), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = comm.all_gather(x, ctx.group, dim=0)  # [s, b, in]
        grad_x = comm.reduce_scatter(grad.matmul(weight), ctx.group, dim=0)
        has_bias = ctx.has_bias

        def wgrad():
            grad_2d = grad.reshape(-1, grad.size(-1))  # [s·b, out]
            grad_weight = grad_2d.t().matmul(total.reshape(-1, total.size(-1)))
            return grad_weight, (grad_2d.sum(0) if has_bias else None)
        if ctx.sink is not None:  # dW straight into the gradient buffer
            grad_2d = grad.reshape(-1, grad.size(-1))
            ctx.sink.add_wgrad(ctx.param, grad_2d.t(), total.reshape(-1, total.size(-1)))
            return (grad_x, torch.empty_like(weight), grad_2d.sum(0) if has_bias else None, None, None, None, None)
        if ctx.store is None:
            return (grad_x, *wgrad(), None, None, None, None)
        # --delay-wgrad-compute: the gathered input stays until W (tensor_parallel/wgrad.py)
        params = ctx.params
        defer_or_fail(ctx.store, lambda: [(p, g) for p, g in zip(params, wgrad()) if p is not None])
        return grad_x, None, None, None, None, None, None


def linear_with_sp_gather(x, weight, bias, group, store=None):
    """F.linear(gather_from_sp(x), weight, bias) without keeping the gathered input for backward;
    with a WgradStore (--delay-wgrad-compute) the weight gradient waits for its W."""
    if comm.group_size(group) == 1:
        return wgrad_linear(x, weight, bias, store)
    if not deferrable(store, weight, bias):
        return _LinearWithSPGather.apply(x, weight, bias, group, None, None, grad_fusion.sink_of(weight))
    return _LinearWithSPGather.apply(x, weight.detach(), None if bias is None else bias.detach(), group, store,
                                     (weight, bias))


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group) if comm.group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_tp(x, group):
    return _ScatterToTP.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_tp(x, group):
    return _GatherFromTP.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_sp(x, group):
    return _ScatterToSP.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_sp(x, group, grad_is_partial: bool = True):
    return _GatherFromSP.apply(x, group, grad_is_partial) if comm.group_size(group) > 1 else x


def reduce_scatter_to_sp(x, group):
    return _ReduceScatterToSP.apply(x, group) if comm.group_size(group) > 1 else x
