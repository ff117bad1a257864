"""Loss scaling for fp16 (Micikevicius et al. 2018, Sec. 3.2), as Megatron-LM's grad scalers.

The loss is multiplied by `scale` before backward so that small gradients survive fp16's range,
and the gradients are divided by it before the update. A step whose gradients hold an inf or a
nan (checked on every rank, see MixedPrecisionOptimizer.step) is skipped and reported to
`update`, which may lower the scale.

Dynamic scaling: every overflow costs one unit of hysteresis; when the hysteresis is used up the
scale is multiplied by `backoff_factor` (not below `min_scale`). After `growth_interval`
consecutive steps without overflow the scale is multiplied by `growth_factor` and the hysteresis
is restored.
"""
from __future__ import annotations


class ConstantGradScaler:
    """--loss-scale S: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def describe(self) -> str:
        return f"static loss scale {self.scale:g}"

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval > 0 and hysteresis > 0):
            raise ValueError("invalid dynamic loss scaler settings")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def describe(self) -> str:
        return (f"dynamic loss scale from {self.scale:g} (min {self.min_scale:g}, window {self.growth_interval}, "
                f"hysteresis {self.hysteresis})")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(c):
    """From an OptimizerConfig; None without loss scaling (fp32, and bf16 unless --loss-scale)."""
    if c.loss_scale:
        return ConstantGradScaler(c.loss_scale)
    if c.fp16:
        return DynamicGradScaler(c.initial_loss_scale, c.min_loss_scale,
                                 growth_interval=c.loss_scale_window, hysteresis=c.hysteresis)
    return None
