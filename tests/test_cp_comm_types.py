"""--cp-comm-type p2p (ring), a2a (Ulysses) and a2a+p2p (hierarchical) compute full attention exactly.

- one spawn of 4 gloo ranks runs p2p at CP 2 (two groups of 2) and CP 4, a2a at CP 4, a2a+p2p as 2 x 2
  against one process's attention on the whole sequence: output and the gradients of q, k and v,
  causal, with a sliding window, with packed documents (their ids) and with allgather's dense
  causal mask, with GQA (key/value heads split over the a2a ranks, and replicated when fewer);
- the ring's load balance: with the causal chunk order each rank computes the same number of
  (query, key) pairs, half of each block from another rank;
- pretrain_gpt.py trains the same model as one process with each type (CP 2, CP 4, 2 x 2, with
  TP 2 and PP 2; RoPE and GQA) on the bundled corpus: one pool run per layout;
- bad inputs are refused with one line naming the flag.
"""
import pytest
import torch

from dist_helpers import assert_layout_matches, assert_loss_falls, run_reference, spawn, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.context_parallel.ring import BlockMask
from megalite.context_parallel.sharding import chunk_positions
from megalite.data.batch import build_batch
from tiny import tiny
from tolerances import assert_close_fp32

S, B, N, HN = 32, 2, 4, 8
# CP 2 (two groups of 2) for the ring's two-member case with every mask; CP 2's kv-head split for
# a2a trains in the PP 2 layout below
CASES = [("p2p", 2), ("p2p", 4), ("a2a", 4), ("a2a+p2p", 4)]
# "dense": the additive causal mask in gathered key order that GPTModel builds when some layer is
# allgather (a mixed per-layer --cp-comm-type hands it to the p2p and a2a layers too)
MASKS = ("causal", "window", "documents", "dense")


def _reference(q, k, v, w, mask_kind):
    from megalite.context_parallel.attention import window_mask
    from megalite.model import ExecutionConfig
    from megalite.model.attention import CoreAttention
    attention = CoreAttention(0.0, ExecutionConfig(), None)
    mask = _full_mask(mask_kind)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask is not None:
        mask = mask[0]["attention_mask"] if mask_kind == "documents" else mask[0]
    out = attention(*ref, mask)
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
    return None  # causal, and "dense" (the same function)


def _worker(rank, world):
    import torch.distributed as dist

    from megalite.context_parallel.attention import ring_layer_attention, ulysses_attention
    from megalite.context_parallel.sharding import causal_mask, slice_batch
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
        for kind in MASKS if g == 2 else ("causal",):  # one kv head: a2a over 4 ranks replicates it
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
                elif kind == "dense":
                    allowed = causal_mask(S // cp, cp, cp_rank)
                    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
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


# blocks merged by online softmax sum in another order than the whole sequence (tolerances.py):
# forward QK^T (8 terms), the softmax and PV (32 positions); backward, a key's or value's gradient
# sums the 32 queries of each of the (up to 4) heads that share it; five reductions in a row
ATTENTION_ROUNDING = dict(k=S * N, chain=5)


def test_every_type_equals_full_attention():
    """GQA with 2 and with 1 key/value head (a2a over 4 ranks replicates them); causal, window, documents."""
    for rank, results in enumerate(spawn(_worker, 4)):
        assert len(results) == (len(MASKS) + 1) * len(CASES)
        for key, pairs in results.items():
            for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
                assert_close_fp32(got, want, **ATTENTION_ROUNDING, msg=f"rank {rank} {key} {what}")


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


# -- pretrain_gpt.py: each type trains the one-process model (RoPE, GQA, on the bundled corpus) ---------
MODEL = tiny(num_layers=2, seq_length=64, lr=3e-3, train_iters=5, log_interval=1, eval_iters=0,
             eval_interval=100) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--adam-eps", "1e-4",
    "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
    "--disable-bias-linear", "--normalization", "RMSNorm"]
CP2, CP4, TP2 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"], ["--tensor-model-parallel-size", "2"]
LAYOUTS = {  # id: (processes, flags); CP 2 is in the TP 2 and PP 2 layouts (a2a in PP 2's second stage)
    "p2p-cp4": (4, CP4 + ["--cp-comm-type", "p2p"]),
    "a2a-cp4-kv-replicated": (4, CP4 + ["--cp-comm-type", "a2a"]),
    "a2a+p2p-2x2": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
    "p2p-tp2-cp2-sp": (4, TP2 + CP2 + ["--cp-comm-type", "p2p", "--sequence-parallel"]),
    # one type per layer: layer 0 (stage 0) p2p, layer 1 (stage 1) a2a
    "p2p-a2a-per-layer-pp2-cp2": (4, CP2 + ["--pipeline-model-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"]),
}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    ref = run_reference(corpus + MODEL, tmp_path_factory.mktemp("reference"))
    assert_loss_falls(train_losses(ref.records), 0.2)
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_comm_type_trains_as_one_process(reference, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    assert_layout_matches(reference, nproc, flags, tmp_path, {"lm_loss": 1e-5, "grad_norm": 1e-5})


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "64", "--attention-dropout", "0"]


@pytest.mark.parametrize("flags, world, message", [
    (CP4 + ["--cp-comm-type", "a2a+p2p"], 4, "needs --hierarchical-context-parallel-sizes"),
    (CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"], 4,
     r"--hierarchical-context-parallel-sizes 2 3: need two sizes .* product is --context-parallel-size \(4\)"),
    (CP4 + ["--cp-comm-type", "p2p", "--hierarchical-context-parallel-sizes", "2", "2"], 4, "used only by"),
    (CP2 + ["--cp-comm-type", "p2p", "a2a", "p2p"], 2, r"one per layer \(--num-layers 2\); got 3"),
    (CP4 + ["--cp-comm-type", "a2a", "--num-attention-heads", "2", "--hidden-size", "32"], 4,
     r"--num-attention-heads \(2\) / TP \(1\) = 2 heads per rank cannot split over the 4"),
    (CP4 + ["--cp-comm-type", "a2a", "--num-attention-heads", "12", "--hidden-size", "48", "--group-query-attention",
            "--num-query-groups", "6"], 4, r"--num-query-groups \(6\) .* neither split over nor divide the 4"),
    (CP2 + ["--cp-comm-type", "p2p", "--attention-dropout", "0.1"], 2, "--attention-dropout 0"),
    (CP2 + ["--cp-comm-type", "a2a", "--softmax-type", "off-by-one"], 2, "--softmax-type off-by-one"),
    (CP2 + ["--cp-comm-type", "p2p", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8", "--position-embedding-type", "rope"],
     2, "multi-latent attention .* runs allgather only"),
])
def test_bad_cp_comm_types_are_refused(flags, world, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(BASE + flags), world)
    # the same layout with the default (allgather) is fine, but for the type-specific flags
    if "--hierarchical-context-parallel-sizes" not in flags and "--cp-comm-type" in flags:
        i = flags.index("--cp-comm-type")
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        validate_args(parse_args(BASE + flags[:i] + flags[j:]), world)


def test_hierarchical_groups_follow_megatron():
    """--hierarchical-context-parallel-sizes 2 2 on TP 2 x CP 4: the first level pairs adjacent CP
    ranks, the second the CP ranks with the same place in their pair (global ranks, TP fastest)."""
    from megalite.parallel_state import RankGrid
    grid = RankGrid(8, tp=2, cp=4)
    assert grid.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    first, second = grid.hierarchical_cp_groups([2, 2])
    assert first == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert second == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.hierarchical_cp_groups(None) == []
