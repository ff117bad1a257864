"""The distributed optimizer (ZeRO-1) and the gradient buffer: the buffer layout (small buckets,
--ddp-bucket-size 5000, whose DP slices cut through parameters), that --overlap-grad-reduce really
starts reductions during backward, the sharded optimizer state, fused vs unfused updates, and the
flags' validation. That ZeRO-1 trains the same model as one process, on every layout, is in
test_layouts.py."""
import pytest

from dist_helpers import (assert_loss_falls, assert_losses_close, assert_params_close, load_params, run_pretrain,
                          spawn, train_losses)
from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny

BASE = mock(1000) + tiny(log_interval=1, eval_iters=0) + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
        "--clip-grad", "0.5"]  # below the gradient norm: clipping by the global norm is exercised
ZERO = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


# -- buffer layout and overlap, in process ---------------------------------------------------------
def _run(rank, world, extra):
    from megalite.training import setup
    return setup(validate_args(parse_args(BASE + extra), world))


def _layout_and_early_reductions(rank, world, extra):
    run = _run(rank, world, extra)
    lay, buf, params = run.dp.layout, run.dp.grads, [p for _, p in run.state.named_params]
    cuts = 0
    for b, (start, end) in enumerate(lay.buckets):
        assert (end - start) % lay.dp_size == 0 if buf.reduce_scatter else True
        for r in range(world):
            s, e = lay.shard_range(b, r)
            cuts += any(ps < s < pe for ps, pe in (lay.param_index[p] for p in lay.bucket_params[b]))
    if buf.reduce_scatter:  # parameters are views into a flat buffer with the gradients' layout
        for p in params:
            start, end = lay.param_index[p]
            assert p.data_ptr() == run.dp.param_buffer.data[start:end].data_ptr()
    run.dp.zero_grad()
    run.forward_backward(batches=run.train_batches, model=run.model,
                         num_microbatches=run.cfg.training.num_microbatches, comm=run.pipe_comm, backward_scale=1e-3)
    started = sum(buf._started)  # started from the backward hooks, before finish_grad_sync
    run.dp.finish_grad_sync()
    owned = sum(m.numel() for m in run.state.optimizer.masters)
    return {"buckets": len(lay.buckets), "cuts": cuts, "started": started, "owned": owned,
            "params": sum(p.numel() for p in params)}


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
def test_sgd_fused_matches_unfused(corpus, tmp_path):
    """The optimizer choice is printed at start-up; both paths compute the same run. (Adam: the
    ZeRO-1 layout in test_layouts.py runs unfused against a fused reference.)"""
    flags = corpus + tiny(micro_batch_size=4, global_batch_size=None, train_iters=5, lr=0.3, log_interval=1, eval_iters=0) + [
                      "--hidden-dropout", "0", "--attention-dropout", "0",
                      "--optimizer", "sgd", "--sgd-momentum", "0.9", "--weight-decay", "0.1"]
    runs = {}
    for name, extra in (("fused", []), ("unfused", ["--no-fused-optimizer"])):
        records, proc = run_pretrain(1, flags + extra + ["--save", str(tmp_path / name)], tmp_path, name)
        assert f"> optimizer: sgd (torch SGD, {name})" in proc.stdout
        runs[name] = records, load_params(str(tmp_path / name))
    (fused, fused_params), (unfused, unfused_params) = runs["fused"], runs["unfused"]
    assert_loss_falls(train_losses(fused), 0.3)
    assert_losses_close(train_losses(fused), train_losses(unfused), rtol=1e-6)
    assert_params_close(fused_params, unfused_params, atol=1e-6)
