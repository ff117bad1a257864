"""Ulysses all-to-all (--cp-comm-type a2a; DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509,
Sec. 3): one all-to-all turns this rank's s/a tokens of every head into every token of a/1 of the
heads, attention runs over the whole sequence locally (any kernel, any mask), and a second
all-to-all turns the output back. Traffic per rank per layer is O(s·h/a) whatever a is; the
attention's keys and values are O(s·g/a), the scores O(s²·n/a).

GQA: the query heads are ordered group by group (model/attention.py), so a contiguous 1/a of them
belongs to a contiguous 1/a of the key/value heads when g divides by a. With fewer key/value heads
than ranks (a = m·g), each is repeated m times before the exchange, so rank j receives the one its
query heads share (validation refuses the counts that neither split nor divide).
"""
from __future__ import annotations

import torch

from .. import comm


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[sl, b, H, hn] (this rank's tokens, every head) -> [a·sl, b, H/a, hn]: every rank's tokens
    (in rank order: the gathered order of context_parallel/sharding.py) of this rank's 1/a heads."""
    a = comm.group_size(group)
    sl, b, h, hn = x.shape
    send = x.reshape(sl, b, a, h // a, hn).permute(2, 0, 1, 3, 4).reshape(a * sl, b, h // a, hn)
    return comm.all_to_all(send, [sl] * a, [sl] * a, group)


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse: [a·sl, b, H/a, hn] -> [sl, b, H, hn]."""
    a = comm.group_size(group)
    sl = y.size(0) // a
    recv = comm.all_to_all(y, [sl] * a, [sl] * a, group)  # block m: rank m's heads of my tokens
    _, b, hl, hn = recv.shape
    return recv.reshape(a, sl, b, hl, hn).permute(1, 2, 0, 3, 4).reshape(sl, b, a * hl, hn)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group):
    """q [sl, b, n, hn], k/v [sl, b, g, hn] -> the same of a·sl tokens (gathered order) and n/a
    query heads, max(g/a, 1) key/value heads; one all-to-all for the three."""
    a = comm.group_size(group)
    n, g = q.size(2), k.size(2)
    if g < a:  # GQA with fewer key/value heads than ranks: each serves a/g ranks' query heads
        k, v = k.repeat_interleave(a // g, dim=2), v.repeat_interleave(a // g, dim=2)
        g = a
    sl, b, hn = q.size(0), q.size(1), q.size(3)
    # per destination rank: its n/a query heads, then g/a keys, then g/a values
    parts = [t.reshape(sl, b, a, t.size(2) // a, hn) for t in (q, k, v)]
    both = _SeqToHeads.apply(torch.cat(parts, dim=3).reshape(sl, b, n + 2 * g, hn), group)
    return both.split([n // a, g // a, g // a], dim=2)


def gather_heads(out: torch.Tensor, group) -> torch.Tensor:
    """Attention output [a·sl, b, n/a, hn] (gathered order) -> [sl, b, n, hn] of this rank's tokens
    (Megatron-LM's hp2cp)."""
    return _HeadsToSeq.apply(out.contiguous(), group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[sl, b, H, d] (this rank's tokens, every head) -> [a·sl, b, H/a, d] in gathered order: the
    whole sequence of this rank's 1/a heads (the gated DeltaNet's per-head inputs, Megatron-LM's
    cp2hp all-to-all)."""
    return _SeqToHeads.apply(x, group)
