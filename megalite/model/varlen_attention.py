"""Attention within packed documents, blockwise, without an [s, s] mask (--reset-attention-mask).

Query i may see key j when both belong to the same document, j is not later than i in the
sequence, and (with a sliding window w) i - j <= w. Those three facts come from per-token
document ids and sequence indices, so no [s, s] mask is ever built: the scores are computed a
[block, block] tile at a time with the online softmax of FlashAttention (Dao et al. 2022,
Alg. 1; Milakov & Gimelshein 2018), tiles in which no pair may attend are skipped, and the
backward recomputes each tile's probabilities from the saved log-sum-exp (FlashAttention
Alg. 2) instead of keeping them. Memory is q, k, v, the output and the log-sum-exp (linear in
s) plus one tile; work is proportional to the tiles that hold any allowed pair (for short
documents, ~ s x document length instead of s²/2).

Keys need not be in sequence order: under context parallelism they arrive in the CP layout
(context_parallel/sharding.py) and their sequence indices say where each belongs. The
log-sum-exp is returned (and differentiable) so that partial results over different key sets
can be merged exactly (ring attention's per-step blocks): with out_a, lse_a and out_b, lse_b,
lse = logaddexp(lse_a, lse_b) and out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse).
"""
from __future__ import annotations

import math

import torch

from ..context_parallel.documents import Documents, may_attend

BLOCK = 256  # tile edge: [b, n, 256, 256] fp32 scores per tile (2 MiB at b·n = 8), 1k tile steps at 8k


def _tiles(q_doc, k_doc, q_pos, k_pos, window, block, dtype):
    """Yield (q slice, k slice, allowed [b, 1, 1, bq, bk] as 1.0 / 0.0 in `dtype`, or None when all
    may attend) for every tile with at least one allowed pair; q blocks outer."""
    sq, sk = q_pos.numel(), k_pos.numel()
    for i in range(0, sq, block):
        qs = slice(i, min(i + block, sq))
        for j in range(0, sk, block):
            ks = slice(j, min(j + block, sk))
            ok = may_attend(q_doc[:, qs], k_doc[:, ks], q_pos[qs], k_pos[ks], window)
            if not ok.any():
                continue
            yield qs, ks, (None if ok.all() else ok[:, None, None].to(dtype))


def _exp(shifted: torch.Tensor, allowed) -> torch.Tensor:
    """exp of a tile's scores minus their row's max (or log-sum-exp), in place, 0 where not allowed.
    Clamped at -80 first: results below fp32's normal range take a slow path on CPUs (~10x);
    exp(-80) ≈ 2e-35 changes no sum that holds the row's max term exp(0) = 1."""
    p = shifted.clamp_(min=-80.0).exp_()
    return p if allowed is None else p.mul_(allowed)


