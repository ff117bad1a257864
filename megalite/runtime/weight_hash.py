"""--check-weight-hash-across-dp-replicas-interval: silent corruption of one replica's weights.

Data-parallel replicas hold the same weights by construction (the same initial values, the same
reduced gradients, the same update); a bit flipped in one replica's memory, or an update one
device computed wrongly, breaks that for good and silently: the replica trains on, its gradients
are averaged into everyone's, and a checkpoint of it (the first DP rank's copy) may hold the bad
weight. As Megatron-LM's check_param_hashes_across_dp_replicas (megatron/core/utils.py), every N
iterations each rank hashes each of its parameters (SHA-1 of its bytes on the host) and the hashes
are gathered over the parameter's replica group (DP x CP, or an expert's expert-data-parallel
group): one all-gather of 8 bytes per parameter per group. A mismatch names the parameter, the
rank(s) that differ from the majority of their replicas (both sides where there is no majority)
and the iteration, and stops the run before any checkpoint of it (the check runs before the
iteration's save). Under ZeRO-1/2 the parameters are whole on every rank after the update's
all-gather, which is waited for first; ZeRO-3 has no replicas to compare (validation refuses it).
"""
from __future__ import annotations

import collections
import hashlib

import torch

from .. import comm
from ..errors import UserError


class WeightHashError(UserError):
    """The weights of data-parallel replicas differ."""


def param_hash(p: torch.Tensor) -> int:
    """The first 8 bytes of the SHA-1 of the parameter's bytes, as a signed 64-bit integer."""
    data = p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha1(data.tobytes()).digest()[:8], "little", signed=True)


def odd_ones_out(hashes: list) -> list:
    """Positions whose hash differs from the most common one; every position when no value is
    held by more than half (two replicas that disagree: either may be the bad one)."""
    value, count = collections.Counter(hashes).most_common(1)[0]
    if count * 2 <= len(hashes):
        return list(range(len(hashes)))
    return [i for i, h in enumerate(hashes) if h != value]


def check_weight_hashes(named_params: list, ps, iteration: int, device) -> None:
    """Compare the hash of every (name, parameter, is an expert's) across its replicas;
    WeightHashError names the mismatches (raised on every rank: each group's members agree, the
    others learn of it by one all-reduce)."""
    bad = []
    for expert in (False, True):
        params = [(n, p) for n, p, e in named_params if e == expert]
        group, ranks = ps.replica_group(expert), ps.replica_ranks(expert)
        if not params:
            continue
        mine = torch.tensor([param_hash(p) for _, p in params], dtype=torch.int64, device=device)
        every = comm.all_gather(mine.view(1, -1), group).view(-1, len(params)).tolist() if len(ranks) > 1 else []
        for i, (name, _) in enumerate(params):
            column = [row[i] for row in every]
            odd = odd_ones_out(column) if len(set(column)) > 1 else []
            if odd:
                bad.append(f"{name} on rank(s) {[ranks[j] for j in odd]} (of replicas {ranks})")
    found = comm.all_reduce(torch.tensor([float(len(bad))], device=device), comm.world_group())
    if bad:
        raise WeightHashError(
            f"iteration {iteration}: the weights of data-parallel replicas differ (--check-weight-hash-across-dp-"
            f"replicas-interval): {'; '.join(bad[:4])}{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; "
            f"stopped before any checkpoint of them. Take the named rank's device out and resume from the latest "
            f"checkpoint")
    if float(found) > 0:
        raise WeightHashError(f"iteration {iteration}: the weights of data-parallel replicas differ on other ranks "
                              f"(--check-weight-hash-across-dp-replicas-interval; their message names them)")


__all__ = ["WeightHashError", "check_weight_hashes", "odd_ones_out", "param_hash"]
