"""Ring attention (--cp-comm-type p2p; Liu et al. 2023, arXiv 2310.01889): each rank keeps its own
queries and passes key/value blocks around the CP ring, so no rank ever holds more than two
blocks of keys and values (its own and the one in flight): O(s/c) per rank, not allgather's O(s).

Forward (the online softmax of Milakov & Gimelshein 2018, as FlashAttention's Alg. 1): block j
of keys gives each query row its partial output o_j = softmax(Q·K_jᵀ/√d)·V_j and log-sum-exp
l_j; two partials merge exactly as
    l = log(e^l_a + e^l_b),   o = o_a·e^(l_a - l) + o_b·e^(l_b - l).
The next block's transfer is posted before this one's compute (comm.exchange_async).

Backward (FlashAttention-2's, Dao 2023, Alg. 2): the forward keeps only Q, K, V, O and l (all
O(s/c)); the ring runs again, each block's probabilities rebuilt as P = exp(S - l), and
    dV_j = Pᵀ·dO,   dS = P ∘ (dO·V_jᵀ - rowsum(dO ∘ O)),   dQ += dS·K_j/√d,   dK_j = dSᵀ·Q/√d,
dK_j/dV_j travelling with K_j/V_j around the ring (one batched transfer, each in its own dtype) and
reaching their owner after the last step. Each block is cut as the forward cut it (its rows,
columns and whether it needs a mask are kept; `BlockMask.replan`), so the backward reads no index
back to the host.

Load balance. `BlockMask` says which (query, key) pairs may attend, from the global positions
(causal, --window-size) and an optional dense mask's columns. Each block is cut to the query
rows and key columns with at least one allowed pair: with the chunks r and 2c-1-r of
context_parallel/sharding.py, a block from an earlier rank needs only its first chunk (all
queries see it whole: no mask), one from a later rank only this rank's second chunk — half a
block each, as Megatron-LM/Transformer Engine's ring — and the own block its causal mask. A
sliding window skips blocks wholly outside it. Packed documents (--reset-attention-mask) add
their same-document rule from per-token document ids (`BlockMask.doc_ids`; no dense mask).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


class BlockMask:
    """Which local queries may attend which keys of ring member j. q_pos [sq]: the queries' global
    positions; kv_pos [p, L]: ring member j's keys'; window: keys at most this many positions
    back (None: all earlier ones); dense [B, 1, sq, p·L] bool (B = 1 or the batch): a further
    mask, its columns ring member by ring member (the gathered order of allgather's masks);
    doc_ids [B, s]: packed documents (documents.py), every token's document in sequence order, a
    pair allowed only within one document (no dense mask)."""

    def __init__(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None = None,
                 dense: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None):
        self.q_pos, self.kv_pos, self.window, self.dense = q_pos, kv_pos, window, dense
        self.doc_ids = doc_ids
        self.q_doc = None if doc_ids is None else doc_ids[:, q_pos].unsqueeze(2)  # [B, sq, 1], every block's

    def block(self, j: int) -> torch.Tensor:
        """[B, sq, L] bool, True: may attend."""
        distance = self.q_pos.unsqueeze(1) - self.kv_pos[j].unsqueeze(0)
        allowed = distance >= 0
        if self.window is not None:
            allowed &= distance <= self.window
        allowed = allowed.unsqueeze(0)
        if self.dense is not None:
            n = self.kv_pos.size(1)
            allowed = allowed & self.dense[:, 0, :, j * n:(j + 1) * n]
        if self.doc_ids is not None:
            allowed = allowed & (self.q_doc == self.doc_ids[:, self.kv_pos[j]].unsqueeze(1))
        return allowed

    def plan(self, j: int):
        """(rows, cols, mask) of block j cut to the rows and columns with an allowed pair, mask
        [B, 1, 1, rows, cols] or None where every pair in the cut is allowed; None: nothing."""
        allowed = self.block(j)
        any_ = allowed.any(0)
        rows, cols = any_.any(1).nonzero().squeeze(1), any_.any(0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        cut = allowed[:, rows][:, :, cols]
        return rows, cols, (None if bool(cut.all()) else cut[:, None, None])

    def replan(self, j: int, found) -> tuple | None:
        """plan(j) again from what the forward's plan found (`found`: rows, cols, whether a mask;
        None: nothing), for the backward: no index or all() read back to the host, the block's
        mask rebuilt only where one is needed (keeping every block's would cost O(s²/c))."""
        if found is None:
            return None
        rows, cols, masked = found
        return rows, cols, (self.block(j)[:, rows][:, :, cols][:, None, None] if masked else None)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp with -inf (a row that sees no key yet) as 0: exp(-inf - 0) = 0, never nan."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _scores(qs, ks, scale, mask):
    """[b, g, r, R, C] fp32 scores of queries qs [b, g, r, R, hn] against keys ks [b, g, C, hn]."""
    s = torch.matmul(qs.float(), ks.float().unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _attend(q, k, v, plan, scale, out, lse) -> None:
    """Merge one block's partial output into out [b, g, r, sq, hn] and lse [b, g, r, sq] (fp32)."""
    rows, cols, mask = plan
    s = _scores(q.index_select(3, rows), k.index_select(2, cols), scale, mask)
    l_blk = torch.logsumexp(s, dim=-1)
    o_blk = torch.matmul(torch.exp(s - _safe(l_blk).unsqueeze(-1)), v.index_select(2, cols).float().unsqueeze(2))
    l_old, o_old = lse.index_select(3, rows), out.index_select(3, rows)
    l_new = torch.logaddexp(l_old, l_blk)
    l_ref = _safe(l_new)
    merged = o_old * torch.exp(l_old - l_ref).unsqueeze(-1) + o_blk * torch.exp(l_blk - l_ref).unsqueeze(-1)
    out.index_copy_(3, rows, merged)
    lse.index_copy_(3, rows, l_new)


def _attend_backward(q, k, v, dout, delta, lse, plan, scale, dq, dkv) -> None:
    """One block's dQ (into dq [b, g, r, sq, hn]) and dK, dV (into dkv [2, b, g, L, hn]), fp32."""
    rows, cols, mask = plan
    qs, ks, vs = q.index_select(3, rows).float(), k.index_select(2, cols).float(), v.index_select(2, cols).float()
    p = torch.exp(_scores(qs, ks, scale, mask) - _safe(lse.index_select(3, rows)).unsqueeze(-1))  # [b, g, r, R, C]
    dos = dout.index_select(3, rows)
    dv = torch.matmul(p.transpose(-1, -2), dos).sum(2)  # GQA: summed over the group's query heads
    ds = p * (torch.matmul(dos, vs.unsqueeze(2).transpose(-1, -2)) - delta.index_select(3, rows).unsqueeze(-1))
    dq.index_add_(3, rows, torch.matmul(ds, ks.unsqueeze(2)) * scale)
    dkv[0].index_add_(2, cols, torch.matmul(ds.transpose(-1, -2), qs).sum(2) * scale)
    dkv[1].index_add_(2, cols, dv)


def _pass_on(tensors: list, group):
    """Post: send `tensors` to the next ring member, receive the previous one's, in one batch of
    transfers (each tensor in its own dtype). (buffers, handle)."""
    ranks = dist.get_process_group_ranks(group)
    me, p = comm.group_rank(group), len(ranks)
    buffers = [torch.empty_like(t) for t in tensors]
    ops = []
    for t, buffer in zip(tensors, buffers):
        ops += [dist.P2POp(dist.isend, t, ranks[(me + 1) % p], group),
                dist.P2POp(dist.irecv, buffer, ranks[(me - 1) % p], group)]
    return buffers, comm.exchange_async(ops)


class _RingAttention(torch.autograd.Function):
    """q [sq, b, g, r, hn] (g key/value heads, r query heads each), k/v [L, b, g, hn] -> the
    attention output [sq, b, g, r, hn] over every ring member's keys. Kept for backward: q (a view
    of the caller's), the stacked K/V this rank sends, the output (the caller's context is a view
    of it) and the fp32 log-sum-exp: one process's Q, K, V and context, O(s/c)."""

    @staticmethod
    def forward(ctx, q_in, k, v, mask: BlockMask, group):
        p, me = comm.group_size(group), comm.group_rank(group)
        q = q_in.permute(1, 2, 3, 0, 4)  # [b, g, r, sq, hn], a view
        scale = q.size(-1) ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)])  # [2, b, g, L, hn]
        mine, found = kv, []
        for i in range(p):
            pending = _pass_on([kv], group) if i < p - 1 else None
            plan = mask.plan((me - i) % p)
            found.append(None if plan is None else (plan[0], plan[1], plan[2] is not None))
            if plan is not None:
                _attend(q, kv[0], kv[1], plan, scale, out, lse)
            if pending is not None:
                pending[1].wait()
                kv = pending[0][0]
        out = out.permute(3, 0, 1, 2, 4).to(q.dtype).contiguous()  # [sq, b, g, r, hn]
        ctx.save_for_backward(q_in, mine, out, lse)
        ctx.mask, ctx.found, ctx.group, ctx.scale = mask, found, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q_in, kv, out, lse = ctx.saved_tensors
        q = q_in.permute(1, 2, 3, 0, 4)
        group, p, me = ctx.group, comm.group_size(ctx.group), comm.group_rank(ctx.group)
        dout = dout.float().permute(1, 2, 3, 0, 4)  # [b, g, r, sq, hn]
        delta = (dout * out.float().permute(1, 2, 3, 0, 4)).sum(-1)  # rowsum(dO ∘ O) [b, g, r, sq]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for i in range(p):
            plan = ctx.mask.replan((me - i) % p, ctx.found[i])
            if plan is not None:
                _attend_backward(q, kv[0], kv[1], dout, delta, lse, plan, ctx.scale, dq, dkv)
            if i < p - 1:  # the keys and their gradients so far move on together
                received, handle = _pass_on([kv, dkv], group)
                handle.wait()
                kv, dkv = received
            elif p > 1:  # the last step's gradients go home: the next rank owns this block
                received, handle = _pass_on([dkv], group)
                handle.wait()
                (dkv,) = received
        dk, dv = (t.permute(2, 0, 1, 3).to(kv.dtype) for t in dkv)  # [L, b, g, hn]
        return dq.permute(3, 0, 1, 2, 4).to(q.dtype), dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, group) -> torch.Tensor:
    """q [sq, b, n, hn], k/v [L, b, g, hn] (this rank's, g | n) -> [sq, b, n·hn]: exact attention
    of the local queries over the keys of every member of `group` (a ring; size 1: local only)."""
    sq, b, n, hn = q.shape
    g = k.size(2)
    out = _RingAttention.apply(q.reshape(sq, b, g, n // g, hn), k, v, mask, group)  # heads are grouped: [g, n/g]
    return out.view(sq, b, n * hn)
