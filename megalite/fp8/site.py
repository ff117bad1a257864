"""One FP8 GEMM site, Y = X·Wᵀ of one linear layer: how each of its three operands gets its scale.

Every layout must cast as the one process casts, so a scale is the one process's: the amax of
the whole tensor that rank-local pieces belong to. Pieces are spread over two kinds of group:

  tokens  the ranks holding the rest of the micro-batch's tokens: context parallelism, and the
          tensor-parallel group where a linear's input is sequence-sharded (SP);
  split   the tensor-parallel ranks holding the rest of a feature dimension: W's output rows and
          dY's columns of a column-parallel linear, W's and X's input columns of a row-parallel one.

so an operand's amax is reduced (MAX) over X: tokens + input split, W: both splits, dY: tokens +
output split; a group of one rank costs nothing. Data-parallel ranks hold other micro-batches,
whose tensors are other tensors in one process too: no reduction there.

Tensorwise scales come from the operand itself; delayed ones from its slot's history (fp8/
delayed.py; the first iteration, with none, scales tensorwise); blockwise ones per tile (fp8/blockwise.py) in the whole tensor's coordinates."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from . import blockwise
from .operand import Operand, amax_to_scale, cast, gemm
from .recipe import Role

_ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


def local_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as an fp32 scalar (0 for an empty tensor: an expert without tokens)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    # one reduction pass, where abs().amax() first writes |t| out whole
    return torch.linalg.vector_norm(t.detach(), float("inf")).float()


def reduce_max(t: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if group is not None:
            comm.all_reduce(t, group, op=torch.distributed.ReduceOp.MAX)
    return t


@dataclass
class Groups:
    """The ranks holding the rest of each dimension of this site's operands (None: none)."""
    tokens: tuple = ()  # context parallelism (and TP where the input is sequence-sharded)
    in_split: object = None  # the group splitting X's and W's input columns (row-parallel)
    out_split: object = None  # the group splitting W's rows and dY's columns (column-parallel)

    def of(self, role: Role) -> tuple:
        return {Role.INPUT: (*self.tokens, self.in_split), Role.WEIGHT: (self.in_split, self.out_split),
                Role.GRAD_OUTPUT: (*self.tokens, self.out_split)}[role]


class GemmSite:
    def __init__(self, context, groups: Groups, weight: torch.nn.Parameter, in_axis=None, out_axis=None,
                 name: str = ""):
        """`in_axis` / `out_axis` (blockwise): W's columns and rows in the whole tensor's
        coordinates (fp8/blockwise.Axis; None: whole here)."""
        self.context, self.recipe, self.groups, self.name = context, context.recipe, groups, name
        self.weight = weight
        self.in_axis = in_axis or blockwise.Axis(weight.shape[1])
        self.out_axis = out_axis or blockwise.Axis(weight.shape[0])
        self.slot = context.add_slots([self.recipe.dtype(r) for r in _ROLES]) if self.recipe.delayed else None
        self.mm_config = context.mm_config

    def weights(self) -> list:
        return [self.weight]

    # -- scales --------------------------------------------------------------------------------------
    def scale(self, t: torch.Tensor, role: Role, extra_groups=()) -> torch.Tensor:
        """The tensorwise (current or delayed) scale of operand `t`, a piece of the one process's
        tensor whose other pieces `extra_groups` hold beyond this site's groups."""
        dtype, ctx = self.recipe.dtype(role), self.context
        slot = None if self.slot is None else self.slot + _ROLES.index(role)
        if slot is not None and ctx.history.ready:
            if ctx.recording:
                ctx.history.record(slot, local_amax(t))
            return ctx.history.scales(slot).reshape(())
        amax = reduce_max(local_amax(t), (*self.groups.of(role), *extra_groups))
        if slot is not None and ctx.recording:
            ctx.history.record(slot, amax)
        return amax_to_scale(amax, dtype)

    # -- casts -------------------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor, extra_groups=()) -> Operand:
        """X [M, in] for the forward GEMM."""
        if self.recipe.blockwise:
            return blockwise.quantize(x, self.recipe.dtype(Role.INPUT), Role.INPUT, None, self.in_axis)
        return cast(x, self.scale(x, Role.INPUT, extra_groups), self.recipe.dtype(Role.INPUT), Role.INPUT)

    def quantize_weight(self, w: torch.Tensor) -> Operand:
        """W [out, in] for the forward and input-gradient GEMMs."""
        dtype = self.recipe.dtype(Role.WEIGHT)
        if self.recipe.blockwise:
            return blockwise.quantize(w, dtype, Role.WEIGHT, self.out_axis, self.in_axis)
        return cast(w, self.scale(w, Role.WEIGHT), dtype, Role.WEIGHT)

    def quantize_grad(self, dy: torch.Tensor) -> Operand:
        """dY [M, out] for the input-gradient GEMM (and, scaled per tensor, the weight gradient's)."""
        if self.recipe.blockwise:
            return blockwise.quantize(dy, self.recipe.dtype(Role.GRAD_OUTPUT), Role.GRAD_OUTPUT, None, self.out_axis)
        return cast(dy, self.scale(dy, Role.GRAD_OUTPUT), self.recipe.dtype(Role.GRAD_OUTPUT), Role.GRAD_OUTPUT)

    def wgrad_operands(self, x: torch.Tensor | None, xq: Operand | None, dy: torch.Tensor, dyq: Operand):
        """(dYᵀ [out, M], X [M, in]) as the weight-gradient GEMM's operands: per tensor the
        forward's and the input gradient's casts; blockwise 128x1 token tiles of both."""
        if not self.recipe.blockwise:
            return dyq.t(), xq
        tokens = blockwise.token_axis(dy.size(0))
        dy_t = blockwise.quantize(dy, self.recipe.dtype(Role.GRAD_OUTPUT), Role.GRAD_OUTPUT, tokens, None).t()
        return dy_t, blockwise.quantize(x, self.recipe.dtype(Role.INPUT), Role.INPUT, tokens, None)

    def gemm(self, a: Operand, b: Operand) -> torch.Tensor:
        return gemm(a, b, self.mm_config, self.recipe.emulate)


__all__ = ["GemmSite", "Groups", "local_amax", "reduce_max"]
