"""ZeRO-2 (optim_grads) and ZeRO-3 (optim_grads_params) compute the same training run as one
process, and save / load / offload / account memory as promised.

Data: conftest's `corpus` (real text, a 512-piece SentencePiece tokenizer), so the loss falls
(random tokens would pin it near ln V).

Equivalence (fp32, dropout 0, 6 iterations, 2 micro-batches per DP rank): lm_loss and the
global gradient norm per iteration equal one process within 1e-5 relative, on DP 2, DP 4,
TP 2 x DP 2 (+ sequence parallel), TP 2 x PP 2 x DP 2 with 1F1B (+ full recompute) and with the
interleaved schedule (+ selective recompute), under ZeRO-2 and ZeRO-3, each layout with
--overlap-grad-reduce --overlap-param-gather under one strategy and without under the other.
Small buckets (--ddp-bucket-size 6000) make DP slices cut through parameters.
"""
import json
import os
import sys

import pytest

from dist_helpers import ROOT, assert_losses_close, grad_norms, run_pretrain, spawn, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny


MODEL = tiny(num_layers=4, seq_length=64, lr=3e-3, train_iters=6, log_interval=1, eval_iters=0) + [
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--ddp-bucket-size", "6000",
         # Adam's default eps (1e-8) turns float rounding in gradient elements that are exactly
         # zero in the reference into steps of ~lr: TP 2 alone (no_shard) then drifts from one
         # process by more than 1e-5 in the gradient norm. tests/test_layouts.py uses 1e-5 too.
         "--adam-eps", "1e-5"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
TP2, PP2, VPP = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], \
    ["--num-layers-per-virtual-pipeline-stage", "1"]
