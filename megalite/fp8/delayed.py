"""Delayed scaling (--fp8-recipe delayed; Transformer Engine's DelayedScaling, Micikevicius et
al. 2022, Sec. 4.3): a tensor is cast with a scale computed from the amaxes it had in earlier
iterations, so the cast needs no pass over the tensor first and no collective.

Every FP8 operand of this rank's model chunks has a slot (the experts' slots are numbered by
global expert, so that every rank of a pipeline stage has the same table). During an iteration
each cast records its local amax in the slot's running maximum; `finish_iteration` (after the
last backward, before the optimizer step) takes the maximum over the stage's ranks (one MAX
all-reduce over TP, then DP x CP: the ranks that hold other pieces, tokens or experts of the same
tensors), appends it to the slot's history of `--fp8-amax-history-len` iterations, and sets the
scale the next iteration casts with:

    scale = max_fp8 / amax / 2^margin,   amax = max(history) (max) or its latest (most_recent)

kept unchanged where that amax is 0 (a tensor not met: an expert without tokens).

Two choices differ from Transformer Engine, both so that every parallel layout casts alike:
the history advances once per iteration over all its micro-batches and data-parallel ranks (TE
updates per forward, i.e. per micro-batch, and reduces over its amax group), and the first
iteration of a run, with no history yet, scales each tensor from its own amax (the tensorwise
recipe) where TE starts from scale 1 (whose casts flush most small gradients to zero). The history
is not checkpointed (checkpoints hold masters only): a resumed run starts it again."""
from __future__ import annotations

import torch

from .. import comm
from .recipe import fp8_max

EPS = 1e-12  # torchao's floor of an amax


class AmaxHistory:
    def __init__(self, history_len: int, algo: str, margin: int):
        self.history_len, self.algo, self.margin = history_len, algo, margin
        self.dtypes: list[torch.dtype] = []  # each slot's FP8 format
        self.amax = self.history = self.scale = None
        self.iterations = 0  # histories recorded: 0 until the first iteration ends
        self._filled = 0

    def add(self, dtypes: list[torch.dtype]) -> int:
        """Slots for operands of the given formats; returns the first one's index."""
        if self.amax is not None:
            raise RuntimeError("slots are added before the first cast")
        first = len(self.dtypes)
        self.dtypes += list(dtypes)
        return first

    def materialize(self, device) -> None:
        n = len(self.dtypes)
        self.amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.history = torch.zeros(self.history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self._max = torch.tensor([fp8_max(d) for d in self.dtypes], dtype=torch.float32, device=device)

    @property
    def ready(self) -> bool:
        """Whether scales come from a history (after the first iteration)."""
        return self.iterations > 0

    def record(self, slot: int, amax: torch.Tensor) -> None:
        """This iteration's running maximum of slot `slot` (amax: a scalar, or one per slot from
        `slot` on)."""
        n = amax.numel()
        view = self.amax[slot:slot + n]
        torch.maximum(view, amax.reshape(n).float(), out=view)

    def scales(self, slot: int, n: int = 1) -> torch.Tensor:
        return self.scale[slot:slot + n]

    def finish_iteration(self, groups) -> None:
        """Reduce this iteration's amaxes over `groups` (MAX), push them into the history and
        compute the next iteration's scales."""
        if self.amax is None or self.amax.numel() == 0:
            self.iterations += 1
            return
        for group in groups:
            comm.all_reduce(self.amax, group, op=torch.distributed.ReduceOp.MAX)
        self.history = torch.roll(self.history, 1, 0)
        self.history[0] = self.amax
        self._filled = min(self._filled + 1, self.history_len)
        amax = self.history[:self._filled].amax(0) if self.algo == "max" else self.history[0]
        # torchao's amax_to_scale, one format per slot: in fp64, amax floored at 1e-12
        fresh = (self._max.double() / amax.double().clamp(min=EPS)).float() / (2 ** self.margin)
        self.scale = torch.where((amax > 0) & torch.isfinite(amax), fresh, self.scale)
        self.amax.zero_()
        self.iterations += 1


__all__ = ["AmaxHistory"]
