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

Gathered: at most the chunk's own unit plus two layers (the one in use and the next), the
"gathered working set" tools/plan.py reports. Activation recompute runs a unit's forward again
inside backward: its hooks then gather but neither free nor hook outputs (the backward frees).

Under pipeline parallelism a unit is used 2m times per step (m micro-batches); keeping its
parameters gathered from first use to the last backward would save 2(m-1) gathers but hold the
whole stage's parameters through the step, the memory ZeRO-3 is for. Re-gathering won the
measurement (benchmarks/RESULTS_zero.md); `keep_gathered=True` is the alternative measured.
"""
from __future__ import annotations

import torch
from torch import nn

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


class Zero3Schedule:
    def __init__(self, model: list[nn.Module], params: ShardedParams, prefetch: bool, keep_gathered: bool,
                 num_microbatches: int):
        self.params, self.prefetch, self.keep_gathered = params, prefetch, keep_gathered
        self.num_microbatches = num_microbatches
        layout = params.layout
        owner = unit_of_params(model)
        self.order: list[list[list[int]]] = []  # per chunk: buckets of each unit in forward order
        for chunk in model:
            units = []
            for i, unit in enumerate(unit_modules(chunk)):
                buckets = sorted({layout.param_bucket[p] for p in unit.parameters() if owner.get(p) is unit})
                if buckets or i == 0:
                    units.append(buckets)
                    pos = (len(self.order), len(units) - 1)
                    unit.register_forward_pre_hook(self._pre_forward(pos))
                    unit.register_forward_hook(self._post_forward(pos))
            self.order.append(units)

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
            if 1 <= nxt < n and nxt != i:
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
            if training and isinstance(output, torch.Tensor) and output.requires_grad:
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
