"""When ZeRO-3 gathers and frees parameters: per unit, just before use, with the next prefetched.

A *unit* is a module whose parameters are gathered together (Megatron-FSDP's FSDP unit): every
transformer layer and the embedding (`GPTModel.sharding_units`), and the model chunk itself for
the rest (final norm, output layer, and the word embedding when it is also this chunk's output
layer). Per micro-batch:

  forward   unit pre-hook: wait for its buckets (gather now if nobody prefetched them), start
            the gather of the next unit; post-hook: free them, and hook the output tensor so
            that backward re-gathers them;
  backward  output-tensor hook (runs before the unit's own backward): wait for its buckets,
            start the gather of the unit before it; a bucket is freed as soon as every one of
            its parameters has accumulated its gradient (ShardedGradBuffer's round callback).

A unit whose backward needs no parameters (the embedding: a lookup's gradient needs only the
token ids) is not gathered again for backward, nor prefetched for it. When the word embedding is
also the chunk's output layer (one pipeline stage, tied), the output projection gathers it for
itself and frees it at once, in forward and again in backward (`TiedOutputGather`), and hands
its weight gradient to the gradient buffer there (reduced at once, not held by autograd until
the lookup's gradient arrives at the end of backward): otherwise the vocabulary-sized table
stays gathered through every layer, and its output-layer gradient through the whole backward.

Gathered: at most the chunk's own unit plus two layers (the one in use and the next), or the
embedding and one layer, the "gathered working set" tools/plan.py reports. Activation recompute runs a unit's forward again
inside backward: its hooks then gather but neither free nor hook outputs (the backward frees).

Under pipeline parallelism a unit is used 2m times per step (m micro-batches); keeping its
parameters gathered from first use to the last backward would save 2(m-1) gathers but hold the
whole stage's parameters through the step, the memory ZeRO-3 is for. Re-gathering won the
measurement (benchmarks/RESULTS_zero.md); `keep_gathered=True` is the alternative measured.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .param_buffer import ShardedParams


def in_backward() -> bool:
    """True inside an autograd backward pass (a recompute's forward runs there)."""
    return torch._C._current_graph_task_id() != -1


def unit_modules(chunk: nn.Module) -> list[nn.Module]:
    """The chunk, then its own units in forward order (a model without `sharding_units` is one unit)."""
    units = getattr(chunk, "sharding_units", None)
    return [chunk] + (list(units()) if units is not None else [])


def unit_of_params(model: list[nn.Module]) -> dict:
    """param -> the innermost unit module holding it."""
    owner = {}
    for chunk in model:
        for unit in unit_modules(chunk):  # the chunk first: inner units overwrite it
            for p in unit.parameters():
                owner[p] = unit
    return owner


def backward_needs_params(unit: nn.Module) -> bool:
    """False for modules whose backward reads no parameter (`backward_needs_params = False`)."""
    return getattr(unit, "backward_needs_params", True)


class Zero3Schedule:
    def __init__(self, model: list[nn.Module], params: ShardedParams, prefetch: bool, keep_gathered: bool,
                 num_microbatches: int, grads=None, tied_output: bool = True):
        self.params, self.prefetch, self.keep_gathered = params, prefetch, keep_gathered
        self.num_microbatches = num_microbatches
        layout = params.layout
        owner = unit_of_params(model)
        self.order: list[list[list[int]]] = []  # per chunk: buckets of each unit in forward order
        self.grad_only: set = set()  # units whose backward needs no parameters
        self.hooks: list = []  # removed by DataParallel.close
        for chunk in model:
            units = []
            for i, unit in enumerate(unit_modules(chunk)):
                # (under expert parallelism a unit's expert weights belong to another schedule)
                buckets = sorted({layout.param_bucket[p] for p in unit.parameters()
                                  if owner.get(p) is unit and p in layout.param_bucket})
                if buckets or i == 0:
                    units.append(buckets)
                    pos = (len(self.order), len(units) - 1)
                    if i > 0 and not backward_needs_params(unit):
                        self.grad_only.add(pos)
                    self.hooks += [unit.register_forward_pre_hook(self._pre_forward(pos)),
                                   unit.register_forward_hook(self._post_forward(pos))]
            self.order.append(units)
            tied = getattr(chunk, "output_weight_is_tied_here", None)
            if tied_output and tied is not None and tied():
                chunk.output_weight_gather = TiedOutputGather(chunk.output_weight(), self, grads)

    # -- hooks -----------------------------------------------------------------------------------
    def _buckets(self, pos) -> list[int]:
        c, i = pos
        return self.order[c][i] if 0 <= i < len(self.order[c]) else []

    def _use(self, pos, forward: bool) -> None:
        """Make unit `pos` gathered; prefetch the unit that runs after it. Forward runs the
        chunk's own unit 0, then 1, 2, ...; backward runs unit 0, then the last, ..., 1."""
        for b in self._buckets(pos):
            self.params.gather(b)  # waits for a prefetch, or gathers now
        if self.prefetch:
            c, i = pos
            n = len(self.order[c])
            nxt = i + 1 if forward else (n - 1 if i == 0 else i - 1)
            if 1 <= nxt < n and nxt != i and (forward or (c, nxt) not in self.grad_only):
                for b in self._buckets((c, nxt)):
                    self.params.gather(b, async_op=True)

    def _pre_forward(self, pos):
        def hook(module, inputs):
            if in_backward():  # a recompute: gather this unit only (the next ran its backward already)
                for b in self._buckets(pos):
                    self.params.gather(b)
                return
            self._use(pos, forward=True)
        return hook

    def _post_forward(self, pos):
        def hook(module, inputs, output):
            if in_backward():  # a recompute: backward frees, as gradients arrive
                return
            training = torch.is_grad_enabled()
            if not (training and self.keep_gathered):
                for b in self._buckets(pos):
                    self.params.free(b)
            if (training and isinstance(output, torch.Tensor) and output.requires_grad
                    and pos not in self.grad_only):
                output.register_hook(self._pre_backward(pos))
        return hook

    def _pre_backward(self, pos):
        def hook(grad):
            self._use(pos, forward=False)
        return hook

    def on_round_complete(self, b: int, c: int) -> None:
        """Every parameter of bucket b has its gradient of micro-batch round c."""
        if not self.keep_gathered or c == self.num_microbatches:
            self.params.free(b)


class TiedOutputGather:
    """The output projection Y = X·Eᵀ of a chunk whose output layer is its word embedding E,
    under ZeRO-3: E (a unit of its own, the embedding's) is gathered for the product and freed
    right after, in forward and again in backward, and its weight gradient goes to the gradient
    buffer as soon as it is computed (`ShardedGradBuffer.add_partial`), so that neither the
    gathered E nor its [V, h] output-layer gradient is held across the layers (module docstring)."""

    def __init__(self, weight: nn.Parameter, schedule: Zero3Schedule, grads):
        self.weight, self.schedule, self.grads = weight, schedule, grads
        layout = schedule.params.layout
        self.buckets = [layout.param_bucket[weight]]

    def acquire(self) -> None:
        for b in self.buckets:
            self.schedule.params.gather(b)

    def release(self) -> None:
        if not self.schedule.keep_gathered:
            for b in self.buckets:
                self.schedule.params.free(b)

    def linear(self, x: torch.Tensor, sp_group=None) -> torch.Tensor:
        """x: [s, b, h] ([s/tp, b, h] under sequence parallelism, gathered here) -> x·Eᵀ [s, b, v/tp]."""
        return _GatheredWeightLinear.apply(x, self, sp_group)


class _GatheredWeightLinear(torch.autograd.Function):
    """Y = X·Wᵀ for a weight gathered only while the product runs. W is not saved for backward
    (its storage is freed in between) nor an input of the function: its gradient goes to the
    gradient buffer, not to autograd, so the other use of the tied weight (the embedding lookup)
    is the only one autograd accumulates. Under sequence parallelism X is all-gathered in forward and again in
    backward, as in tensor_parallel.mappings._LinearWithSPGather."""

    @staticmethod
    def forward(ctx, x, owner, sp_group):
        ctx.save_for_backward(x)
        ctx.owner, ctx.sp_group = owner, sp_group
        total = comm.all_gather(x, sp_group, dim=0) if sp_group is not None else x
        owner.acquire()
        try:
            return torch.nn.functional.linear(total, owner.weight)
        finally:
            owner.release()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        owner, group = ctx.owner, ctx.sp_group
        owner.acquire()
        grad_x = grad.matmul(owner.weight)  # [s, b, h]
        owner.release()
        total = x
        if group is not None:
            grad_x = comm.reduce_scatter(grad_x, group, dim=0)
            total = comm.all_gather(x, group, dim=0)
        grad_2d = grad.reshape(-1, grad.size(-1))  # [s·b, v/tp]
        owner.grads.add_partial(owner.weight, grad_2d.t().matmul(total.reshape(-1, total.size(-1))))
        return grad_x, None, None
