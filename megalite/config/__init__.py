"""Typed configs, one small dataclass per subsystem; each field declares its Megatron-LM flag
(config/fields.py), so the configs are the single source of truth for the command line, for
validation (arguments/) and for what checkpoints record. The argparse Namespace stops in
arguments/: everything past it takes the config it needs. The model's architecture is
`model.GPTConfig`, a section like the others."""
from .data import DEFAULT_SPLIT, DataConfig, TokenizerConfig
from .fp8 import FP8Config
from .kernels import ATTENTION_BACKENDS, KernelConfig
from .megatron import MegatronCompatConfig
from .optimizer import OptimizerConfig
from .parallel import SHARDING_STRATEGIES, DDPConfig, ParallelConfig, RecomputeConfig
from .resilience import ResilienceConfig
from .run import CONFIG_VERSION, SECTIONS, RunConfig, from_saved
from .training import CheckpointConfig, TrackingConfig, TrainingConfig

__all__ = ["ATTENTION_BACKENDS", "CONFIG_VERSION", "DEFAULT_SPLIT", "SECTIONS", "SHARDING_STRATEGIES",
           "CheckpointConfig", "DDPConfig", "DataConfig", "FP8Config", "KernelConfig", "MegatronCompatConfig",
           "OptimizerConfig", "ParallelConfig", "RecomputeConfig", "ResilienceConfig", "RunConfig", "TokenizerConfig",
           "TrackingConfig", "TrainingConfig",
           "from_saved"]
