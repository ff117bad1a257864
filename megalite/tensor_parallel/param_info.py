"""One typed record per parameter: how it is sharded, initialised and synchronised.

Every subsystem that treats parameters differently reads this record and nothing else:
initialisation and checkpoints (how a shard was cut from the whole tensor), the gradient norm
(which copies count), and the data-parallel module (which extra gradient sums a parameter needs).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class ParamInfo:
    # sharded across TP along `partition_dim`; `partition_stride` > 1: the whole tensor is that
    # many blocks stacked along the dimension, each split separately ([gate; up] of SwiGLU's fc1)
    tensor_parallel: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    # replicated across TP but each TP rank's gradient is a partial sum: fed sequence-sharded
    # activations (norms, row-parallel biases under sequence parallelism) or head-sharded ones
    # (--qk-layernorm's norms, as Megatron-LM's finalize_model_grads): summed over TP after the
    # DP reduction
    sequence_parallel: bool = False
    # the last pipeline stage's copy of the tied word embedding: not saved and not counted in
    # norms (the first stage's copy is), initialised from the embedding's name
    tied_copy: bool = False
    # gradient summed over the embedding group (first and last stage) before the DP reduction
    embedding_group_sync: bool = False
    # the word embedding or the output layer (either copy): --decoupled-lr gives these their own
    # learning rate (Megatron-LM's is_embedding_or_output_parameter)
    embedding_or_output: bool = False
    # an MoE expert's weight: held by one expert-parallel rank, replicated over the
    # expert-data-parallel group only (its gradient reduced, its state sharded there)
    expert_parallel: bool = False
    # (rank, size) in the group a tensor-parallel weight is split over when that is not the TP
    # group: an MoE expert's place in its expert-tensor-parallel group (--expert-tensor-parallel-
    # size); None: the TP group's. Initialisation and checkpoints cut and reshard by it.
    split: tuple[int, int] | None = None
    # initialisation: "normal" (with std), "zeros", "ones", "uniform" (U(init_range)) or
    # "log_uniform" (log U(init_range): gated DeltaNet's A_log); `init_rows` limits the random
    # rows of a padded vocabulary table (the padding stays zero)
    init: str | None = None
    init_std: float = 0.0
    init_rows: int | None = None
    init_range: tuple[float, float] | None = None

    def tp_place(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """(rank, size) of the group this weight is split over, given the TP group's."""
        return self.split if self.split is not None else (tp_rank, tp_size)

    def is_owner(self, tp_rank: int) -> bool:
        """Whether this rank's copy is the one that counts once: saved, and summed into norms.
        TP-replicated tensors are owned by TP rank 0; the tied copy by the first stage."""
        return not self.tied_copy and (self.tensor_parallel or tp_rank == 0)


def param_info(p: nn.Parameter) -> ParamInfo:
    """The record of `p`, created empty (replicated, no init rule) on first use."""
    info = getattr(p, "megalite_info", None)
    if info is None:
        info = ParamInfo()
        p.megalite_info = info
    return info
