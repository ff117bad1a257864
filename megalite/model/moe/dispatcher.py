"""Token dispatch and combine: each routed token to its experts' rank and back, weighted by its
routing probability (Lepikhin et al. 2021, GShard, Sec. 2.2; Megatron-LM's token dispatchers).

Expert tensor parallelism first: every rank routed its own tokens (under sequence parallelism
its s/tp of them); the expert-TP group's tokens and routing are all-gathered, every ETP rank
computes its slice of each expert's MLP on all of them, and the partial outputs, once combined,
are reduce-scattered back (the pattern of a sequence-parallel MLP). The ETP group is the TP group
by default; with --expert-tensor-parallel-size 1 it is the rank alone (experts whole, nothing
gathered) and the TP ranks' tokens go their own ways through EP, as Megatron-LM's dispatchers
exchange tokens over the ETP x EP ranks. Then expert parallelism, two ways:

  alltoall   tokens sorted by expert, each EP rank sent exactly the rows for its experts
             (all_to_all with uneven splits, after an all_to_all of the counts), computed there
             grouped by local expert, and sent back the same way: traffic ~ T·k·h per rank.
  allgather  the EP group's tokens and routing all-gathered; each rank computes its experts' rows
             and the outputs are reduce-scattered: traffic ~ T·EP·h per rank, no count exchange.

Both give the same numbers as one process holding every expert. Dropped choices (capacity) are
not sent; their tokens get nothing from that expert (the residual carries them)."""
from __future__ import annotations

from dataclasses import dataclass

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


def host_counts(counts: torch.Tensor, first: int, choices: int, num_experts: int) -> list[int]:
    """`counts` [n] of experts [first, first + n) as Python ints: the one device-to-host copy that
    uneven splits and per-expert GEMMs need. The meta device (--dry-run) holds no values: there
    routing is taken as balanced and dropless, each of the `num_experts` experts getting
    `choices` / E of the routed choices (the remainder to the lowest indices)."""
    if counts.device.type != "meta":
        return counts.tolist()
    base, extra = divmod(choices, num_experts)
    return [base + int(first + i < extra) for i in range(counts.numel())]


def sort_by_expert(indices: torch.Tensor, kept: torch.Tensor | None, first: int, num: int, num_experts: int):
    """(order, counts, host): the routing choices [T, k] for experts [first, first + num) of
    `num_experts` that were kept, as flat choice numbers (token = choice // k) sorted by expert
    (stable: token order within an expert); how many each of those experts got, [num] on the
    device, and the same as a list of ints (`host_counts`)."""
    flat = indices.reshape(-1) - first
    if kept is not None or first > 0 or num < num_experts:
        outside = (flat < 0) | (flat >= num)
        if kept is not None:
            outside |= ~kept.reshape(-1)
        flat = flat.masked_fill(outside, num)  # others sort last and are cut off
    # bincount as a scatter-add: the same counts, with a kernel on the meta device too
    counts = torch.zeros(num + 1, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num]
    host = host_counts(counts, first, indices.numel(), num_experts)
    order = torch.argsort(flat, stable=True)[:sum(host)]
    return order, counts, host


