"""Context-parallel attention: the keys and values of the whole sequence from every rank's chunks
(the all-gather form of CP; why all-gather rather than a ring: context_parallel/__init__.py)."""
from __future__ import annotations

import torch

from .. import comm


class _GatherKV(torch.autograd.Function):
    """All-gather [s/c, b, g, hn] along s over the CP group; backward reduce-scatters, since
    every rank's queries contributed to the gradient of every key and value."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad.contiguous(), ctx.group, dim=0), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[s/c, b, ...] -> [s, b, ...] in gathered key order (backward reduce-scatters): MLA's keys and
    values, whose head sizes differ, gathered as one tensor."""
    return _GatherKV.apply(x, group)


def gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence ([s, b, g, hn], gathered key order) from this
    rank's [s/c, b, g, hn]. One collective for both (concatenated on the head dimension)."""
    g = k.size(2)
    kv = _GatherKV.apply(torch.cat([k, v], dim=2), group)
    return kv[:, :, :g], kv[:, :, g:]
