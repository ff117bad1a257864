"""Optimizer over fp32 master weights (sharded over DP with ZeRO-1), loss scaling, learning-rate
schedule, global gradient clipping."""
from .clip_grads import clip_by_norm, clip_grad_norm, global_grad_norm, is_counted, local_grad_stats
from .distributed_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from .lr_scheduler import LRScheduler, build_lr_scheduler
from .optimizer import MixedPrecisionOptimizer, build_inner_optimizer, build_optimizer

__all__ = ["clip_by_norm", "clip_grad_norm", "global_grad_norm", "is_counted", "local_grad_stats",
           "DistributedOptimizer", "ConstantGradScaler", "DynamicGradScaler", "build_grad_scaler", "LRScheduler",
           "build_lr_scheduler", "MixedPrecisionOptimizer", "build_inner_optimizer", "build_optimizer"]
