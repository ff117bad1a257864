"""Context parallelism (CP): each rank of a CP group holds 1/c of every sequence, and attention
stays exact across the group.

Chunk order. A causal mask makes late queries cost more than early ones, so giving rank r the
r-th contiguous 1/c of the sequence would leave the last rank with most of the work. As
Megatron-LM's CP (and Liu et al. 2023's striped/zig-zag variants of ring attention), the
sequence is cut into 2·c chunks and rank r takes chunks r and 2c-1-r: every rank gets one early
and one late chunk, the same number of (query, key) pairs under the causal mask.

Attention. Every rank all-gathers the keys and values of the whole sequence (forward), computes
exact softmax(Q·Kᵀ)·V of its local queries against all keys with a mask built from the global
positions (causal, and same-document under --reset-attention-mask), and the all-gather's
backward reduce-scatters dK/dV back to their owners. This is the all-gather form of CP used for
Llama 3 (Llama 3 paper, Sec. 3.3.2; Megatron-LM's cp_comm_type "all_gather"), chosen over ring
attention with online softmax (Liu et al. 2023; Megatron-LM's "p2p") because:
  - it is exact in one pass with any mask: document masks (--reset-attention-mask) need no
    per-step block bookkeeping, and any attention kernel that takes a mask works unchanged;
  - GQA stays simple and cheap: the kv heads are gathered before they are expanded, so the
    traffic is 2·s·g·hn per layer, not 2·s·n·hn;
  - on gloo/CPU there is no compute to overlap a ring's sends with, so the ring's one real
    advantage (overlap, O(s/c) K/V memory) buys nothing here.
Its cost: O(s) keys and values per rank per layer (not O(s/c)); every other activation (the
[s/c, b, h] residual stream, MLP, norms, logits, the [s/c, s] scores) still divides by c.

The gathered keys are laid out in rank order (rank 0's two chunks, then rank 1's, ...), not in
sequence order: instead of permuting them, the mask's columns follow the same order
(`gathered_positions`).
"""
from __future__ import annotations

import torch

from .. import comm


def chunk_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions [s/c] of the tokens CP rank `cp_rank` holds: chunks r and 2c-1-r of the
    sequence cut into 2c chunks (load-balanced order)."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x the CP size {cp_size}")
    n = seq_length // (2 * cp_size)
    first, second = cp_rank * n, (2 * cp_size - 1 - cp_rank) * n
    return torch.cat([torch.arange(first, first + n, device=device), torch.arange(second, second + n, device=device)])


def gathered_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [s] of the keys after the all-gather over the CP group (rank order)."""
    return torch.cat([chunk_positions(seq_length, cp_size, r, device) for r in range(cp_size)])


def slice_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a micro-batch from data.batch.build_batch: tokens, labels, loss
    mask and position ids ([b, s] -> [b, s/c], its two chunks); the attention mask
    ([b, 1, s, s] -> [b, 1, s/c, s]: its queries' rows, the columns in gathered key order).

    `num_tokens_sequence` keeps the loss-token count of the whole micro-batch: Megatron-LM's
    per-micro-batch mean loss divides by it on every CP rank, so the CP ranks' partial sums add
    up to the whole sequence's mean (every CP rank holds the full micro-batch, so no collective
    is needed to count)."""
    if cp_size == 1:
        return batch
    s = batch["input_ids"].size(1)
    device = batch["input_ids"].device
    idx = chunk_positions(s, cp_size, cp_rank, device)
    out = {k: batch[k][:, idx].contiguous() for k in ("input_ids", "labels", "loss_mask", "position_ids")}
    out["num_tokens_sequence"] = batch["loss_mask"].sum()
    mask = batch["attention_mask"]
    if mask is not None:
        mask = mask[:, :, idx][:, :, :, gathered_positions(s, cp_size, device)].contiguous()
    out["attention_mask"] = mask
    return out


def causal_mask(local_seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """[s/c, s] bool (True: may attend): local queries against the gathered keys, causal in the
    global positions."""
    s = local_seq_length * cp_size
    q = chunk_positions(s, cp_size, cp_rank, device)
    k = gathered_positions(s, cp_size, device)
    return q.unsqueeze(1) >= k.unsqueeze(0)


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


def gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence ([s, b, g, hn], gathered key order) from this
    rank's [s/c, b, g, hn]. One collective for both (concatenated on the head dimension)."""
    g = k.size(2)
    kv = _GatherKV.apply(torch.cat([k, v], dim=2), group)
    return kv[:, :, :g], kv[:, :, g:]