class _Combine(torch.autograd.Function):
    """Σ over a token's choices of prob · expert output, in the probabilities' dtype (fp32, or
    fp64 with --moe-router-dtype fp64), as [num_tokens, h]: y [N, h]
    the outputs of the choices `order` [N] (flat choice numbers, each at most once), probs
    [T, k]. One node with its own backward, the products autograd would compute, without its
    copies: the forward scatter-adds into fresh zeros in place, and the probabilities' gradient
    is written to its choices (each appears once) instead of accumulated."""

    @staticmethod
    def forward(ctx, y, probs, order, k, num_tokens):
        token = order // k
        p = probs.reshape(-1).index_select(0, order).unsqueeze(-1)  # [N, 1] fp32
        out = torch.zeros(num_tokens, y.size(-1), dtype=p.dtype, device=y.device)
        out.index_add_(0, token, y.to(p.dtype) * p)
        ctx.save_for_backward(y, p, order, token)
        ctx.probs_shape = probs.shape
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        y, p, order, token = ctx.saved_tensors
        g = grad.to(p.dtype).index_select(0, token)  # [N, h]: each choice's token's gradient
        grad_probs = None
        if ctx.needs_input_grad[1]:
            per_choice = (g * y.to(p.dtype)).sum(-1)
            grad_probs = torch.zeros(ctx.probs_shape.numel(), dtype=per_choice.dtype, device=per_choice.device)
            grad_probs = grad_probs.index_copy_(0, order, per_choice).view(ctx.probs_shape)
        # in place: g is this function's own, and a fresh [N, h] buffer costs page faults on a CPU
        grad_y = g.mul_(p).to(y.dtype) if ctx.needs_input_grad[0] else None
        return grad_y, grad_probs, None, None, None


def _combine(y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, k: int, num_tokens: int) -> torch.Tensor:
    """Σ over a token's choices of prob · expert output, in fp32, as [num_tokens, h]."""
    return _Combine.apply(y, probs, order, k, num_tokens)


