"""Learning-rate schedule, as Megatron-LM's OptimizerParamScheduler.

The schedule counts *samples*, as Megatron-LM's does: each optimizer step advances it by the
iteration's global batch size, so it stays exact when the global batch ramps up
(`--rampup-batch-size`, `--step-batch-size-schedule`). Iteration-based flags are converted to
samples at the constant global batch G (`--lr-decay-iters` N -> N·G samples,
`--lr-warmup-fraction` f -> f·N·G, which may end inside an iteration, as in Megatron-LM).

Linear warmup from --lr-warmup-init to the peak, then decay to the minimum: constant, linear,
cosine (Loshchilov & Hutter 2017), or WSD (warmup-stable-decay: flat until the last
--lr-wsd-decay-samples/-iters, then decay). `get_lr(max_lr, min_lr)` takes another peak and
minimum for parameter groups with their own (--decoupled-lr / --decoupled-min-lr); the warmup
starts from --lr-warmup-init for every group, as in Megatron-LM.
"""
from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: float,
                 decay_style: str = "linear", warmup_init: float = 0.0, wsd_decay_steps: float | None = None,
                 wsd_decay_style: str = "exponential", unit: str = "samples", legacy_steps_per_iteration: int = 1):
        """Steps are samples (or iterations, `unit="iterations"`, when built by hand).
        `legacy_steps_per_iteration`: converts the iteration count of a checkpoint written before
        the schedule counted samples."""
        self.max_lr, self.min_lr, self.warmup_init = max_lr, min_lr, warmup_init
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.unit, self.legacy_steps_per_iteration = unit, legacy_steps_per_iteration
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

    def get_lr(self, step: float | None = None, max_lr: float | None = None, min_lr: float | None = None) -> float:
        step = self.num_steps if step is None else step
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.warmup_init + (max_lr - self.warmup_init) * step / self.warmup_steps
        if self.decay_style == "constant":
            return max_lr
        if step > self.decay_steps:
            return min_lr
        if self.decay_style == "WSD":
            decay_start = self.decay_steps - self.wsd_decay_steps
            if step <= decay_start:
                return max_lr
            coeff = self._anneal(self.wsd_decay_style, (step - decay_start) / self.wsd_decay_steps)
        else:
            span = self.decay_steps - self.warmup_steps
            coeff = self._anneal(self.decay_style, (step - self.warmup_steps) / span if span > 0 else 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> None:
        """After an optimizer step: advance by its global batch (samples), or 1 (iterations)."""
        self.num_steps += increment

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": self.unit}

    def load_state_dict(self, state: dict) -> None:
        steps = state["num_steps"]
        unit = state.get("unit", "iterations")  # checkpoints before sample counting stored iterations
        if unit == "iterations" and self.unit == "samples":
            steps *= self.legacy_steps_per_iteration
        elif unit != self.unit:
            raise ValueError(f"learning-rate schedule state counts {unit}, this schedule counts {self.unit}")
        self.num_steps = steps


def build_lr_scheduler(c) -> LRScheduler:
    """From an OptimizerConfig: in samples when validate_args has filled the *_samples fields
    (every run of pretrain_gpt.py), else in iterations (configs built by hand)."""
    if c.lr_decay_samples is not None:
        return LRScheduler(c.lr, c.min_lr, c.lr_warmup_samples, c.lr_decay_samples, c.lr_decay_style,
                           c.lr_warmup_init, c.lr_wsd_decay_samples, c.lr_wsd_decay_style, unit="samples",
                           legacy_steps_per_iteration=c.global_batch_size)
    return LRScheduler(c.lr, c.min_lr, c.lr_warmup_iters, c.lr_decay_iters, c.lr_decay_style,
                       c.lr_warmup_init, c.lr_wsd_decay_iters, c.lr_wsd_decay_style, unit="iterations")
