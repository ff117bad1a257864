"""Tensor (and sequence) parallelism: autograd collectives, parallel layers, vocab-parallel loss,
RNG tracker, and ParamInfo, the per-parameter record of how a tensor is sharded."""
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_init, set_tp_attributes
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, linear_with_sp_gather, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from .random import RNGTracker, seed_everything

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp", "gather_from_sp",
    "linear_with_sp_gather", "reduce_scatter_to_sp", "RNGTracker", "seed_everything", "set_init", "set_tp_attributes",
]