class TokenDispatcher:
    """Moves a rank's routed tokens to the experts and their outputs back: `dispatch` gives the
    rows each local expert computes (sorted by local expert, with their counts) and a handle,
    `combine` turns the experts' outputs for those rows into this rank's tokens' weighted sums.

    A new dispatcher is a subclass and one entry in DISPATCHERS (the choices of
    --moe-token-dispatcher-type). Expert tensor parallelism is common to every dispatcher: the
    ETP group's tokens and routing are all-gathered first (`_gather_tp`), and the partial sums
    reduce-scattered back at the end (`_scatter_tp`)."""

    def __init__(self, num_experts: int, first: int, num_local: int, etp_group, ep_group):
        """Experts [first, first + num_local) of `num_experts` are this rank's; `etp_group` splits
        each expert's MLP (the TP group unless --expert-tensor-parallel-size differs)."""
        self.num_experts, self.first, self.num_local = num_experts, first, num_local
        self.tp_group, self.ep_group = etp_group, ep_group
        self.ep = comm.group_size(ep_group)

    def dispatch(self, x: torch.Tensor, routing: Routing):
        """x [T, h] this rank's tokens -> (rows [N, h] sorted by local expert, counts per local
        expert as ints, handle for `combine`)."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        """y [N, h] the experts' outputs for the dispatched rows -> [T, h] this rank's tokens'
        weighted sums of their experts' outputs."""
        raise NotImplementedError

    def row_sources(self, handle) -> torch.Tensor:
        """The EP rank each dispatched row came from ([N], the rows' order), for FP8 experts."""
        raise NotImplementedError

    def _gather_tp(self, x: torch.Tensor, routing: Routing):
        probs, indices, kept = routing.probs, routing.indices, routing.kept
        if comm.group_size(self.tp_group) > 1:
            x, probs = gather_from_sp(x, self.tp_group), gather_from_sp(probs, self.tp_group)
            indices = comm.all_gather(indices, self.tp_group)
            kept = comm.all_gather(kept, self.tp_group) if kept is not None else None
        return x, probs, indices, kept

    def _scatter_tp(self, out: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sp(out, self.tp_group)


@dataclass
class _Rows:
    """Where the dispatched rows came from: the flat choice numbers `order` (token = choice // k)
    of the `num_tokens` tokens whose routing `probs` [num_tokens, k] weigh them."""
    order: torch.Tensor
    probs: torch.Tensor
    k: int
    num_tokens: int


class AllGatherDispatcher(TokenDispatcher):
    """The EP group's tokens and routing all-gathered; each rank computes its experts' rows and the
    outputs are reduce-scattered: traffic ~ T·EP·h per rank, no count exchange."""

    def dispatch(self, x, routing):
        x, probs, indices, kept = self._gather_tp(x, routing)
        if self.ep > 1:
            x, probs = gather_from_sp(x, self.ep_group), gather_from_sp(probs, self.ep_group)
            indices = comm.all_gather(indices, self.ep_group)
            kept = comm.all_gather(kept, self.ep_group) if kept is not None else None
        k = indices.size(1)
        order, _, counts = sort_by_expert(indices, kept, self.first, self.num_local, self.num_experts)
        return x.index_select(0, order // k), counts, _Rows(order, probs, k, x.size(0))

    def combine(self, y, handle: _Rows):
        out = _combine(y, handle.order, handle.probs, handle.k, handle.num_tokens)
        return self._scatter_tp(reduce_scatter_to_sp(out, self.ep_group))

    def row_sources(self, handle: _Rows) -> torch.Tensor:
        # the gathered tokens are the EP ranks' blocks, end to end, of num_tokens / EP each
        return torch.div(handle.order // handle.k, handle.num_tokens // self.ep, rounding_mode="floor")


@dataclass
class _Exchange(_Rows):
    """An all-to-all's bookkeeping: the rows' split sizes each way and the permutation from
    (source rank, local expert) blocks to (local expert, source rank) ones."""
    perm: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher(AllGatherDispatcher):
    """Tokens sorted by expert, each EP rank sent exactly the rows for its experts (all_to_all
    with uneven splits, after an all_to_all of the counts), computed there grouped by local
    expert, and sent back the same way: traffic ~ T·k·h per rank. With one EP rank there is
    nothing to exchange: the all-gather path, which then has no collective, runs."""

    def dispatch(self, x, routing):
        if self.ep == 1:
            return super().dispatch(x, routing)
        x, probs, indices, kept = self._gather_tp(x, routing)
        k, n_local, ep = indices.size(1), self.num_local, self.ep
        order, counts, host = sort_by_expert(indices, kept, 0, self.num_experts, self.num_experts)  # [E] sent
        # how many rows each EP rank sends this one, per local expert: [EP, E_local]
        received = comm.all_to_all(counts, [n_local] * ep, [n_local] * ep, self.ep_group)
        if received.device.type == "meta":  # balanced routing: every rank sends what this one does
            got = [host[self.first:self.first + n_local]] * ep
        else:
            got = received.view(ep, n_local).tolist()
        send_splits = [sum(host[r * n_local:(r + 1) * n_local]) for r in range(ep)]
        recv_splits = [sum(row) for row in got]
        rows = _AllToAll.apply(x.index_select(0, order // k), recv_splits, send_splits, self.ep_group)
        # arrived in (source rank, local expert) blocks; the experts want (local expert, source)
        starts = [sum(recv_splits[:src]) + sum(got[src][:e]) for src in range(ep) for e in range(n_local)]
        blocks = [(starts[src * n_local + e], got[src][e]) for e in range(n_local) for src in range(ep)]
        perm = torch.cat([torch.arange(a, a + n, device=x.device) for a, n in blocks]) if blocks else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        counts_local = [sum(got[src][e] for src in range(ep)) for e in range(n_local)]
        handle = _Exchange(order, probs, k, x.size(0), perm, send_splits, recv_splits)
        return rows.index_select(0, perm), counts_local, handle

    def row_sources(self, handle) -> torch.Tensor:
        if self.ep == 1:
            return super().row_sources(handle)
        recv = torch.tensor(handle.recv_splits, device=handle.perm.device)
        arrived = torch.repeat_interleave(torch.arange(self.ep, device=recv.device), recv, output_size=handle.perm.numel())
        return arrived.index_select(0, handle.perm)

    def combine(self, y, handle):
        if self.ep == 1:  # dispatched by the all-gather path
            return super().combine(y, handle)
        y = y.index_select(0, torch.argsort(handle.perm))  # back to (source, expert) order
        y = _AllToAll.apply(y, handle.send_splits, handle.recv_splits, self.ep_group)
        return self._scatter_tp(_combine(y, handle.order, handle.probs, handle.k, handle.num_tokens))


DISPATCHERS: dict[str, type[TokenDispatcher]] = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