LAYOUTS = {  # name: (processes, flags); micro-batches per DP rank: 2 everywhere
    "dp2": (2, []),
    "dp4": (4, ["--micro-batch-size", "1"]),
    "tp2-dp2-sp": (4, TP2 + ["--sequence-parallel"]),
    "tp2-pp2-dp2-1f1b": (8, TP2 + PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"]),
    "tp2-pp2-dp2-interleaved": (8, TP2 + PP2 + VPP + ["--recompute-activations"]),
}
STRATEGIES = ["optim_grads", "optim_grads_params"]


def strategy(name):
    return ["--data-parallel-sharding-strategy", name]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    records, _ = run_pretrain(1, corpus + MODEL, tmp_path_factory.mktemp("ref"), "ref")
    losses = train_losses(records)
    assert losses[-1] < losses[0] - 0.5, losses  # real text: the loss falls
    return records


# Every layout under both strategies, each once: with and without the overlap flags in turn, so
# each strategy and each layout runs both ways. ZeRO-3 on the interleaved layout with the overlap
# flags is the third run of test_checkpoint_zero3_to_no_shard_and_back (also against the reference).
OVERLAPPED = {"optim_grads": ("dp2", "tp2-dp2-sp", "tp2-pp2-dp2-interleaved"),
              "optim_grads_params": ("dp4", "tp2-pp2-dp2-1f1b")}
CASES = [(s, layout, layout in OVERLAPPED[s]) for s in STRATEGIES for layout in LAYOUTS]


@pytest.mark.parametrize("name,layout,overlap", CASES,
                         ids=[f"{s}-{l}{'-overlap' if o else ''}" for s, l, o in CASES])
def test_matches_single_process(corpus, reference, tmp_path, name, layout, overlap):
    nproc, flags = LAYOUTS[layout]
    records, _ = run_pretrain(nproc, corpus + MODEL + flags + strategy(name) + (OVERLAP if overlap else []), tmp_path)
    assert_losses_close(train_losses(reference), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(reference), grad_norms(records), rtol=1e-5)


def test_checkpoint_zero3_to_no_shard_and_back(corpus, reference, tmp_path):
    """ZeRO-3 on TP2 x PP2 x DP2 saves at iteration 3; no_shard on DP 4 resumes, saves at 5;
    ZeRO-3 on TP2 x PP2 x DP2 (interleaved) resumes to 6: every loss is the straight run's."""
    ck1, ck2 = str(tmp_path / "ck1"), str(tmp_path / "ck2")
    zero3 = corpus + MODEL + TP2 + PP2 + strategy("optim_grads_params")
    first, _ = run_pretrain(8, zero3 + ["--save", ck1, "--exit-interval", "3"], tmp_path, "first")
    second, _ = run_pretrain(4, corpus + MODEL + ["--micro-batch-size", "1", "--load", ck1, "--save", ck2,
                                                  "--exit-interval", "5"], tmp_path, "second")
    meta = json.load(open(os.path.join(ck1, "iter_0000003", "metadata.json")))
    assert meta["layout"]["data_parallel_sharding_strategy"] == "optim_grads_params"
    third, _ = run_pretrain(8, zero3 + VPP + OVERLAP + ["--load", ck2], tmp_path, "third")
    resumed = train_losses(first) + train_losses(second) + train_losses(third)
    assert_losses_close(train_losses(reference), resumed, rtol=1e-5)
    assert_losses_close(grad_norms(reference), grad_norms(first) + grad_norms(second) + grad_norms(third), rtol=1e-5)


# -- bf16: the memory_footprint record against the formula; offload changes nothing ---------------
@pytest.fixture(scope="module")
def bf16_run(corpus, tmp_path_factory):
    """Runs on DP 2 x PP 2 (tied embedding split over stages), bf16, 3 iterations; cached."""
    cache = {}

    def run(name, extra=()):
        key = (name, tuple(extra))
        if key not in cache:
            flags = run.flags + strategy(name) + list(extra)
            cache[key] = run_pretrain(4, flags, tmp_path_factory.mktemp(name), name)[0]
        return cache[key]
    run.flags = corpus + MODEL + PP2 + ["--bf16", "--train-iters", "3"]
    return run


# bytes per parameter with bf16 parameters and Adam: (param, grad, optimizer) x 1/d where sharded
FORMULA = {"no_shard": (2, 4, 12, 1, 1, 1), "optim": (2, 4, 12, 1, 1, 2),
           "optim_grads": (2, 4, 12, 1, 2, 2), "optim_grads_params": (2, 4, 12, 2, 2, 2)}


@pytest.mark.parametrize("name", list(FORMULA))
def test_bf16_memory_footprint_matches_formula(bf16_run, name):
    records = bf16_run(name)
    (footprint,) = [r for r in records if r.get("event") == "memory_footprint"]
    pb, gb, ob, dp_p, dp_g, dp_o = FORMULA[name]
    dp = 2
    for r in footprint["ranks"]:
        n = r["num_params"]
        # each bucket is padded to a multiple of DP: at most DP - 1 elements per bucket, and a
        # bucket holds at least one parameter
        buckets = 64
        for key, per, d in (("param_bytes", pb, dp_p), ("grad_bytes", gb, dp_g), ("optimizer_bytes", ob, dp_o)):
            exact = per * n / d  # padding sits in the last rank's slices: a few elements either way
            assert abs(r[key] - exact) <= per * buckets * (dp - 1), (name, key, r[key], exact)
    assert len(train_losses(records)) == 3
    # tools/plan.py's numbers for this layout, every strategy side by side
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan
    p = plan.make_plan(bf16_run.flags + strategy(name) + ["--world-size", "4"])
    for r in footprint["ranks"]:
        by = p["stages"][r["pp"]]["by_strategy"][name]
        pad = by["padding_max"] * 3  # bound on the bytes the padding moves, as elements x 12
        for key, field in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer")):
            assert abs(r[key] - by[field]) <= pad, (name, key, r, by)


def test_offload_gives_identical_losses(bf16_run):
    plain = bf16_run("optim_grads_params")
    half = bf16_run("optim_grads_params", ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"])
    assert train_losses(plain) == train_losses(half)
    assert grad_norms(plain) == grad_norms(half)


# -- what lives in memory, in process -------------------------------------------------------------
def _one_step_memory(rank, world, flags):
    from megalite.training import setup, train_step
    run = setup(validate_args(parse_args(flags), world))
    dp = run.dp
    train_step(run)
    p = dp.param_buffer
    (units,) = dp.zero3.order  # one model chunk: its own unit, then the embedding and the layers
    unit_bytes = [sum(p.full_bytes(b) for b in unit) for unit in units]
    return {"peak_gathered": p.peak_gathered_bytes, "all_full": sum(unit_bytes),
            "working_set": unit_bytes[0] + sum(sorted(unit_bytes[1:])[-2:]), "gathered_after": p.gathered_bytes(),
            "peak_staging": dp.grads.peak_staging_bytes, "grad_full": 4 * dp.layout.numel,
            "grad_bucket": 4 * max(e - s for s, e in dp.layout.buckets),
            "grad_shard": dp.grad_bytes, "gathers": p.gathers, "buckets": len(p.full),
            "embedding_buckets": len(units[1]), "tied_output_buckets": len(run.model[0].output_weight_gather.buckets)}


def test_zero3_frees_what_it_gathers():
    """One step of ZeRO-3 over DP 2 (8 layers, 2 micro-batches, full recompute: each layer's
    forward runs again inside backward and must not prefetch the layer after it, whose backward
    is over): parameters gathered at once
    never exceed the chunk's own unit plus two layers (the one in use and the prefetched next),
    all are freed after the step, each unit is gathered for every forward and every
    backward (re-gathered, not kept) but the embedding, which backward does not need, while the
    tied output projection gathers the embedding's table for itself in both, and no full-size
    fp32 gradient buffer exists."""
    flags = mock(256) + tiny(num_layers=8, micro_batch_size=1, global_batch_size=4, train_iters=1, eval_iters=0) + [
             "--hidden-dropout", "0", "--attention-dropout", "0", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"] + strategy("optim_grads_params") + OVERLAP
    for r in spawn(_one_step_memory, 2, flags):
        assert r["peak_gathered"] <= r["working_set"] < r["all_full"], r
        assert r["gathered_after"] == 0, r
        # forward and backward of 2 micro-batches
        assert r["gathers"] == 2 * (2 * r["buckets"] - r["embedding_buckets"] + 2 * r["tied_output_buckets"]), r
        assert r["grad_shard"] == r["grad_full"] // 2, r
        # staging: two buckets in flight, at most two filling
        assert r["peak_staging"] <= 4 * r["grad_bucket"] <= r["grad_full"] // 2, r


# -- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload offloads each rank's shard"),
    (strategy("optim") + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
     r"--optimizer-offload-fraction must be in \(0, 1\]"),
    (strategy("optim") + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0"],
     r"--optimizer-offload-fraction must be in \(0, 1\]"),
    (strategy("optim") + ["--optimizer-offload-fraction", "0.5"], "needs --optimizer-cpu-offload"),
    (strategy("no_shard") + ["--use-distributed-optimizer"], "drop one of them"),
    (strategy("no_shard") + ["--overlap-param-gather"], "--overlap-param-gather needs"),
    (strategy("optim_grads_params") + ["--compile"], "--compile with --data-parallel-sharding-strategy"),
])
def test_invalid_flags(extra, message):
    flags = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
             "--lr", "1e-3"] + extra
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(flags), 2)


def test_use_distributed_optimizer_is_optim():
    flags = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
             "--lr", "1e-3"]
    zero1 = validate_args(parse_args(flags + ["--use-distributed-optimizer"]), 2)
    assert zero1.ddp.data_parallel_sharding_strategy == "optim"
    assert validate_args(parse_args(flags), 2).ddp.data_parallel_sharding_strategy == "no_shard"
    args = validate_args(parse_args(flags + strategy("optim_grads_params")), 2)
    assert args.ddp.use_distributed_optimizer and args.optimizer.optimizer_offload_fraction == 1.0


def test_grad_norm_is_accurate_for_large_tensors():
    """The squared norm is accurate whatever the tensor's length and cut: fp32 rows of NORM_ROW
    elements, their squares summed in fp64 (one fp32 norm of the whole 4M-element gradient is off
    by ~1e-4 on the CPU, by an amount that depends on how ZeRO cuts the tensor into pieces). The
    bound: each row's fp32 sum has a relative error of at most NORM_ROW x 2^-24 ~ 6e-5; rows
    round independently, so the sum is far closer (measured ~1e-8); 1e-6 is the step's contract
    (the previous fp64-per-element sum agrees within it)."""
    import torch

    from megalite.optimizer.clip_grads import GradStats, sum_of_squares
    g = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = g.double().pow(2).sum().item()
    whole = sum_of_squares(g).item()
    cut = g.split([1_234_567, 2_000_000, 765_433])
    pieces = GradStats(list(cut), [True] * 3, []).local()[0].item()
    assert abs(whole - exact) / exact < 1e-6 and abs(pieces - exact) / exact < 1e-6
    assert sum_of_squares(g.bfloat16()).dtype == torch.float64
    assert sum_of_squares(torch.zeros(0)).item() == 0 and abs(sum_of_squares(torch.ones(5)).item() - 5) < 5e-6


def test_grad_stats_count_each_gradient_once():
    """GradStats: a flat buffer no piece of which this rank counts is left out, uncounted pieces
    (TP copies) of a counted one are subtracted; a non-finite flat counts as an overflow whether
    counted or not; --log-num-zeros-in-grad counts the counted pieces' zeros. Reference: the
    per-piece fp64 sums."""
    import torch

    from megalite.optimizer.clip_grads import GradStats
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(300_000, generator=gen), torch.randn(5_000, generator=gen)
    a[:1000] = 0
    dup_big, dup_small = a[100_000:200_000], a[7:19]
    want = (a.double().square().sum() - dup_big.double().square().sum() - dup_small.double().square().sum()).item()
    stats = GradStats([a, b], [True, False], [dup_big, dup_small], zero_pieces=[a[:50_000]]).local()
    assert abs(stats[0].item() - want) / want < 1e-6
    assert stats[1].item() == 0 and stats[2].item() == 1000
    b[3] = float("nan")
    assert GradStats([a, b], [True, False], []).local()[1].item() == 1
def test_max_abs_is_the_infinity_norm():
    """max_abs (the gradient check's per-rank max |g|) equals torch's infinity norm, NaN wins,
    empty tensors and no tensors give 0."""
    import torch

    from megalite.optimizer.clip_grads import max_abs
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=gen), -5.5 + torch.rand(7, generator=gen), torch.zeros(0)]
    want = torch.stack(torch._foreach_norm(grads[:2], float("inf"))).max().double()
    assert max_abs(grads).item() == want.item() and want.item() > 5
    assert max_abs([]).item() == 0 and max_abs([torch.zeros(0)]).item() == 0
    grads[1][3] = -float("inf")
    assert max_abs(grads).item() == float("inf")
    grads[0][1, 2] = float("nan")
    assert torch.isnan(max_abs(grads))
