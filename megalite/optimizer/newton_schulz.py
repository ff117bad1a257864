"""Muon's orthogonalization of one weight matrix: Newton-Schulz iterations, the update's scale, the
fused QKV split, and the three tensor-parallel modes (Megatron-LM's --muon-tp-mode).

Newton-Schulz (Jordan et al. 2024, "Muon"; Bernstein & Newhouse 2024): X0 = G / ||G||_F, then
    A = X X^T,  X <- a X + (b A + c A^2) X        (a, b, c) = (3.4445, -4.7750, 2.0315)
drives every singular value of X towards ~1 (into about [0.7, 1.2]; the quintic's coefficients
trade exactness for speed), approximating U V^T of G = U S V^T. The polynomial p(XX^T) X equals
X p(X^TX), so the iteration may run on X or X^T; it runs on the orientation whose Gram matrix is
the smaller (X^T when X has more rows than columns). It is equivariant under row permutations
(NS(PX) = P NS(X)): orthogonalizing the rows of a matrix in any order gives the same rows, which
is why SwiGLU's fc1 ([gate; up] cut per TP rank, so the TP ranks' rows concatenate to a row
permutation of the whole) needs no reordering in the duplicated and distributed modes.

TP modes, for a weight cut over a TP group along `partition_dim` (ParamInfo):
  blockwise    each rank orthogonalizes its shard: no traffic, but the update is that of a
               different (block-diagonal) matrix, so it changes with the TP size;
  duplicated   all-gather the shard into the whole matrix, every TP rank orthogonalizes it
               whole, keeps its rows/columns: (TP - 1)/TP of the matrix received, TP x the flops;
  distributed  Newton-Schulz on the shards: the orientation contracts the split dimension, so
               A = sum over ranks of X_r X_r^T is one all-reduce of a [k, k] matrix (k the unsplit
               dimension) per iteration, plus one of ||G||^2; each rank multiplies only its shard.
Duplicated and distributed compute the whole matrix's orthogonalization: the same update on every
TP size (up to float rounding).

The scale (Megatron-LM's get_muon_scale_factor) of an update for an [out, in] matrix:
spectral sqrt(max(out, in)) (Moonlight, arXiv 2502.16982), unit_rms_norm sqrt(out / in) (Scion,
arXiv 2502.07529), shape_scaling sqrt(max(1, out / in)) (Jordan's), times
--muon-extra-scale-factor; out and in are the whole matrix's (the shard's under blockwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic (Megatron-LM's "quintic")
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int, tp_group=None, partition_dim: int | None = None) -> torch.Tensor:
    """The orthogonalization of the [m, n] matrix `g`, in fp32. With `tp_group` (of size > 1), `g`
    is this rank's shard of a matrix cut along `partition_dim` over the group (distributed mode):
    the result is this rank's shard of the whole matrix's orthogonalization."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    distributed = tp_group is not None and comm.group_size(tp_group) > 1
    # distributed: contract the split dimension, so the Gram matrix is a sum over the shards
    transpose = (partition_dim == 0) if distributed else x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    sq = (x * x).sum()
    if distributed:
        comm.all_reduce(sq, tp_group)
    x = x / (sq.sqrt() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT  # [k, k]
        if distributed:
            comm.all_reduce(gram, tp_group)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if transpose else x


def muon_scale(rows: int, cols: int, mode: str, extra: float = 1.0) -> float:
    """Megatron-LM's scale of the orthogonalized update of a [rows (out), cols (in)] matrix."""
    if mode == "spectral":
        s = max(rows, cols) ** 0.5
    elif mode == "unit_rms_norm":
        s = (rows / cols) ** 0.5
    elif mode == "shape_scaling":
        s = max(1.0, rows / cols) ** 0.5
    else:
        raise ValueError(f"unknown --muon-scale-mode {mode!r}")
    return extra * s


@dataclass(frozen=True)
class MatrixSpec:
    """How one weight (its TP-local shard, [rows, cols]) is orthogonalized."""
    tp_group: object = None  # the group it is cut over (TP, or ETP for an expert); None: not cut
    tp_size: int = 1
    partition_dim: int = 0
    # fused QKV [ng * (hpg + 2) * hn, h]: (heads per group, head size) to split Q, K and V
    qkv: tuple[int, int] | None = None


@dataclass(frozen=True)
class MuonSettings:
    steps: int = 5
    tp_mode: str = "blockwise"
    scale_mode: str = "spectral"
    extra_scale: float = 1.0


def _split_qkv(x: torch.Tensor, qkv: tuple[int, int]) -> list[torch.Tensor]:
    """[ng * (hpg + 2) * hn, h] (group by group: hpg query heads, a key, a value) -> the Q rows
    [ng * hpg * hn, h], K and V [ng * hn, h], each in group order. Under TP a rank holds whole
    groups, so the ranks' Q (K, V) rows concatenate to the whole Q (K, V) matrix."""
    hpg, hn = qkv
    h = x.size(1)
    per_group = x.view(-1, hpg + 2, hn, h)
    return [per_group[:, :hpg].reshape(-1, h), per_group[:, hpg].reshape(-1, h), per_group[:, hpg + 1].reshape(-1, h)]


def _join_qkv(parts: list[torch.Tensor], qkv: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    hpg, hn = qkv
    h = like.size(1)
    out = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    per_group = out.view(-1, hpg + 2, hn, h)
    ng = per_group.size(0)
    per_group[:, :hpg] = parts[0].view(ng, hpg, hn, h)
    per_group[:, hpg] = parts[1].view(ng, hn, h)
    per_group[:, hpg + 1] = parts[2].view(ng, hn, h)
    return out


def _orthogonalize_block(x: torch.Tensor, spec: MatrixSpec, s: MuonSettings) -> torch.Tensor:
    """One matrix (or one of Q, K, V): orthogonalized and scaled, as this rank's shard."""
    cut = spec.tp_group is not None and spec.tp_size > 1
    mode = s.tp_mode if cut else "blockwise"
    rows, cols = x.shape
    if mode != "blockwise":  # the whole matrix's shape
        rows, cols = (rows * spec.tp_size, cols) if spec.partition_dim == 0 else (rows, cols * spec.tp_size)
    scale = muon_scale(rows, cols, s.scale_mode, s.extra_scale)
    if mode == "duplicated":
        whole = comm.all_gather(x.float(), spec.tp_group, dim=spec.partition_dim)
        rank = comm.group_rank(spec.tp_group)
        return newton_schulz(whole, s.steps).chunk(spec.tp_size, dim=spec.partition_dim)[rank] * scale
    if mode == "distributed":
        return newton_schulz(x, s.steps, spec.tp_group, spec.partition_dim) * scale
    return newton_schulz(x, s.steps) * scale


def orthogonalize(x: torch.Tensor, spec: MatrixSpec, settings: MuonSettings) -> torch.Tensor:
    """Muon's update direction for the TP-local matrix `x` ([rows, cols]), scaled, in fp32."""
    if spec.qkv is None:
        return _orthogonalize_block(x, spec, settings)
    parts = [_orthogonalize_block(part, spec, settings) for part in _split_qkv(x, spec.qkv)]
    return _join_qkv(parts, spec.qkv, x)
