"""Optimizer over fp32 master weights, learning-rate schedule, global gradient clipping."""
from .clip_grads import clip_grad_norm, global_grad_norm, is_counted
from .lr_scheduler import LRScheduler, build_lr_scheduler
from .optimizer import MixedPrecisionOptimizer

__all__ = ["clip_grad_norm", "global_grad_norm", "is_counted", "LRScheduler", "build_lr_scheduler",
           "MixedPrecisionOptimizer"]
