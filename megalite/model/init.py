"""Layout-invariant weight initialisation.

Every parameter is generated whole from a generator seeded by (seed, global parameter name)
and then sliced to the rank's shard, so TP=1 and TP=8 (and any pipeline split) start from the
same full weights. Megatron-LM does the same under `--use-cpu-initialization`; here it is the
only path, because "every layout computes the same function" starts with the weights.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from .. import comm
from ..tensor_parallel.param_info import ParamInfo, param_info


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def global_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    """The whole tensor's shape, given TP's size (an MoE expert's weight: its ETP group's)."""
    shape, info = list(param.shape), param_info(param)
    if info.tensor_parallel:
        shape[info.partition_dim] *= info.tp_place(0, tp_size)[1]
    return tuple(shape)


def full_tensor(param: nn.Parameter, name: str, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole (unsharded) initial value of `param`, as fp32 on CPU."""
    info = param_info(param)
    kind = info.init
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    if kind in ("uniform", "log_uniform"):  # gated DeltaNet's conv1d (uniform) and A_log (log_uniform)
        lo, hi = info.init_range
        values = torch.rand(shape, generator=gen).mul_(hi - lo).add_(lo)
        return values.log_() if kind == "log_uniform" else values
    if kind != "normal":
        raise ValueError(f"parameter {name} has no initialisation rule (init={kind!r})")
    rows = info.init_rows
    if rows is None or rows >= shape[0]:
        return torch.randn(shape, generator=gen).mul_(info.init_std)  # in place: one whole-tensor copy fewer
    # padded vocabulary: only the real rows are random; the padding rows stay zero (and, being
    # masked out of the softmax, get no gradient), so the padding amount cannot matter.
    out = torch.zeros(shape)
    out[:rows] = torch.randn((rows,) + tuple(shape[1:]), generator=gen) * info.init_std
    return out


def shard(full: torch.Tensor, info: ParamInfo, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of `full`, following the partition dimension and stride (given the TP
    group's rank and size; an MoE expert's weight is cut by its ETP group's, `ParamInfo.split`)."""
    tp_rank, tp_size = info.tp_place(tp_rank, tp_size)
    if not info.tensor_parallel or tp_size == 1:
        return full
    dim, stride = info.partition_dim, info.partition_stride
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in blocks], dim=dim)


def unshard(shards: list[torch.Tensor], info: ParamInfo) -> torch.Tensor:
    """Inverse of `shard` given every TP rank's slice (rank order)."""
    if not info.tensor_parallel or len(shards) == 1:
        return shards[0]
    dim, stride = info.partition_dim, info.partition_stride
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([pb[j] for pb in per_rank_blocks], dim=dim) for j in range(stride)], dim=dim)


def initial_value(param: nn.Parameter, name: str, seed: int, tp_group) -> torch.Tensor:
    """This rank's TP shard of `param`'s initial value (fp32, CPU). `param` may be on the meta
    device: ZeRO-3 materialises parameters from this, one at a time."""
    tp_size, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    full = full_tensor(param, name, seed, global_shape(param, tp_size))
    return shard(full, param_info(param), tp_rank, tp_size)


@torch.no_grad()
def initialize_parameters(named_params, seed: int, tp_group) -> None:
    """Fill every parameter in `named_params` ((global_name, param) pairs) from the seed."""
    for name, param in named_params:
        param.copy_(initial_value(param, name, seed, tp_group))
