"""What a data-parallel sharding strategy shards, by name (Megatron-LM's
--data-parallel-sharding-strategy; Rajbhandari et al. 2020's ZeRO stages 0-3).

DataParallel, the optimizer, checkpoints and tools/plan.py ask the record what is sharded
(`shards_optimizer`, `shards_grads`, `shards_params`) rather than compare names or stage
numbers; `zero_stage` is for display only. A new strategy is one entry in STRATEGIES plus its
implementation in DataParallel. No imports beyond the standard library: the configs (DDPConfig's
choices) and the tools read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class ShardingStrategy:
    name: str
    shards_optimizer: bool  # fp32 masters and optimizer state: a 1/d slice per DP rank
    shards_grads: bool  # only this rank's slice of the reduced gradient lives (reduce-scatter)
    shards_params: bool  # parameters stored as slices, gathered per unit for forward and backward
    zero_stage: int  # ZeRO-0..3, for messages and tables

    def describe(self) -> str:
        """`optim_grads (ZeRO-2)`; `no_shard` alone."""
        return f"{self.name} (ZeRO-{self.zero_stage})" if self.zero_stage else self.name


STRATEGIES = MappingProxyType({s.name: s for s in (
    ShardingStrategy("no_shard", False, False, False, 0),
    ShardingStrategy("optim", True, False, False, 1),  # = --use-distributed-optimizer
    ShardingStrategy("optim_grads", True, True, False, 2),
    ShardingStrategy("optim_grads_params", True, True, True, 3),
)})

NAMES = tuple(STRATEGIES)


def default_strategy_name(use_distributed_optimizer: bool) -> str:
    """The strategy when --data-parallel-sharding-strategy is not given (Megatron-LM's)."""
    return "optim" if use_distributed_optimizer else "no_shard"


def get_strategy(name: str) -> ShardingStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy must be one of {NAMES}, got {name!r}")
    return STRATEGIES[name]
