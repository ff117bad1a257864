"""Attention activations per rank under each --cp-comm-type (context_parallel/): what one layer's
attention block keeps for backward, in values per token of this rank's s/c (h = hidden / TP,
n query and g key/value heads per TP rank, kv = h·g/n; measured by
benchmarks/bench_context_parallel.py --types, which these reproduce):

  one process  3h + 2kv          the QKV input, Q, K, V, the kernel's output (= the context)
  allgather    3h + 2kv·c        K and V of the whole sequence (c x this rank's)
  a2a          4h + 2kv·g'/g     Q, K, V of the whole sequence for n/c heads, in sequence order
                                 (g' = max(g, c): kv heads replicated when fewer than c), the
                                 kernel's output and the context after the all-to-all back
  p2p          3h + 2kv          as one process: Q, the K/V it sends round the ring, the ring's
                                 output (the context is a view of it)
  a2a+p2p      4h + 4kv·g'/g     a2a's exchanged Q, K, V (g' = max(g, A), A the first level; Q a
                                 view of it), the ring's stacked K/V, its output, and the context
                                 after the all-to-all back
plus n fp32 log-sum-exp values per token (fused kernels and the ring), and for allgather and a2a
with an unfused kernel the scores (s/c x s for n heads, or s x s for n/c: the same count).
p2p and a2a+p2p keep O(s/c) per rank at any length; allgather's K and V grow with s; allgather
also holds one [s/c, s] fp32 causal mask per micro-batch (shared by its layers; not counted here).
"""
from __future__ import annotations


def attention_values(cp_type: str, c: int, h: float, heads: int, groups: int, a2a: int | None = None) -> float:
    """Values per local token one layer's attention block keeps (the table above, lse excluded)."""
    kv = h * groups / heads
    if c == 1:
        return 3 * h + 2 * kv
    if cp_type == "allgather":
        return 3 * h + 2 * kv * c
    level = c if cp_type == "a2a" else (a2a or c)
    kv_exchanged = 2 * kv * max(groups, level) / groups
    if cp_type == "a2a":
        return 4 * h + kv_exchanged
    if cp_type == "p2p":
        return 3 * h + 2 * kv
    if cp_type == "a2a+p2p":
        return 4 * h + 2 * kv_exchanged
    raise ValueError(f"unknown --cp-comm-type {cp_type!r}")


def keeps_scores(cp_type: str, c: int) -> bool:
    """Whether an unfused kernel keeps the s² scores (the ring rebuilds each block's in backward)."""
    return c == 1 or cp_type in ("allgather", "a2a")


def cp_attention_terms(cp_type: str, c: int, heads: int, groups: int, h: int, a2a: int | None = None) -> tuple[float, bool]:
    """(planning/memory.py's coefficient beyond its one-process Q, K, V and context, in bytes per
    token and hidden unit at 16-bit; whether the scores are kept). allgather keeps memory.py's
    own 4·(g/a)·c (the local and the gathered K/V)."""
    if c == 1:
        return 0.0, True
    if cp_type == "allgather":
        return 4 * groups / heads * c, True
    extra = (attention_values(cp_type, c, h, heads, groups, a2a) - attention_values(cp_type, 1, h, heads, groups)) * 2 / h
    return extra + (4 * heads / h if not keeps_scores(cp_type, c) else 0.0), keeps_scores(cp_type, c)


def attention_activation_bytes(cp_type: str, s: int, b: int, h: int, heads: int, groups: int, c: int,
                               a2a: int | None = None, dtype_bytes: int = 2) -> float:
    """Bytes one layer's attention block keeps for backward on one rank (no TP) with a fused
    kernel: the table's values and the fp32 log-sum-exp."""
    return s / c * b * (attention_values(cp_type, c, h, heads, groups, a2a) * dtype_bytes + 4 * heads)
