"""Optimizer over fp32 master weights (sharded over DP under ZeRO-1/2/3, optionally offloaded to
host memory), loss scaling, learning-rate schedule, global gradient clipping; `build_optimizer`
picks the class for the flags."""
from .distributed_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from .lr_scheduler import LRScheduler, build_lr_scheduler
from .optimizer import MixedPrecisionOptimizer, build_inner_optimizer


def build_optimizer(named_params, config, dp, ps) -> MixedPrecisionOptimizer:
    """The optimizer for an OptimizerConfig over the data-parallel module `dp`: sharded over DP
    (ZeRO-1) when `dp` shards, else one replica per DP rank."""
    cls = DistributedOptimizer if dp.strategy.shards_optimizer else MixedPrecisionOptimizer
    return cls(named_params, config, dp, ps)


__all__ = ["DistributedOptimizer", "ConstantGradScaler", "DynamicGradScaler", "build_grad_scaler", "LRScheduler",
           "build_lr_scheduler", "MixedPrecisionOptimizer", "build_inner_optimizer", "build_optimizer"]
