"""The largest pre-softmax attention logit of each head, tracked during forward for --qk-clip.

QK-clip (Kimi K2, arXiv 2507.20534, Sec. 2.1) needs S_max^h = max over a step's queries i and the
keys j they may attend to of q_i^h · k_j^h / √d, per head h. The attention kernels (SDPA,
flash-attn) never show the logits, so `MaxLogitTracker.observe` computes them again from the q
and k the kernel receives (after QK-norm and RoPE; under context parallelism this rank's queries
against the gathered keys, in gathered order, with the same mask), under no_grad and in chunks of
query rows: the extra memory is one [b, n, rows, s_k] block of at most CHUNK_ELEMENTS fp32
values, linear in the sequence, never the s² scores. It runs only when --qk-clip is on and only
in training.

The running value is a maximum, so a forward that runs twice over the same input (activation
recompute's second forward inside backward) leaves it as it was: nothing is double counted, and
nothing is lost because the first forward already observed. Shapes: q [s, b, n, hn] (this
rank's n heads), k [s_k, b, g, hn] (its g query groups, n/g heads each, heads of a group
adjacent as in the fused QKV layout), mask None (causal, aligned top-left), boolean (True: may
attend) or additive (0 / -inf), [b or 1, 1, s, s_k] or [s, s_k] (context parallelism's), or packed
documents' `Documents` (--reset-attention-mask; each chunk's rows of its mask built on the spot).
"""
from __future__ import annotations

import math

import torch

from ..context_parallel.documents import Documents

CHUNK_ELEMENTS = 1 << 22  # fp32 scores per block: 16 MiB


class MaxLogitTracker:
    """Per-head running maximum of the scaled attention logits of one attention layer's local heads."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.value: torch.Tensor | None = None  # [n] fp32, None until the first forward

    def reset(self) -> None:
        self.value = None

    def read(self, device) -> torch.Tensor:
        """The maxima so far ([n] fp32; -inf for a layer that saw no forward)."""
        if self.value is None:
            return torch.full((self.num_heads,), float("-inf"), dtype=torch.float32, device=device)
        return self.value

    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor, attention_mask=None) -> None:
        s, b, n, hn = q.shape
        qb = q.permute(1, 2, 0, 3).float()  # [b, n, s, hn]
        kb = k.permute(1, 2, 0, 3).float().repeat_interleave(n // k.size(2), dim=1)  # [b, n, s_k, hn]
        sk, scale = kb.size(2), 1.0 / math.sqrt(hn)
        rows = max(1, CHUNK_ELEMENTS // (b * n * sk))
        best = torch.full((n,), float("-inf"), dtype=torch.float32, device=q.device)
        for lo in range(0, s, rows):
            hi = min(s, lo + rows)
            scores = torch.matmul(qb[:, :, lo:hi], kb.transpose(-2, -1)) * scale  # [b, n, rows, s_k]
            scores = _masked(scores, attention_mask, lo, hi)
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
        self.value = best if self.value is None else torch.maximum(self.value, best)


def _masked(scores: torch.Tensor, attention_mask, lo: int, hi: int) -> torch.Tensor:
    """Query rows [lo, hi) of the scores with what they may not attend to at -inf."""
    if attention_mask is None:  # causal, query i sees keys 0..i
        q_pos = torch.arange(lo, hi, device=scores.device).unsqueeze(1)
        k_pos = torch.arange(scores.size(-1), device=scores.device).unsqueeze(0)
        return scores.masked_fill(k_pos > q_pos, float("-inf"))
    if isinstance(attention_mask, Documents):  # packed documents: these rows' mask only (linear in s)
        return scores.masked_fill(~attention_mask.with_queries(attention_mask.q_index[lo:hi]).dense(), float("-inf"))
    rows = attention_mask[..., lo:hi, :] if attention_mask.size(-2) > 1 else attention_mask
    if rows.dtype == torch.bool:
        return scores.masked_fill(~rows, float("-inf"))
    return scores + rows.float()
