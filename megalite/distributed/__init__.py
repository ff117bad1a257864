"""The data-parallel side, for every sharding strategy (no_shard, ZeRO-1/2/3): bucket layout,
gradient and parameter buffers, their collectives, and ZeRO-3's gather-on-use schedule."""
from .buckets import BucketLayout
from .data_parallel import DataParallel
from .grad_buffer import GradBuffer, ShardedGradBuffer
from .param_buffer import FlatParamBuffer, ShardedParams
from ..config.sharding import STRATEGIES, ShardingStrategy, get_strategy

__all__ = ["BucketLayout", "DataParallel", "GradBuffer", "ShardedGradBuffer", "FlatParamBuffer", "ShardedParams",
           "STRATEGIES", "ShardingStrategy", "get_strategy"]
