"""Which tensors Muon steps as matrices, and how each whole (TP-local) matrix meets Newton-Schulz
when the optimizer steps pieces of it.

- no_shard (`LocalMatrices`): every DP replica holds whole parameters and the whole reduced
  gradient; each orthogonalizes every matrix itself (the same numbers on every replica).
- ZeRO-1/2/3 (`ShardedMatrices`): a DP rank steps its 1/DP slice of every bucket, and a slice may
  cut a matrix anywhere. Each matrix is owned by one DP rank: whole matrices are assigned to the
  ranks of their DP group, largest first to the least loaded (balanced by size; an MoE expert's
  within its expert-DP group). Per bucket holding matrices: the ranks' Newton-Schulz inputs
  (momentum, per slice) are all-gathered into the whole bucket, each owner orthogonalizes its
  matrices (with the TP mode's collectives among its TP peers, which own the same matrices), and
  the updates are reduce-scattered back onto the slices (each element has one non-zero
  contribution, so the sum is exact). Traffic per step: one bucket-sized all-gather and one
  reduce-scatter, as ZeRO's own gradient reduce-scatter and parameter all-gather; Newton-Schulz
  flops are divided over DP instead of repeated on every replica.
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor_parallel.param_info import param_info
from .newton_schulz import MatrixSpec, MuonSettings, orthogonalize

QKV_SUFFIX = "self_attention.linear_qkv.weight"


def is_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """A weight of the transformer layers: 2-D, and not an embedding table (word or position) nor
    the output layer (Megatron-LM's rule, with the position embeddings left out: a lookup
    table's rows are independent, nothing there for orthogonalization to balance)."""
    return p.ndim == 2 and not param_info(p).embedding_or_output and "position_embeddings" not in name


def settings_of(config) -> MuonSettings:
    return MuonSettings(config.muon_num_ns_steps, config.muon_tp_mode, config.muon_scale_mode,
                        config.muon_extra_scale_factor)


def matrix_specs(named_params, ps, config) -> dict[int, MatrixSpec]:
    """id(param) -> MatrixSpec for every matrix: its TP (or, for an expert, ETP) group and
    partition dimension, and the QKV split (--muon-no-split-qkv turns it off)."""
    specs = {}
    for name, p in named_params:
        if not is_matrix(name, p):
            continue
        info = param_info(p)
        qkv = None
        if config.muon_split_qkv and name.endswith(QKV_SUFFIX) and config.num_attention_heads:
            qkv = (config.num_attention_heads // config.num_query_groups, config.kv_channels)
        if not info.tensor_parallel:
            specs[id(p)] = MatrixSpec(qkv=qkv)
            continue
        group = ps.etp_group if info.split is not None else ps.tp_group
        specs[id(p)] = MatrixSpec(group, comm.group_size(group), info.partition_dim, qkv)
    return specs


def balanced_owners(sizes: list[int], n: int) -> list[int]:
    """The rank of n that owns each whole matrix: largest first to the least loaded (ties: the
    lowest rank); a function of the sizes alone, so every rank computes the same."""
    load, owners = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(n), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


class LocalMatrices:
    """no_shard: the pieces are whole parameters."""

    def __init__(self, pieces, specs: dict, settings: MuonSettings):
        self.settings = settings
        self.matrix_of = {id(m): (p, specs[id(p)]) for p, _, _, m in pieces if id(p) in specs}

    def is_matrix(self, master) -> bool:
        return id(master) in self.matrix_of

    def __call__(self, masters, inputs) -> list[torch.Tensor]:
        out = []
        for m, x in zip(masters, inputs):
            p, spec = self.matrix_of[id(m)]
            out.append(orthogonalize(x.view(p.shape), spec, self.settings))
        return out


def _domains(dp):
    """(key prefix, DataParallel) of each data-parallel domain (dense, experts)."""
    return list(enumerate(dp.domains)) if hasattr(dp, "domains") else [(None, dp)]


class ShardedMatrices:
    """ZeRO: `pieces` (master, param, bucket key, offset in the bucket's slice) of this rank."""

    def __init__(self, dp, pieces, specs: dict, settings: MuonSettings, device):
        self.settings, self.specs, self.device = settings, specs, device
        self.place = {id(m): (key, off, m.numel()) for m, p, key, off in pieces if id(p) in specs}
        self.buckets = []  # (key, domain, bucket, [matrices this rank owns in it])
        self.owned_numel = 0
        for prefix, domain in _domains(dp):
            matrices = [p for p in domain.params if id(p) in specs]
            owners = balanced_owners([p.numel() for p in matrices], domain.group_size)
            rank = comm.group_rank(domain.group)
            mine = {id(p) for p, o in zip(matrices, owners) if o == rank}
            self.owned_numel += sum(p.numel() for p in matrices if id(p) in mine)
            for b, params in enumerate(domain.layout.bucket_params):
                if any(id(p) in specs for p in params):
                    key = b if prefix is None else (prefix, b)
                    self.buckets.append((key, domain, b, [p for p in params if id(p) in mine]))

    def is_matrix(self, master) -> bool:
        return id(master) in self.place

    def __call__(self, masters, inputs) -> list[torch.Tensor]:
        where = {id(m): i for i, m in enumerate(masters)}
        by_bucket: dict = {}
        for m in masters:
            key, off, n = self.place[id(m)]
            by_bucket.setdefault(key, []).append((where[id(m)], off, n))
        updates: list = [None] * len(masters)
        for key, domain, b, owned in self.buckets:
            start, end = domain.layout.buckets[b]
            mine = by_bucket.get(key, ())
            shard = torch.zeros((end - start) // domain.group_size, dtype=torch.float32, device=self.device)
            if mine:  # every piece into its place in one fused copy, not one kernel per piece
                torch._foreach_copy_([shard[off:off + n] for _, off, n in mine],
                                     [inputs[i].reshape(-1) for i, _, _ in mine])
            full = torch.empty(end - start, dtype=torch.float32, device=self.device)
            comm.all_gather_flat(shard, full, domain.group)
            result = torch.zeros_like(full)
            for p in owned:
                a, z = (i - start for i in domain.layout.param_index[p])
                result[a:z] = orthogonalize(full[a:z].view(p.shape), self.specs[id(p)], self.settings).reshape(-1)
            comm.reduce_scatter_flat(result, shard, domain.group)
            for i, off, n in mine:
                updates[i] = shard[off:off + n]
        return updates
