"""Y = X·Wᵀ + b with FP8 GEMMs (--fp8-format): the linear layers' product when their module has
an FP8 site (megalite/fp8/site.py, attached by model/fp8.py).

Forward casts X and W and multiplies them; backward casts dY and computes dX = dY·W and
dW = dYᵀ·X from the casts (fp8/recipe.py). Saved for backward are the FP8 cast of X (1 byte an
element where the bf16 path keeps 2; the unscaled X where the weight gradient needs it:
--no-fp8-wgrad, block scaling's token tiles) and W by reference, cast again in backward with the
forward's scale (ZeRO-3 frees W between the two and gathers it again).

Under sequence parallelism X arrives as this rank's [s/tp, b, h]: a per-tensor cast scales it
with the amax of the whole [s, b, h] (MAX over TP) and the FP8 values are all-gathered (half the
bf16 gather's bytes, Transformer Engine's FP8 all-gather); backward gathers them again for dW and
reduce-scatters dX, as tensor_parallel.mappings._LinearWithSPGather does in 16 bits. With a
WgradStore (--delay-wgrad-compute) dW waits for the schedule's W pass (tensor_parallel/wgrad.py)."""
from __future__ import annotations

import torch

from .. import comm
from ..fp8.operand import Operand, cast
from ..fp8.recipe import Role
from .wgrad import _anchor, deferrable, defer_or_fail


def _gather(op: Operand, group) -> Operand:
    """All-gather an operand's FP8 rows (as bytes) along dim 0; its scale is one for the tensor."""
    data = comm.all_gather(op.data.view(torch.uint8), group, dim=0).view(op.data.dtype)
    return Operand(data, op.scale, op.role, op.orig_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, site, sp_group, store, params, anchor):
        lead, x2 = x.shape[:-1], x.reshape(-1, x.size(-1))
        recipe = site.recipe
        gather = sp_group is not None and comm.group_size(sp_group) > 1
        per_tensor = not recipe.blockwise
        keep_unscaled = recipe.blockwise or not recipe.wgrad
        if gather and per_tensor:
            xq_local = site.quantize_input(x2, (sp_group,))
            xq = _gather(xq_local, sp_group)
        else:
            xq = xq_local = site.quantize_input(comm.all_gather(x2, sp_group, dim=0) if gather else x2)
        wq = site.quantize_weight(weight)
        y = site.gemm(xq, wq.t())
        if bias is not None:
            y = y + bias
        kept = xq_local if per_tensor and recipe.wgrad else None
        # W is cast again in backward: with the forward's scale (per tensor), or its tiles again
        ctx.save_for_backward(x2 if keep_unscaled else None, weight, None if kept is None else kept.data,
                              None if kept is None else kept.scale, wq.scale if per_tensor else None)
        ctx.site, ctx.sp_group, ctx.gather, ctx.has_bias = site, sp_group, gather, bias is not None
        ctx.store, ctx.params, ctx.x_shape = store, params, x.shape
        if gather:  # [s/tp, b, ...] in, [s, b, ...] out
            lead = (lead[0] * comm.group_size(sp_group), *lead[1:])
        return y.view(*lead, y.size(-1))

    @staticmethod
    def backward(ctx, dy):
        x2, weight, xq_data, xq_scale, w_scale = ctx.saved_tensors
        site, group, gather = ctx.site, ctx.sp_group, ctx.gather
        recipe = site.recipe
        dy2 = dy.reshape(-1, dy.size(-1))
        dyq = site.quantize_grad(dy2)
        dx = None
        if ctx.needs_input_grad[0]:
            wq = (site.quantize_weight(weight) if recipe.blockwise
                  else cast(weight, w_scale, recipe.dtype(Role.WEIGHT), Role.WEIGHT))
            dx = site.gemm(dyq, wq)
            if gather:
                dx = comm.reduce_scatter(dx, group, dim=0)
            dx = dx.view(ctx.x_shape)
        has_bias, wdtype = ctx.has_bias, weight.dtype

        def wgrad():
            db = dy2.sum(0) if has_bias else None
            if not recipe.wgrad:
                x = comm.all_gather(x2, group, dim=0) if gather else x2
                return dy2.t().mm(x).to(wdtype), db
            xq = None
            if xq_data is not None:
                xq = Operand(xq_data, xq_scale, Role.INPUT, dy2.dtype)
                xq = _gather(xq, group) if gather else xq
            x = (comm.all_gather(x2, group, dim=0) if gather else x2) if x2 is not None else None
            a, b = site.wgrad_operands(x, xq, dy2, dyq)
            return site.gemm(a, b).to(wdtype), db
        if ctx.store is None:
            return (dx, *wgrad(), None, None, None, None, None)
        params = ctx.params
        defer_or_fail(ctx.store, lambda: [(p, g) for p, g in zip(params, wgrad()) if p is not None])
        return dx, None, None, None, None, None, None, None


# --compile: Dynamo cannot trace the site's state (amax history, scale reductions over TP) nor
# torchao's FP8 tensor subclass built inside an autograd.Function, so the FP8 product runs eagerly
# between the compiled parts of a layer (a graph break on each side, as the TP collectives make)
@torch.compiler.disable
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias, site, sp_group=None, store=None) -> torch.Tensor:
    """X·Wᵀ + b through `site`'s FP8 casts; `sp_group`: X is sequence-sharded over it and gathered
    here; `store`: --delay-wgrad-compute's WgradStore."""
    if not deferrable(store, weight, bias):
        return _FP8Linear.apply(x, weight, bias, site, sp_group, None, None, None)
    return _FP8Linear.apply(x, weight.detach(), None if bias is None else bias.detach(), site, sp_group, store,
                            (weight, bias), _anchor(x))


__all__ = ["fp8_linear"]