def _dropout_keep(seed: int, tile: int, shape, p: float, device, dtype) -> torch.Tensor:
    """The tile's dropout factor (0 or 1/(1-p)), drawn from its own generator so that backward
    redraws exactly the forward's without storing it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + tile)
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.to(dtype) / (1.0 - p)


class _DocumentAttention(torch.autograd.Function):
    """q [b, g, r, sq, d], k [b, g, sk, d], v [b, g, sk, dv] (g kv groups of r query heads each)."""

    @staticmethod
    def forward(ctx, q, k, v, q_doc, k_doc, q_pos, k_pos, window, scale, dropout_p, seed, block):
        b, g, r, sq, _ = q.shape
        dtype = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 at least
        if q.is_meta:  # a dry run (megalite.dry_run): the shapes and what is kept, nothing computed
            out = v.new_empty(sq, b, g, r, v.size(-1)).permute(1, 2, 3, 0, 4)
            lse = q.new_empty(b, g, r, sq, dtype=dtype)
            ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc, q_pos, k_pos)
            return out, lse
        acc = q.new_zeros(b, g, r, sq, v.size(-1), dtype=dtype)
        m = q.new_full((b, g, r, sq), float("-inf"), dtype=dtype)
        denom = q.new_zeros(b, g, r, sq, dtype=dtype)
        for t, (qs, ks, allowed) in enumerate(_tiles(q_doc, k_doc, q_pos, k_pos, window, block, dtype)):
            p = _scores(_rows(q[:, :, :, qs]), k[:, :, ks], scale, allowed, r)  # [b, g, r, bq, bk]; exp in place
            m_new = torch.maximum(m[..., qs], p.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with nothing allowed yet
            p = _exp(p.sub_(m_safe.unsqueeze(-1)), allowed)
            correction = torch.exp(m[..., qs] - m_safe)
            denom[..., qs] = denom[..., qs] * correction + p.sum(-1)
            if dropout_p > 0:
                p = p.mul_(_dropout_keep(seed, t, p.shape, dropout_p, p.device, p.dtype))
            pv = _matmul(_rows(p), v[:, :, ks]).view(acc[..., qs, :].shape)
            acc[..., qs, :] = acc[..., qs, :] * correction.unsqueeze(-1) + pv
            m[..., qs] = m_new
            del p
        empty = denom == 0  # queries that may see no key here (possible for a partial key set)
        acc /= denom.masked_fill(empty, 1.0).unsqueeze(-1)
        lse = (m.masked_fill(empty, 0.0) + denom.masked_fill(empty, 1.0).log()).masked_fill(empty, float("-inf"))
        # laid out [sq, b, g, r, dv] in memory: the layer's [s, b, n·dv] view of it is free (no copy
        # kept beside the one saved here)
        out = v.new_empty(sq, b, g, r, v.size(-1)).permute(1, 2, 3, 0, 4).copy_(acc)
        del acc
        ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc, q_pos, k_pos)
        ctx.args = (window, scale, dropout_p, seed, block)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, q_doc, k_doc, q_pos, k_pos = ctx.saved_tensors
        if q.is_meta:
            return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) + (None,) * 9
        window, scale, dropout_p, seed, block = ctx.args
        r = q.size(2)
        # dS = P ∘ (dP - D) with D = rowsum(dO ∘ O) (FlashAttention Alg. 2); the log-sum-exp's own
        # gradient adds P·dlse, since ∂lse/∂s_ij = P_ij
        dtype = lse.dtype
        delta = (d_out.to(dtype) * out.to(dtype)).sum(-1)
        if d_lse is not None:
            delta = delta - d_lse
        dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
        lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)
        for t, (qs, ks, allowed) in enumerate(_tiles(q_doc, k_doc, q_pos, k_pos, window, block, dtype)):
            q_t, k_t, v_t = _rows(q[:, :, :, qs]), k[:, :, ks], v[:, :, ks]  # q's heads folded into rows
            do_t = _rows(d_out[:, :, :, qs]).to(dtype)
            p = _exp(_scores(q_t, k_t, scale, allowed, r).sub_(lse_safe[..., qs].unsqueeze(-1)), allowed)
            dp = _matmul(do_t, v_t.transpose(-2, -1)).view(p.shape)  # [b, g, r, bq, bk]
            if dropout_p > 0:
                keep = _dropout_keep(seed, t, p.shape, dropout_p, p.device, p.dtype)
                dv[:, :, ks] += _matmul(_rows(p * keep).transpose(-2, -1), do_t)  # summed over the r heads
                dp.mul_(keep)
                del keep
            else:
                dv[:, :, ks] += _matmul(_rows(p).transpose(-2, -1), do_t)
            ds = _rows(dp.sub_(delta[..., qs].unsqueeze(-1)).mul_(p).mul_(scale))  # in dp's place
            del p
            dq[:, :, :, qs] += _matmul(ds, k_t).view(dq[:, :, :, qs].shape)
            dk[:, :, ks] += _matmul(ds.transpose(-2, -1), q_t)
            del ds, dp
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 9


def _matmul(a, b):
    """In fp32 at least (fp64 stays fp64)."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return torch.matmul(a.to(dtype), b.to(dtype))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[b, g, r, bq, c] -> [b, g, r·bq, c]: a kv group's r query heads as rows of one GEMM (no
    broadcast batch of r small ones; copies only a non-contiguous tile)."""
    b, g, r, bq, c = x.shape
    return x.reshape(b, g, r * bq, c)


def _scores(q_rows, k, scale, allowed, r):
    """Q·Kᵀ·scale of a tile in fp32 at least, [b, g, r, bq, bk] (q_rows [b, g, r·bq, d], k [b, g, bk, d]),
    lowered by 1e9 where not `allowed`: finite, so no -inf reaches a kernel's slow path; such a
    pair never sets a row's max over an allowed one, and `_exp` zeroes it. (A row with no allowed
    pair yet takes a max near -1e9, which the first allowed pair's rescaling exp(m_old - m_new) = 0
    discards with its zero sums.)"""
    b, g, rows, _ = q_rows.shape
    scores = _matmul(q_rows, k.transpose(-2, -1)).mul_(scale).view(b, g, r, rows // r, k.size(2))
    return scores if allowed is None else scores.add_((allowed - 1.0) * 1e9)


@torch.compiler.disable  # data-dependent tile skipping: eager under --compile
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                       dropout_p: float = 0.0, scale: float | None = None,
                       block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q·Kᵀ·scale + document mask)·V for q [b, n, sq, d], k [b, g, sk, d], v [b, g, sk, dv]
    (GQA: query head h uses kv group h // (n/g)), the mask implied by `documents` (causal within
    each document, optional window). Returns (out [b, n, sq, dv] in v's dtype, lse [b, n, sq] fp32,
    -inf for a query that may see none of these keys, whose output is 0). Softmax and accumulation
    run in fp32 whatever the inputs' dtype. Attention dropout (probability `dropout_p`) draws one
    seed from the current default generator (so the TP rng tracker's fork gives ranks their own)."""
    b, n, sq, d = q.shape
    g = k.size(1)
    if n % g:
        raise ValueError(f"{n} query heads cannot share {g} key-value groups evenly")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    seed = int(torch.randint(0, 2 ** 62, (1,), device=q.device).item()) if dropout_p > 0 and not q.is_meta else 0
    q_doc = documents.doc_ids[:, documents.q_index]
    k_doc = documents.doc_ids[:, documents.k_index]
    out, lse = _DocumentAttention.apply(q.reshape(b, g, n // g, sq, d), k, v, q_doc, k_doc, documents.q_index,
                                        documents.k_index, documents.window, scale, dropout_p, seed, block)
    return out.reshape(b, n, sq, v.size(-1)), lse.reshape(b, n, sq)
