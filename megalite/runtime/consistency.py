"""--test-mode: Megatron-LM's real-time consistency test (Attention.run_realtime_tests). Replicas
of a parameter must hold the same values; a silent hardware fault (memory corrupted while a
checkpoint loaded, a flipped bit in transit) breaks that without any error. Megatron-LM checks the
query/key norms of every attention layer (--qk-layernorm) across the data- and tensor-parallel
ranks at each forward; the weights change only at the optimizer step, so megalite checks them once
per iteration, before its forward passes: the same coverage, one gather per group."""
from __future__ import annotations

import torch

from .. import comm
from ..errors import UserError


class ReplicaMismatch(UserError):
    """Replicas of a parameter differ (--test-mode)."""


def qk_norm_weights(model: list) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every query/key norm parameter of these model chunks, in module order."""
    return [(f"{name}.{pname}", p.detach()) for chunk in model for name, module in chunk.named_modules()
            if name.endswith(("q_layernorm", "k_layernorm")) for pname, p in module.named_parameters()]


def check_replicas(model: list, ps, iteration: int) -> None:
    """Gather the query/key norm weights over the data-parallel (x CP) and the tensor-parallel
    group and compare each rank's with every other's; raise naming the parameter and two ranks that
    differ (every rank raises alike: each sees the whole gather)."""
    pairs = qk_norm_weights(model)
    if not pairs:
        return
    flat = torch.cat([t.reshape(-1).float() for _, t in pairs])
    for what, group, ranks in (("data-parallel", ps.dp_cp_group, ps.dp_cp_ranks),
                               ("tensor-parallel", ps.tp_group, ps.tp_ranks)):
        if comm.group_size(group) < 2:
            continue
        everyone = comm.all_gather(flat.unsqueeze(0), group).view(comm.group_size(group), -1)
        differ = (everyone != everyone[0]).any(dim=0)
        if bool(differ.any()):
            first = int(differ.nonzero()[0])
            offset = 0
            for name, t in pairs:
                if first < offset + t.numel():
                    break
                offset += t.numel()
            other = int((everyone[:, first] != everyone[0, first]).nonzero()[0])
            raise ReplicaMismatch(f"--test-mode: before iteration {iteration + 1}, {name} differs between "
                                  f"{what} ranks {ranks[0]} and {ranks[other]} (a silent fault: its replicas must "
                                  f"be equal)")
