"""Mixed precision, with and without the distributed optimizer, on the bundled corpus:
bf16 and fp16 runs train (the loss falls over 30 iterations); the memory_footprint record shows
12 bytes of optimizer state per parameter (fp32 master + Adam m, v) without ZeRO-1 and 12 / DP
with it; an injected fp16 overflow skips exactly that step on every rank, lowers the loss scale
and holds the learning-rate schedule. Plus the loss scaler's rules and the flags' validation."""
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT, assert_losses_close, run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.optimizer import ConstantGradScaler, DynamicGradScaler
from tiny import mock, tiny

MODEL = tiny(micro_batch_size=4, train_iters=30, lr=3e-3, log_interval=1, eval_iters=0) + [
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3", "--ddp-bucket-size", "20000"]
ZERO = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1", "--inject-overflow-at-iteration", "10"]


@pytest.fixture(scope="session")
def data_flags(tmp_path_factory):
    """The bundled corpus, built by data/prepare.sh (skips what is up to date)."""
    subprocess.run(["bash", "data/prepare.sh"], cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    build = os.path.join(ROOT, "data", "build")
    return ["--data-path", os.path.join(build, "corpus_text_document"), "--split", "98,2,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", os.path.join(build, "tokenizer.model"),
            "--data-cache-path", str(tmp_path_factory.mktemp("index-cache"))]


def _train(records):
    return [r for r in records if "consumed_samples" in r]


def assert_loss_falls(records):
    losses = train_losses(records)
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)


# -- bf16 -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_runs(data_flags, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    plain, _ = run_pretrain(2, data_flags + MODEL + ["--bf16", "--overlap-grad-reduce"], tmp, "plain")
    zero, _ = run_pretrain(2, data_flags + MODEL + ["--bf16"] + ZERO, tmp, "zero")
    return plain, zero


def test_bf16_trains_with_and_without_zero1(bf16_runs):
    plain, zero = bf16_runs
    assert_loss_falls(plain)
    assert_loss_falls(zero)
    # the same computation up to bf16 rounding of the updated weights
    assert_losses_close(train_losses(plain), train_losses(zero), rtol=2e-3)


def test_bf16_optimizer_bytes(bf16_runs):
    plain, zero = bf16_runs
    for r in plain[0]["ranks"]:  # fp32 master 4 + Adam m 4 + v 4 bytes per parameter
        assert r["optimizer_bytes"] == 12 * r["num_params"], r
        assert r["param_bytes"] == 2 * r["num_params"] and r["grad_bytes"] == 4 * r["num_params"], r
    ranks = zero[0]["ranks"]
    dp = len(ranks)
    n = ranks[0]["num_params"]
    for r in ranks:  # 12 / DP per parameter, up to the padding of each bucket to a multiple of DP
        assert abs(r["optimizer_bytes"] - 12 * n / dp) <= 0.01 * 12 * n / dp, r
    total = sum(r["optimizer_bytes"] for r in ranks)
    assert 0 <= total - 12 * n < 4 * dp * 100, (total, 12 * n)  # masters cover the padding too


# -- fp16 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nproc,extra", [(1, []), (2, ZERO)], ids=["plain", "zero1-dp2"])
def test_fp16_overflow_skips_the_step(data_flags, tmp_path, nproc, extra):
    records, proc = run_pretrain(nproc, data_flags + MODEL + FP16 + extra, tmp_path)
    train = _train(records)
    assert [r["iteration"] for r in train] == list(range(1, 31))
    assert [r["skipped_iterations"] for r in train] == [1 if r["iteration"] == 10 else 0 for r in train]
    scales = [r["loss_scale"] for r in train]  # logged after the step's update of the scale
    assert scales == [4096.0] * 9 + [2048.0] * 21
    by_it = {r["iteration"]: r for r in train}
    assert by_it[10]["grad_norm"] is None and by_it[9]["grad_norm"] > 0
    # the schedule does not advance on the skipped step: iteration 11 runs at iteration 10's lr
    assert by_it[11]["lr"] == by_it[10]["lr"] != by_it[9]["lr"]
    assert by_it[12]["lr"] != by_it[11]["lr"]
    assert "skipped iterations: 1" in proc.stdout
    assert_loss_falls(records)


# -- units --------------------------------------------------------------------------------------------
def test_dynamic_loss_scaler_rules():
    s = DynamicGradScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # the first overflow uses up hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # hysteresis stays used up until the scale grows again
    s.update(True)
    assert s.scale == 256.0  # never below --min-loss-scale
    for _ in range(2):
        s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 512.0 and s.hysteresis_tracker == 2  # window of 3 clean steps: doubled
    s.update(True)
    assert s.scale == 512.0
    c = ConstantGradScaler(128.0)
    c.update(True)
    assert c.scale == 128.0


BASE = mock(100) + tiny(seq_length=16, global_batch_size=None, train_iters=1)


def test_precision_flags():
    assert validate_args(parse_args(BASE + ["--fp16"]), 1).optimizer.params_dtype == "float16"
    assert validate_args(parse_args(BASE + ["--bf16"]), 1).optimizer.params_dtype == "bfloat16"
    bad = [
        (["--fp16", "--bf16"], "mutually exclusive"),
        (["--loss-scale", "128"], "--loss-scale needs --fp16 or --bf16"),
        (["--bf16", "--hysteresis", "4"], "--hysteresis sets dynamic loss scaling"),
        (["--fp16", "--loss-scale", "128", "--initial-loss-scale", "4096"], "--initial-loss-scale sets dynamic"),
        (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "--min-loss-scale"),
        (["--bf16", "--inject-overflow-at-iteration", "3"], "needs loss scaling"),
    ]
    for extra, pattern in bad:
        with pytest.raises(ArgumentError, match=pattern):
            validate_args(parse_args(BASE + extra), 1)
