"""The routed experts' GEMMs in FP8 (--fp8-format): fc1 and fc2 of every local expert.

A per-tensor scale is the one process's: in one process the input of expert e in a micro-batch is
that micro-batch's tokens routed to e, one tensor. Under expert parallelism an expert's rows
arrive from several ranks, and ranks of other data-parallel indices hold other micro-batches, so
the rows of one GEMM belong to several such tensors. Each row is tagged with its micro-batch (the
data-parallel index of the rank it came from: `MoELayer.run_experts`), the amaxes are taken per
(micro-batch, local expert) segment, reduced (MAX) over the ranks that can hold rows of the same
segment (the expert-tensor-parallel group, whose ranks split an expert's features, and the
expert-data-parallel group, whose ranks hold the same experts and may receive other parts of the
same micro-batch, as under context parallelism), and every row is cast with its segment's scale:
one scale per row ([N, 1]), torch._scaled_mm's rowwise form against the expert's per-tensor weight
scale. The weight gradient reduces over rows of several segments, so its product is the
dequantized one (fp8/operand.py).

Delayed scaling keeps a slot per (projection, operand, global expert): all rows of an expert
share its history's scale. Block scaling casts rows in 1x128 tiles (a row's tiles are its own,
wherever it runs) and the weights in 128x128 blocks; the weight gradient's 128-token tiles are cut
in the order this rank holds the expert's rows (docs/fp8.md)."""
from __future__ import annotations

import torch

from ...fp8 import blockwise
from ...fp8.operand import Operand, amax_to_scale, cast, gemm
from ...fp8.recipe import Role
from ...fp8.site import local_amax, reduce_max

_ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)
PROJECTIONS = ("linear_fc1", "linear_fc2")


class ExpertsFP8:
    def __init__(self, context, experts, ps, axes: dict, name: str = ""):
        """`experts`: the LocalExperts; `axes`: per projection, its weights' (in, out) blockwise.Axis."""
        self.context, self.recipe, self.name = context, context.recipe, name
        self.experts, self.axes = experts, axes
        self.first, self.num_local, self.num_experts = experts.first, experts.num_local, experts.num_experts
        self.weight_group = experts.etp_group  # splits each expert's features
        self.replica_groups = (experts.etp_group, ps.expert_dp_group)  # may hold rows of the same segment
        ep_ranks = ps.ep_ranks if ps.ep_size > 1 else [ps.rank]
        self.dp_size = ps.dp_size
        self.source_dp = torch.tensor([ps.grid.coords(r)["dp"] for r in ep_ranks], dtype=torch.long)
        self.slots = {}
        if self.recipe.delayed:
            for proj in PROJECTIONS:
                self.slots[proj] = context.add_slots([self.recipe.dtype(r) for r in _ROLES for _ in
                                                      range(self.num_experts)])

    def weights(self) -> list:
        return [getattr(e, proj).weight for e in self.experts.local_experts.values() for proj in PROJECTIONS]

    def _slot(self, proj: str, role: Role) -> int | None:
        base = self.slots.get(proj)
        return None if base is None else base + _ROLES.index(role) * self.num_experts + self.first

    # -- casts ---------------------------------------------------------------------------------
    def quantize_rows(self, x: torch.Tensor, ids: torch.Tensor, tags: torch.Tensor, proj: str, role: Role) -> Operand:
        """x [N, C]: rows sorted by local expert (`ids`), each of micro-batch `tags`."""
        dtype = self.recipe.dtype(role)
        if self.recipe.blockwise:
            in_axis, out_axis = self.axes[proj]
            return blockwise.quantize(x, dtype, role, None, in_axis if role is Role.INPUT else out_axis)
        ctx, n = self.context, self.num_local
        row_amax = (x.detach().abs().amax(1).float() if x.numel() else
                    torch.zeros(x.size(0), dtype=torch.float32, device=x.device))
        slot = self._slot(proj, role)
        if slot is not None and ctx.history.ready:
            if ctx.recording:
                ctx.history.record(slot, _per_expert(row_amax, ids, n))
            return cast(x, ctx.history.scales(slot, n).index_select(0, ids).unsqueeze(1), dtype, role)
        segment = tags * n + ids
        table = torch.zeros(self.dp_size * n, dtype=torch.float32, device=x.device)
        table.scatter_reduce_(0, segment, row_amax, "amax", include_self=True)
        reduce_max(table, self.replica_groups)
        if slot is not None and ctx.recording:
            ctx.history.record(slot, table.view(self.dp_size, n).amax(0))
        return cast(x, amax_to_scale(table, dtype).index_select(0, segment).unsqueeze(1), dtype, role)

    def quantize_weights(self, weights: list, proj: str) -> list[Operand]:
        dtype = self.recipe.dtype(Role.WEIGHT)
        if self.recipe.blockwise:
            in_axis, out_axis = self.axes[proj]
            return [blockwise.quantize(w, dtype, Role.WEIGHT, out_axis, in_axis) for w in weights]
        return [cast(w, s, dtype, Role.WEIGHT) for w, s in zip(weights, self.weight_scales(weights, proj))]

    def weight_scales(self, weights: list, proj: str) -> list[torch.Tensor]:
        ctx, slot = self.context, self._slot(proj, Role.WEIGHT)
        amax = torch.stack([local_amax(w) for w in weights])
        if slot is not None and ctx.history.ready:
            if ctx.recording:
                ctx.history.record(slot, amax)
            return list(ctx.history.scales(slot, len(weights)).unbind(0))
        reduce_max(amax, (self.weight_group,))
        if slot is not None and ctx.recording:
            ctx.history.record(slot, amax)
        return list(amax_to_scale(amax, self.recipe.dtype(Role.WEIGHT)).unbind(0))

    def gemm(self, a: Operand, b: Operand) -> torch.Tensor:
        return gemm(a, b, self.context.mm_config, self.recipe.emulate)

    # -- the experts' MLPs -----------------------------------------------------------------------
    @torch.compiler.disable  # --compile: run eagerly, as fp8_linear (tensor_parallel/fp8_linear.py)
    def forward(self, x: torch.Tensor, counts: list[int], sources: torch.Tensor | None) -> torch.Tensor:
        """x [N, h] sorted by local expert (counts[i] rows of expert i), `sources` each row's EP
        rank (None: this one) -> [N, h], a partial sum over ETP (LocalExperts.forward)."""
        le = self.experts
        experts = list(le.local_experts.values())
        rows = torch.tensor(counts, device=x.device)
        ids = torch.repeat_interleave(torch.arange(len(counts), device=x.device), rows, output_size=x.size(0))
        tags = (self.source_dp.to(x.device).index_select(0, sources) if sources is not None else
                torch.full_like(ids, int(self.source_dp[0])))
        y = _ExpertsGEMM.apply(x, ids, tags, counts, self, "linear_fc1", *[e.linear_fc1.weight for e in experts])
        y = le._add_biases(y, [e.linear_fc1.bias for e in experts], counts)
        y = _ExpertsGEMM.apply(le._activation(y), ids, tags, counts, self, "linear_fc2",
                               *[e.linear_fc2.weight for e in experts])
        return le._add_biases(y, [e.linear_fc2.bias for e in experts], counts) if le.add_fc2_bias else y


