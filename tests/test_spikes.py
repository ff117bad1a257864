"""--check-for-spiky-loss / --check-for-large-grads (runtime/spikes.py).

The guard against a plain reference in the test (its window, factor, patience); a run driven to
divergence (--lr 1e6 --clip-grad 0 after a healthy start) stops before any checkpoint whose
weights cannot train on, and its latest checkpoint resumes with a sane learning rate to a finite,
falling loss, where without the guard the latest checkpoint cannot; a healthy run with the guard on is the run without it, bit for bit, its
checkpoints included (written one iteration later, with the RNG states of their iteration).
"""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import grad_norms, run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.files import read_tracker
from megalite.runtime.spikes import SpikeGuard
from tiny import mock, tiny

GUARD = ["--check-for-spiky-loss", "--check-for-large-grads"]


def reference_spikes(values, factor, window):
    """Indices a plain reading of the rule flags: not finite, or >= factor x the largest of the
    last `window` accepted values once there are that many (a flagged value is not accepted)."""
    accepted, flagged = [], []
    for i, v in enumerate(values):
        if not math.isfinite(v) or (len(accepted) >= window and v >= factor * max(accepted[-window:])):
            flagged.append(i)
        else:
            accepted.append(v)
    return flagged


def test_guard_against_a_plain_reference():
    values = [5.0, 4.0, 3.9, 40.0, 3.8, float("nan"), 3.7, 37.0, 36.9, 3.6, 1e9]
    for factor, window in ((10, 1), (10, 3), (2, 2), (10, 100)):
        guard = SpikeGuard(factor, window, patience=100, check_loss=True, check_grads=False)
        got = []
        for i, v in enumerate(values):
            if guard.loss_spike(v) is not None:
                got.append(i)
                guard.reject()
            else:
                guard.accept(v, None)
        assert got == reference_spikes(values, factor, window), (factor, window)
    guard = SpikeGuard(10, 1, patience=2, check_loss=False, check_grads=True)
    assert guard.loss_spike(1e9) is None  # the loss is not checked
    guard.accept(1.0, 2.0)
    assert "gradient norm 20" in guard.grad_norm_spike(20.0) and guard.grad_norm_spike(19.9) is None
    assert not guard.reject() and guard.reject()  # patience 2: the second in a row stops


def test_spike_flags_need_a_check():
    with pytest.raises(ArgumentError, match="--spike-window needs --check-for-spiky-loss"):
        validate_args(parse_args(mock(100) + tiny() + ["--spike-window", "3"]), 1)
    assert validate_args(parse_args(mock(100) + tiny() + GUARD + ["--spike-window", "3"]), 1).training.spike_window == 3


BASE = tiny(log_interval=1, eval_iters=0) + ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _train(corpus, tmp_path, name, *flags, check=True):
    records, proc = run_pretrain(1, corpus + BASE + list(flags), tmp_path, name, check=check)
    return records, proc


def _trains_on(corpus, tmp_path, ck, name, expect_success: bool) -> bool:
    """Whether the latest checkpoint under ck, resumed with a sane learning rate (weights only),
    gives finite losses that fall (a run expected to succeed goes to the pool of ready ranks)."""
    records, proc = _train(corpus, tmp_path, name, "--train-iters", "6", "--lr", "1e-3", "--load", ck, "--finetune",
                           "--no-load-optim", check=expect_success)
    losses = train_losses(records)
    return proc.returncode == 0 and len(losses) == 6 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_divergence_leaves_a_checkpoint_that_trains(corpus, tmp_path):
    """4 healthy iterations (checkpoint at 4), then the run goes on at --lr 1e6 --clip-grad 0,
    saving every iteration, with the guard and without (and without the NaN check, which would
    stop both: the guard alone is tested)."""
    healthy = str(tmp_path / "healthy")
    _train(corpus, tmp_path, "healthy", "--train-iters", "4", "--lr", "1e-3", "--save", healthy, "--save-interval", "2")
    diverge = ["--train-iters", "12", "--lr", "1e6", "--clip-grad", "0", "--save-interval", "1",
               "--no-check-for-nan-in-loss-and-grad", "--override-opt_param-scheduler"]  # (not the checkpoint's lr)
    for name in ("guarded", "unguarded"):
        shutil.copytree(healthy, tmp_path / name)
    ck = str(tmp_path / "guarded")
    records, proc = _train(corpus, tmp_path, "guarded", *diverge, *GUARD, "--spike-window", "1", "--load", ck,
                           "--save", ck, check=False)
    spikes = [r for r in records if r.get("event") == "spike"]
    assert proc.returncode == 2 and "5 iterations in a row skipped for spikes" in proc.stderr, proc.stderr[-3000:]
    assert [r["iteration"] for r in spikes] == [6, 7, 8, 9, 10]  # iteration 5's update broke the weights
    assert read_tracker(ck) == 4 and "checkpoint of iteration 5 not written" in proc.stdout
    assert _trains_on(corpus, tmp_path, ck, "resume-guarded", expect_success=True)
    # without the guard the run saves every iteration: its latest checkpoint cannot train on
    ck = str(tmp_path / "unguarded")
    _train(corpus, tmp_path, "unguarded", *diverge, "--load", ck, "--save", ck)
    assert read_tracker(ck) == 12 and not _trains_on(corpus, tmp_path, ck, "resume-unguarded", expect_success=False)


def test_healthy_run_is_unchanged_bit_for_bit(tmp_path):
    flags = mock(256) + tiny(train_iters=6, log_interval=1, eval_iters=0, global_batch_size=4) + [
        "--hidden-dropout", "0.1", "--save-interval", "2"]
    plain, _ = run_pretrain(1, flags + ["--save", str(tmp_path / "plain")], tmp_path, "plain")
    guarded, proc = run_pretrain(1, flags + GUARD + ["--spike-window", "2", "--save", str(tmp_path / "guarded")],
                                 tmp_path, "guarded")
    assert train_losses(plain) == train_losses(guarded) and grad_norms(plain) == grad_norms(guarded)
    assert not [r for r in guarded if r.get("event") == "spike"]
    for it in (2, 4, 6):
        files = [f"iter_{it:07d}/rank_00000.safetensors"]
        for f in files:
            a, b = load_file(str(tmp_path / "plain" / f)), load_file(str(tmp_path / "guarded" / f))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (it, f)
        meta = [json.load(open(tmp_path / d / f"iter_{it:07d}" / "metadata.json")) for d in ("plain", "guarded")]
        assert meta[0]["consumed_samples"] == meta[1]["consumed_samples"]
    assert os.path.isdir(tmp_path / "guarded" / "iter_0000006")
