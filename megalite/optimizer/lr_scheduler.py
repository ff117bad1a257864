"""Learning-rate schedule, as Megatron-LM's OptimizerParamScheduler (counted in iterations).

Linear warmup from --lr-warmup-init to --lr over --lr-warmup-iters, then decay to --min-lr by
--lr-decay-iters: constant, linear, cosine (Loshchilov & Hutter 2017), or WSD
(warmup-stable-decay: constant until the last --lr-wsd-decay-iters, then decay).
"""
from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 decay_style: str = "linear", warmup_init: float = 0.0, wsd_decay_iters: int | None = None,
                 wsd_decay_style: str = "exponential"):
        self.max_lr, self.min_lr, self.warmup_init = max_lr, min_lr, warmup_init
        self.warmup_iters, self.decay_iters, self.decay_style = warmup_iters, decay_iters, decay_style
        self.wsd_decay_iters, self.wsd_decay_style = wsd_decay_iters, wsd_decay_style
        self.num_steps = 0

    @staticmethod
    def _anneal(style: str, ratio: float) -> float:
        """Coefficient from 1 (ratio 0) down to 0 (ratio 1)."""
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return (2.0 * (0.5 ** ratio) - 1.0)
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"unknown decay style {style!r}")

    def get_lr(self, step: int | None = None) -> float:
        step = self.num_steps if step is None else step
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.max_lr - self.warmup_init) * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        if self.decay_style == "WSD":
            decay_start = self.decay_iters - self.wsd_decay_iters
            if step <= decay_start:
                return self.max_lr
            coeff = self._anneal(self.wsd_decay_style, (step - decay_start) / self.wsd_decay_iters)
        else:
            span = self.decay_iters - self.warmup_iters
            coeff = self._anneal(self.decay_style, (step - self.warmup_iters) / span if span > 0 else 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])


def build_lr_scheduler(c) -> LRScheduler:
    """From an OptimizerConfig."""
    return LRScheduler(c.lr, c.min_lr, c.lr_warmup_iters, c.lr_decay_iters, c.lr_decay_style,
                       c.lr_warmup_init, c.lr_wsd_decay_iters, c.lr_wsd_decay_style)