def _per_expert(row_amax: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32, device=row_amax.device)
    return out.scatter_reduce_(0, ids, row_amax, "amax", include_self=True)


def _rows(op: Operand, a: int, b: int) -> Operand:
    scale = op.scale[a:b] if op.scale.dim() == 2 and op.scale.size(0) == op.data.size(0) else op.scale
    return Operand(op.data[a:b], scale, op.role, op.orig_dtype)


class _ExpertsGEMM(torch.autograd.Function):
    """Y_e = X_e·W_eᵀ for every local expert e: X [N, in] sorted by expert, W_e [out, in]."""

    @staticmethod
    def forward(ctx, x, ids, tags, counts, spec, proj, *weights):
        xq = spec.quantize_rows(x, ids, tags, proj, Role.INPUT)
        wq = spec.quantize_weights(weights, proj)
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        out = [spec.gemm(_rows(xq, a, b), w.t()) for a, b, w in zip(bounds, bounds[1:], wq)]
        y = torch.cat(out) if out else x.new_zeros(0, weights[0].size(0))
        keep_unscaled = spec.recipe.blockwise or not spec.recipe.wgrad
        ctx.save_for_backward(x if keep_unscaled else None, xq.data, xq.scale, ids, tags, *weights)
        ctx.spec, ctx.proj, ctx.bounds = spec, proj, bounds
        ctx.w_scales = None if spec.recipe.blockwise else [w.scale for w in wq]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, xq_data, xq_scale, ids, tags, *weights = ctx.saved_tensors
        spec, proj, bounds, recipe = ctx.spec, ctx.proj, ctx.bounds, ctx.spec.recipe
        dy = dy.contiguous()
        dyq = spec.quantize_rows(dy, ids, tags, proj, Role.GRAD_OUTPUT)
        dtype = recipe.dtype(Role.WEIGHT)
        wq = (spec.quantize_weights(weights, proj) if ctx.w_scales is None else
              [cast(w, s, dtype, Role.WEIGHT) for w, s in zip(weights, ctx.w_scales)])
        xq = Operand(xq_data, xq_scale, Role.INPUT, dy.dtype)
        dx, dws = [], []
        for (a, b), w, wop in zip(zip(bounds, bounds[1:]), weights, wq):
            dy_e = _rows(dyq, a, b)
            dx.append(spec.gemm(dy_e, wop))
            if not recipe.wgrad:
                dws.append(dy[a:b].t().mm(x[a:b]).to(w.dtype))
            elif recipe.blockwise:
                tokens = blockwise.token_axis(b - a)
                g = blockwise.quantize(dy[a:b], recipe.dtype(Role.GRAD_OUTPUT), Role.GRAD_OUTPUT, tokens, None)
                xe = blockwise.quantize(x[a:b], recipe.dtype(Role.INPUT), Role.INPUT, tokens, None)
                dws.append(spec.gemm(g.t(), xe).to(w.dtype))
            else:
                dws.append(spec.gemm(dy_e.t(), _rows(xq, a, b)).to(w.dtype))
        grad_x = torch.cat(dx) if dx else dy.new_zeros(0, weights[0].size(1))
        return (grad_x, None, None, None, None, None, *dws)


__all__ = ["ExpertsFP8", "PROJECTIONS"]
