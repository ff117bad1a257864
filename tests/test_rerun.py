"""--rerun-mode and --error-injection-* (runtime/rerun.py).

Each injected kind classified 20 times of 20 on 2 gloo ranks (DP 2): transient errors in one
20-iteration run, each naming the injected rank and keeping the re-run's result, whose weights
then equal the run without faults bit for bit; persistent errors and correct results each in 20
one-iteration runs (different seeds, so different ranks and micro-batches), each stopping before
its update and naming the faulty rank (persistent) or the micro-batch and samples (correct). A
healthy run under validate_results is the run without it, bit for bit; a stopped run leaves no
checkpoint of its rejected iteration; report_stats reports a spread of 0 (CPU kernels are
deterministic); the transient path also under PP 2 x DP 2 with the distributed optimizer and overlapped
gradient reduction and parameter gathers (Megatron-LM's reruns configurations). Cost: ~70 s wall on the
shared 2 cores (the 40 stopped runs run in one pool call, ~0.2 s each).
"""
import os

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import run_pretrain, spawn, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.paths import read_tracker
from megalite.runtime.rerun import ErrorInjector, relative_difference, same
from tiny import mock, tiny

BASE = mock(256) + tiny(log_interval=1, eval_iters=0, hidden_dropout=0.1)
VALIDATE = ["--rerun-mode", "validate_results"]


def test_injector_draws_at_its_rate_the_same_everywhere():
    inj = ErrorInjector(4, "transient_error", seed=1234)
    picks = [inj.pick(i, [0, 1, 2, 3], 4) for i in range(1, 2001)]
    assert picks == [ErrorInjector(4, "transient_error", 1234).pick(i, [0, 1, 2, 3], 4) for i in range(1, 2001)]
    hits = [p for p in picks if p is not None]
    assert 400 < len(hits) < 600  # 1 in 4 of 2000: 500 +- 3 sigma (58)
    assert {p.rank for p in hits} == {0, 1, 2, 3} and {p.microbatch for p in hits} == {0, 1, 2, 3}
    assert all(p is not None for p in (ErrorInjector(1, "transient_error", 7).pick(i, [3], 2) for i in range(50)))
    assert ErrorInjector(0, "transient_error", 7).pick(1, [0], 1) is None
    # where each kind shows: (phase, this rank, the rank whose data it computes)
    hit = ErrorInjector(1, "transient_error", 7).pick(1, [5], 1)
    kinds = {k: ErrorInjector(1, k, 7) for k in ("transient_error", "persistent_error", "correct_result")}
    assert [kinds["transient_error"].applies(hit, ph, 5, 5) for ph in ("initial", "in_place")] == [True, False]
    assert kinds["persistent_error"].applies(hit, "other_replica", 5, 6)  # the device, whatever it computes
    assert not kinds["persistent_error"].applies(hit, "other_replica", 4, 5)
    assert kinds["correct_result"].applies(hit, "other_replica", 4, 5)  # the data, whoever computes it
    assert not kinds["correct_result"].applies(hit, "other_replica", 5, 6)
    assert same(float("nan"), float("nan")) and not same(1.0, 1.0 + 2 ** -52)
    assert relative_difference(2.0, 2.0) == 0 and relative_difference(1.0, float("nan")) == float("inf")


@pytest.mark.parametrize("extra, message", [
    (["--error-injection-rate", "10"], "--error-injection-rate needs --rerun-mode validate_results"),
    (VALIDATE + ["--error-injection-type", "persistent_error"], "--error-injection-type needs --error-injection-rate"),
    (VALIDATE + ["--no-check-for-nan-in-loss-and-grad"], "has nothing to validate"),
    (["--result-rejected-tracker-filename", "x.txt"], "needs --rerun-mode validate_results"),
    (["--rerun-mode", "report_stats", "--error-injection-rate", "3"], "needs --rerun-mode validate_results"),
])
def test_flags_that_would_change_nothing_are_refused(extra, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(BASE + extra), 1)
    assert validate_args(parse_args(BASE + VALIDATE), 1).resilience.rerun_mode == "validate_results"


def _weights(root, iteration):
    f = os.path.join(root, f"iter_{iteration:07d}", "rank_00000.safetensors")
    return load_file(f)


def test_transient_errors_are_named_and_leave_no_trace(tmp_path):
    """20 iterations, a transient fault injected in each (rate 1): each is re-run, the injected
    rank named, and the weights after 20 iterations equal, bit for bit, the run without faults,
    which equals the run without validation (a healthy run changes no bit under validate_results)."""
    flags = BASE + ["--train-iters", "20", "--save-interval", "20"]
    runs = {}
    for name, extra in (("plain", []), ("healthy", VALIDATE),
                        ("faults", VALIDATE + ["--error-injection-rate", "1", "--result-rejected-tracker-filename",
                                               str(tmp_path / "rejected.txt")])):
        runs[name] = run_pretrain(2, flags + extra + ["--save", str(tmp_path / name)], tmp_path, name)[0]
    events = [r for r in runs["faults"] if r.get("event") == "rerun"]
    injector = ErrorInjector(1, "transient_error", seed=1234)
    expected = [[injector.pick(i, [0, 1], 2).rank] for i in range(1, 21)]
    assert [e["iteration"] for e in events] == list(range(1, 21))
    assert all(e["diagnostic"] == "transient_error" for e in events)
    assert [e["ranks"] for e in events] == expected and {r[0] for r in expected} == {0, 1}
    assert train_losses(runs["plain"]) == train_losses(runs["healthy"]) == train_losses(runs["faults"])
    plain = _weights(tmp_path / "plain", 20)
    for name in ("healthy", "faults"):
        got = _weights(tmp_path / name, 20)
        assert got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in plain), name
    lines = open(tmp_path / "rejected.txt").read().splitlines()
    assert len([x for x in lines if "status=first_rerun_not_reproducible" in x]) == 20
    assert all("rank=" in x and "iteration=" in x for x in lines)


