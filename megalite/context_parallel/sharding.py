"""Load-balanced sharding of each sequence over the CP group (chunks r and 2c-1-r) and the
masks and positions that go with it; the design is in context_parallel/__init__.py."""
from __future__ import annotations

import torch

from .documents import Documents


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
    ([b, 1, s, s] -> [b, 1, s/c, s]: its queries' rows, the columns in gathered key order), or the
    packed `Documents`: the whole sequence's document ids, its queries' sequence indices and the
    gathered keys'.

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
    if isinstance(mask, Documents):
        mask = Documents(mask.doc_ids, idx, gathered_positions(s, cp_size, device), mask.window)
    elif mask is not None:
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
