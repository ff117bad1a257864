"""Column- and row-parallel linear layers and the vocabulary-parallel embedding.

Megatron-LM paper (Shoeybi et al. 2019), Sec. 3: Y = X·A with A split by columns needs no
communication forward (each rank gets its own output columns); with A split by rows, each rank
holds a partial sum and the outputs are all-reduced. An MLP or attention block is a
column-parallel layer followed by a row-parallel one, so only the block's output is reduced.

Weights are created uninitialised here: `megalite.model.init` fills every parameter from
(seed, global name) and slices it, using the partition attributes set below, so that every
layout starts from identical full weights.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .fp8_linear import fp8_linear
from .mappings import (copy_to_tp, gather_from_tp, linear_with_sp_gather, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_tp)
from .param_info import param_info
from .wgrad import embedding as wgrad_embedding, linear as wgrad_linear


def set_tp_attributes(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    """Mark `param` as sharded across TP along `partition_dim`.

    `stride` > 1 means the full tensor is `stride` blocks stacked along that dimension (e.g.
    [gate; up] of SwiGLU's fc1) and each block is split across ranks separately, so a rank
    holds its slice of every block.
    """
    info = param_info(param)
    info.tensor_parallel, info.partition_dim, info.partition_stride = True, partition_dim, stride


def set_init(param: nn.Parameter, kind: str, std: float = 0.0, rows: int | None = None,
             bounds: tuple[float, float] | None = None) -> None:
    """Record how `param` is initialised: kind in {"normal", "zeros", "ones", "uniform",
    "log_uniform"} (the last two over `bounds`). `rows` limits the random rows of a padded
    vocabulary (the padding stays zero)."""
    info = param_info(param)
    info.init, info.init_std, info.init_rows, info.init_range = kind, std, rows, bounds


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = X·A + b with A's output dimension split across TP: [*, in] -> [*, out/tp]."""

    wgrad_store = None  # --delay-wgrad-compute: weight gradients wait for W (tensor_parallel/wgrad.py)
    fp8 = None  # --fp8-format: this layer's FP8 GEMM site (megalite/fp8/site.py, attached by model/fp8.py)

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, stride: int = 1,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        tp = comm.group_size(tp_group)
        self.output_size_per_partition = _divide(output_size, tp, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=dtype, device=device))
        set_tp_attributes(self.weight, 0, stride)
        set_init(self.weight, "normal", init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=dtype, device=device))
            set_tp_attributes(self.bias, 0, stride)
            set_init(self.bias, "zeros")
        else:
            self.register_parameter("bias", None)

    def fusable_weights(self, device) -> list:
        """The weights whose every use is a product of grad_fusion.py's (--gradient-accumulation-
        fusion): this layer's own, unless FP8 (its GEMMs are torchao's)."""
        return [self.weight] if self.fp8 is None else []

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.fp8 is not None:  # FP8 GEMMs (tensor_parallel/fp8_linear.py), the SP gather in FP8
            sp = self.tp_group if self.sequence_parallel else None
            y = fp8_linear(x if sp is not None else copy_to_tp(x, self.tp_group), weight, self.bias, self.fp8, sp,
                           self.wgrad_store)
        elif self.sequence_parallel:  # [s/tp, b, h] gathered to [s, b, h], kept for backward as [s/tp, b, h]
            y = linear_with_sp_gather(x, weight, self.bias, self.tp_group, self.wgrad_store)
        else:
            y = wgrad_linear(copy_to_tp(x, self.tp_group), weight, self.bias, self.wgrad_store)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X·A + b with A's input dimension split across TP: [*, in/tp] -> [*, out], outputs
    summed over TP (or reduce-scattered along s under sequence parallelism). The bias is added
    once, after the reduction."""

    wgrad_store = None  # --delay-wgrad-compute (the bias's gradient stays in B: a sum over tokens)
    fp8 = None  # --fp8-format: this layer's FP8 GEMM site (model/fp8.py)

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        tp = comm.group_size(tp_group)
        self.input_size_per_partition = _divide(input_size, tp, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=dtype, device=device))
        set_tp_attributes(self.weight, 1)
        set_init(self.weight, "normal", init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device))
            set_init(self.bias, "zeros")
            # under SP each rank sees only its sequence shard: the bias gradient needs a TP all-reduce
            param_info(self.bias).sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def fusable_weights(self, device) -> list:
        """The weights whose every use is a product of grad_fusion.py's (--gradient-accumulation-
        fusion): this layer's own, unless FP8 (its GEMMs are torchao's)."""
        return [self.weight] if self.fp8 is None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        y = (fp8_linear(x, self.weight, None, self.fp8, None, self.wgrad_store) if self.fp8 is not None
             else wgrad_linear(x, self.weight, None, self.wgrad_store))
        y = reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows: [b, s] ids -> [b, s, h].

    Each rank looks up the ids in its row range, zeroes the rest, and the partial results are
    summed over TP (Megatron-LM paper, Sec. 3, "input embedding").
    """

    wgrad_store = None  # --delay-wgrad-compute: the rows' scatter-add waits for W

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, init_std: float = 0.02,
                 init_rows: int | None = None, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.num_per_partition = _divide(num_embeddings, tp, "padded vocabulary size")
        self.vocab_start = rank * self.num_per_partition
        self.vocab_end = self.vocab_start + self.num_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_per_partition, embedding_dim, dtype=dtype, device=device))
        set_tp_attributes(self.weight, 0)
        set_init(self.weight, "normal", init_std, rows=init_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if comm.group_size(self.tp_group) == 1:
            return wgrad_embedding(ids, self.weight, self.wgrad_store)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = wgrad_embedding(local, self.weight, self.wgrad_store).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)