def _stopped_runs(rank, world, flags, kind, seeds, out):
    """One pretrain per seed on this pool's ranks, each with a fault at iteration 1 (rate 1):
    its RerunError's message, per seed."""
    from megalite.runtime.rerun import RerunError
    from megalite.training import pretrain
    messages = []
    for seed in seeds:
        cfg = validate_args(parse_args(flags + ["--seed", str(seed), "--error-injection-type", kind,
                                                "--save", os.path.join(out, f"{kind}-{seed}")]), world)
        try:
            pretrain(cfg)
            messages.append(None)
        except RerunError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("kind", ["persistent_error", "correct_result"])
def test_reproduced_errors_stop_before_their_update(kind, tmp_path):
    """20 seeds, a fault each at the first iteration: a persistent one names the injected rank as
    faulty; a correct result names its rank, micro-batch and samples; neither writes a checkpoint."""
    flags = BASE + VALIDATE + ["--train-iters", "1", "--error-injection-rate", "1", "--save-interval", "1"]
    seeds = list(range(1, 21))
    messages = spawn(_stopped_runs, 2, flags, kind, seeds, str(tmp_path))[0]
    picks = [ErrorInjector(1, kind, seed).pick(1, [0, 1], 2) for seed in seeds]
    assert {p.rank for p in picks} == {0, 1} and {p.microbatch for p in picks} == {0, 1}
    for seed, msg, p in zip(seeds, messages, picks):
        assert msg is not None, seed
        first = p.microbatch * 4 + p.rank * 2  # micro 2 x DP 2 samples per micro-batch step
        where = f"rank {p.rank}: micro-batch {p.microbatch}, samples {first}..{first + 1}"
        if kind == "persistent_error":
            assert f"a persistent fault of rank(s) [{p.rank}] ({where})" in msg, (seed, msg)
        else:
            assert "reproduced on another data-parallel replica: the result is correct" in msg and where in msg, msg
        assert "stopped before the optimizer step" in msg
        assert read_tracker(str(tmp_path / f"{kind}-{seed}")) is None


def test_a_stop_keeps_the_last_good_checkpoint(tmp_path):
    """Faults at about one iteration in 3: the first is persistent and stops the run; the
    checkpoints written before it are there, none after (the tracker names the last good one)."""
    injector = ErrorInjector(3, "persistent_error", seed=1234)
    first = next(i for i in range(1, 50) if injector.pick(i, [0, 1], 2) is not None)
    assert first > 1
    flags = BASE + VALIDATE + ["--train-iters", "20", "--error-injection-rate", "3", "--error-injection-type",
                               "persistent_error", "--save-interval", "1", "--save", str(tmp_path / "ck")]
    _, proc = run_pretrain(2, flags, tmp_path, "stop", check=False)
    assert proc.returncode != 0 and f"iteration {first}: the loss is nan" in proc.stderr, proc.stderr[-2000:]
    assert read_tracker(str(tmp_path / "ck")) == first - 1


def test_report_stats_runs_each_iteration_twice(tmp_path):
    records, _ = run_pretrain(2, BASE + ["--train-iters", "4", "--rerun-mode", "report_stats", "--log-interval", "2"],
                              tmp_path, "stats")
    plain, _ = run_pretrain(2, BASE + ["--train-iters", "4", "--log-interval", "2"], tmp_path, "plain")
    stats = [r for r in records if r.get("event") == "rerun_stats"]
    assert [(s["iteration"], s["iterations"], s["max_relative_difference"]) for s in stats] == [(2, 2, 0.0),
                                                                                                  (4, 2, 0.0)]
    assert train_losses(records) == train_losses(plain)


def test_transient_errors_under_pipeline_and_zero(tmp_path):
    """As Megatron-LM's reruns configurations run: the distributed optimizer with overlapped
    gradient reduction and parameter gathers, here under PP 2 x DP 2 (4 ranks): faults in about
    half the iterations, each re-run, and the weights equal the faultless run's bit for bit."""
    flags = BASE + ["--train-iters", "6", "--save-interval", "6", "--num-layers", "4", "--pipeline-model-parallel-size",
                    "2", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    plain, _ = run_pretrain(4, flags + ["--save", str(tmp_path / "plain")], tmp_path, "plain")
    faults, _ = run_pretrain(4, flags + VALIDATE + ["--error-injection-rate", "2", "--save", str(tmp_path / "faults")],
                             tmp_path, "faults")
    events = [r for r in faults if r.get("event") == "rerun"]
    injector = ErrorInjector(2, "transient_error", seed=1234)
    expected = [(i, [p.rank]) for i in range(1, 7) for p in [injector.pick(i, [2, 3], 2)] if p is not None]
    assert [(e["iteration"], e["ranks"]) for e in events] == expected and len(expected) >= 2
    assert train_losses(plain) == train_losses(faults)
    for rank in range(4):
        a = load_file(str(tmp_path / "plain" / "iter_0000006" / f"rank_{rank:05d}.safetensors"))
        b = load_file(str(tmp_path / "faults" / "iter_0000006" / f"rank_{rank:05d}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank
