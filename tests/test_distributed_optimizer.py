"""The distributed optimizer (ZeRO-1) computes the same training run as the plain optimizer on one
process: lm_loss per iteration within 1e-5 (fp32, dropout 0, 10 iterations), over DP 2 and 4,
TP 2 x DP 2 and TP 2 x PP 2 x DP 2, with --overlap-grad-reduce / --overlap-param-gather on or off.
Small buckets (--ddp-bucket-size 5000) give several buckets whose DP slices cut through
parameters. Plus: the buffer layout, that overlap really starts reductions during backward, the
sharded optimizer state, and fused vs unfused updates."""
import pytest
import torch

from dist_helpers import assert_losses_close, grad_norms, run_pretrain, spawn, train_losses
from megalite.arguments import ArgumentError, build_parser, parse_args, validate_args

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "10", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
        "--clip-grad", "0.5"]  # below the gradient norm: clipping by the global norm is exercised
ZERO = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


def _has_pipeline_parallelism() -> bool:
    """pretrain_gpt.py --help lists the flag, and validation accepts PP = 2."""
    if "--pipeline-model-parallel-size" not in build_parser().format_help():
        return False
    try:
        validate_args(parse_args(BASE + ["--pipeline-model-parallel-size", "2"]), 2)
    except ArgumentError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records, _ = run_pretrain(1, BASE, tmp_path_factory.mktemp("ref"), "ref")
    losses = train_losses(records)
    assert losses[0] != losses[-1]  # the model moves, so equality below is not an artefact
    assert min(grad_norms(records)) > 0.5  # clipping is active
    return records


@pytest.mark.parametrize("nproc,extra", [
    (2, []),
    (4, OVERLAP),
    (4, ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"]),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"] + OVERLAP),
], ids=["dp2", "dp4-overlap", "tp2-dp2-overlap-grad", "tp2-pp2-dp2-overlap"])
def test_zero1_matches_single_process(reference, tmp_path, nproc, extra):
    if "--pipeline-model-parallel-size" in extra and not _has_pipeline_parallelism():
        pytest.skip("--pipeline-model-parallel-size is not available yet")
    records, _ = run_pretrain(nproc, BASE + ZERO + extra, tmp_path)
    assert_losses_close(train_losses(reference), train_losses(records))
    assert_losses_close(grad_norms(reference), grad_norms(records), rtol=1e-4)  # the true global norm
    # the optimizer state is sharded: fp32 Adam m, v = 8 bytes per parameter, split over DP
    ranks = records[0]["ranks"]
    tp = int(extra[extra.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in extra else 1
    pp = int(extra[extra.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in extra else 1
    dp = nproc // (tp * pp)
    for r in ranks:
        assert abs(r["optimizer_bytes"] - 8 * r["num_params"] / dp) <= 0.01 * 8 * r["num_params"] / dp, r
    for (t, p) in {(r["tp"], r["pp"]) for r in ranks}:
        replicas = [r for r in ranks if (r["tp"], r["pp"]) == (t, p)]
        assert sum(r["optimizer_bytes"] for r in replicas) == 8 * replicas[0]["num_params"]


# -- buffer layout and overlap, in process ---------------------------------------------------------
def _trainer(rank, world, extra):
    from megalite.training import Trainer
    args = validate_args(parse_args(BASE + extra), world)
    t = Trainer(args)
    t.setup()
    return t


def _layout_and_early_reductions(rank, world, extra):
    t = _trainer(rank, world, extra)
    args, buf = t.args, t.grad_buffer
    cuts = 0
    for b, (start, end) in enumerate(buf.buckets):
        assert (end - start) % buf.dp_size == 0 if buf.reduce_scatter else True
        for r in range(world):
            s, e = buf.shard_range(b, r)
            cuts += any(ps < s < pe for ps, pe in (buf.param_index[p] for p in buf.bucket_params[b]))
    if buf.reduce_scatter:  # parameters are views into a flat buffer with the gradients' layout
        for p in t.params:
            start, end = buf.param_index[p]
            assert p.data_ptr() == buf.param_data[start:end].data_ptr()
    t.optimizer.zero_grad()
    t.forward_backward(forward_step=t.forward_step, data_iterator=t.train_iter, model=t.model,
                       num_microbatches=args.num_microbatches, comm=t.pipe_comm, backward_scale=1e-3)
    started = sum(buf._started)  # started from the backward hooks, before finalize_model_grads
    t.finalize_model_grads()
    owned = sum(m.numel() for m in t.optimizer.masters)
    return {"buckets": len(buf.buckets), "cuts": cuts, "started": started, "owned": owned,
            "params": sum(p.numel() for p in t.params)}


@pytest.mark.parametrize("zero", [True, False], ids=["zero1", "all-reduce"])
def test_layout_and_overlap_starts_reductions_during_backward(zero):
    extra = (ZERO if zero else ["--ddp-bucket-size", "5000"]) + ["--overlap-grad-reduce"]
    r0, r1 = spawn(_layout_and_early_reductions, 2, extra)
    assert r0["buckets"] >= 3  # several buckets ...
    assert r0["started"] == r0["buckets"]  # ... each started during backward (none is deferred here)
    if zero:
        assert r0["cuts"] >= 2  # DP slice boundaries fall inside parameters
        assert r0["owned"] + r1["owned"] == r0["params"]  # the owned pieces partition the parameters
        assert 0 < r0["owned"] < r0["params"]
    else:
        assert r0["owned"] == r0["params"]


def test_invalid_flag_combinations():
    with pytest.raises(ArgumentError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        validate_args(parse_args(BASE + ["--overlap-param-gather"]), 2)


# -- fused and unfused updates ------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fused_matches_unfused(optimizer):
    from megalite.optimizer import build_inner_optimizer
    from megalite.optimizer.optimizer import _param_groups, init_optimizer_state
    args = validate_args(parse_args(BASE + ["--optimizer", optimizer, "--weight-decay", "0.1"]), 1)
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (5, 7, 3), (1000,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 10 ** (i % 3 - 1) for s in shapes] for i in range(5)]
    results, impls = [], []
    for fused in (True, False):
        params = [x.clone() for x in init]
        opt, impl = build_inner_optimizer(_param_groups([(p, p.ndim) for p in params], 0.1), args,
                                          torch.device("cpu"), fused=fused)
        init_optimizer_state(opt)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        results.append(params)
        impls.append(impl)
    assert "fused" in impls[0] and "unfused" in impls[1]
    for a, b, x in zip(*results, init):
        assert not torch.equal(a, x)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
