"""Token dispatch and combine: each routed token to its experts' rank and back, weighted by its
routing probability (Lepikhin et al. 2021, GShard, Sec. 2.2; Megatron-LM's token dispatchers).

Tensor parallelism first: under sequence parallelism each TP rank routed its own s/tp tokens;
the TP group's tokens and routing are all-gathered, every TP rank computes its slice of each
expert's MLP on all of them, and the partial outputs, once combined, are reduce-scattered back
(the pattern of a sequence-parallel MLP). Then expert parallelism, two ways:

  alltoall   tokens sorted by expert, each EP rank sent exactly the rows for its experts
             (all_to_all with uneven splits, after an all_to_all of the counts), computed there
             grouped by local expert, and sent back the same way: traffic ~ T·k·h per rank.
  allgather  the EP group's tokens and routing all-gathered; each rank computes its experts' rows
             and the outputs are reduce-scattered: traffic ~ T·EP·h per rank, no count exchange.

Both give the same numbers as one process holding every expert. Dropped choices (capacity) are
not sent; their tokens get nothing from that expert (the residual carries them)."""
from __future__ import annotations

import torch

from ... import comm
from ...tensor_parallel.mappings import gather_from_sp, reduce_scatter_to_sp
from .router import Routing


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return comm.all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return comm.all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def sort_by_expert(indices: torch.Tensor, kept: torch.Tensor | None, first: int, num: int):
    """(order, counts): the routing choices [T, k] for experts [first, first + num) that were kept,
    as flat choice numbers (token = choice // k) sorted by expert (stable: token order within
    an expert), and how many each of those experts got (a list of ints)."""
    flat = indices.reshape(-1) - first
    outside = (flat < 0) | (flat >= num)
    if kept is not None:
        outside |= ~kept.reshape(-1)
    flat = flat.masked_fill(outside, num)  # others sort last and are cut off
    counts = torch.bincount(flat, minlength=num + 1)[:num]
    order = torch.argsort(flat, stable=True)[:int(counts.sum())]
    return order, counts


def _combine(y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, k: int, num_tokens: int) -> torch.Tensor:
    """Σ over a token's choices of prob · expert output, in fp32, as [num_tokens, h]."""
    weighted = y.float() * probs.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(num_tokens, y.size(-1), dtype=torch.float32, device=y.device)
    return out.index_add(0, order // k, weighted).to(y.dtype)


class TokenDispatcher:
    def __init__(self, kind: str, num_experts: int, tp_group, ep_group):
        if kind not in ("alltoall", "allgather"):
            raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
        self.kind, self.num_experts, self.tp_group, self.ep_group = kind, num_experts, tp_group, ep_group
        self.ep = comm.group_size(ep_group)

    def __call__(self, x: torch.Tensor, routing: Routing, experts) -> torch.Tensor:
        """x [T, h] this rank's tokens -> [T, h] their experts' weighted sum."""
        probs, indices, kept = routing.probs, routing.indices, routing.kept
        if comm.group_size(self.tp_group) > 1:
            x, probs = gather_from_sp(x, self.tp_group), gather_from_sp(probs, self.tp_group)
            indices = comm.all_gather(indices, self.tp_group)
            kept = comm.all_gather(kept, self.tp_group) if kept is not None else None
        run = self._alltoall if self.kind == "alltoall" and self.ep > 1 else self._allgather
        out = run(x, probs, indices, kept, experts)
        return reduce_scatter_to_sp(out, self.tp_group)

    def _allgather(self, x, probs, indices, kept, experts):
        if self.ep > 1:
            x, probs = gather_from_sp(x, self.ep_group), gather_from_sp(probs, self.ep_group)
            indices = comm.all_gather(indices, self.ep_group)
            kept = comm.all_gather(kept, self.ep_group) if kept is not None else None
        k = indices.size(1)
        order, counts = sort_by_expert(indices, kept, experts.first, experts.num_local)
        y = experts(x.index_select(0, order // k), counts.tolist())
        return reduce_scatter_to_sp(_combine(y, order, probs, k, x.size(0)), self.ep_group)

    def _alltoall(self, x, probs, indices, kept, experts):
        k, n_local = indices.size(1), experts.num_local
        order, counts = sort_by_expert(indices, kept, 0, self.num_experts)  # [E] sent to each expert
        # how many rows each EP rank sends this one, per local expert: [EP, E_local]
        received = comm.all_to_all(counts, [n_local] * self.ep, [n_local] * self.ep, self.ep_group)
        received = received.view(self.ep, n_local)
        send_splits = counts.view(self.ep, n_local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        rows = _AllToAll.apply(x.index_select(0, order // k), recv_splits, send_splits, self.ep_group)
        # arrived in (source rank, local expert) blocks; the experts want (local expert, source)
        start = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)
        blocks = [(int(start[src * n_local + e]), int(received[src, e])) for e in range(n_local)
                  for src in range(self.ep)]
        perm = torch.cat([torch.arange(a, a + n, device=x.device) for a, n in blocks]) if blocks else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        y = experts(rows.index_select(0, perm), received.sum(0).tolist())
        y = y.index_select(0, torch.argsort(perm))  # back to (source, expert) order
        y = _AllToAll.apply(y, send_splits, recv_splits, self.ep_group)
        return _combine(y, order, probs, k, x.size(0))
