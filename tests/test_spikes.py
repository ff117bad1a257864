"""--check-for-spiky-loss / --check-for-large-grads (runtime/spikes.py).

The guard against a plain reference in the test (its window, factor, patience), judging from the
second value on; its window saved and restored with checkpoints, so a resumed run flags what the
uninterrupted one does; a run driven to divergence (--lr 1e3 --clip-grad 0, guard defaults, 2
ranks; after a healthy start, or from the first iteration) stops before any checkpoint whose
weights cannot train on, and its latest checkpoint resumes with a sane learning rate to a finite,
falling loss, where without the guard the latest checkpoint cannot; a healthy run with the guard
on is the run without it, bit for bit, its checkpoints included (written one iteration later,
with the RNG states of their iteration).
"""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import CORPUS_VOCAB
from dist_helpers import grad_norms, run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.paths import read_tracker
from megalite.runtime.spikes import SpikeGuard
from tiny import mock, tiny

GUARD = ["--check-for-spiky-loss", "--check-for-large-grads"]


def reference_spikes(values, factor, window):
    """Indices a plain reading of the rule flags: not finite, or >= factor x the largest of the
    last `window` accepted values, however few (none before the first accepted value; a flagged
    value is not accepted)."""
    accepted, flagged = [], []
    for i, v in enumerate(values):
        if not math.isfinite(v) or (accepted and v >= factor * max(accepted[-window:])):
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
    # the default window judges from the second value on: the first only for finiteness
    guard = SpikeGuard(10, 100, patience=5, check_loss=True, check_grads=True)
    assert guard.loss_spike(1e30) is None and guard.loss_spike(float("inf")) is not None
    guard.accept(6.2, 1.6)  # an update at --lr 1e3 then gives a loss of 3.2e7: caught against this one
    assert "is 5161290.3x the largest of the last 1 accepted (6.2" in guard.loss_spike(3.2e7)
    assert guard.grad_norm_spike(15.9) is None and guard.grad_norm_spike(16.0) is not None
    guard = SpikeGuard(10, 1, patience=2, check_loss=False, check_grads=True)
    assert guard.loss_spike(1e9) is None  # the loss is not checked
    guard.accept(1.0, 2.0)
    assert "gradient norm 20" in guard.grad_norm_spike(20.0) and guard.grad_norm_spike(19.9) is None
    assert not guard.reject() and guard.reject()  # patience 2: the second in a row stops


def _feed(guard, values):
    """Losses and gradient norms (the norm: the loss / 2) through the guard as the loop does; the
    indices it skipped."""
    flagged = []
    for i, v in enumerate(values):
        if guard.loss_spike(v) is not None or guard.grad_norm_spike(v / 2) is not None:
            flagged.append(i)
            guard.reject()
        else:
            guard.accept(v, v / 2)
    return flagged


def test_guard_window_survives_a_resume():
    """The window, saved (through JSON, as in metadata.json) mid-run and loaded into a fresh
    guard, judges the rest of the run as the uninterrupted guard does; a checkpoint without it
    gives an empty guard; a smaller --spike-window keeps the newest values."""
    values = [6.0, 5.0, 4.0, 3.0, 2.0, 55.0, 1.9, 25.0, float("nan"), 1.8, 1.5, 1.4, 1.3, 60.0, 19.0, 1.2]
    args = dict(factor=10, window=4, patience=100, check_loss=True, check_grads=True)
    whole = SpikeGuard(**args)
    expected = _feed(whole, values)
    assert expected == reference_spikes(values, 10, 4) == [5, 8, 13, 14]  # 25 has left the window by 13
    for cut in range(1, len(values)):
        first = SpikeGuard(**args)
        head = _feed(first, values[:cut])
        resumed = SpikeGuard(**args)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert resumed.state_dict() == first.state_dict()
        assert head + [cut + i for i in _feed(resumed, values[cut:])] == expected, cut
        assert resumed.state_dict() == whole.state_dict(), cut
    # without its window a guard resumed before 55 would take it (the first value: no baseline)
    assert _feed(SpikeGuard(**args), values[5:]) != [i - 5 for i in expected if i >= 5]
    empty = SpikeGuard(**args)
    empty.load_state_dict(None)
    assert empty.state_dict() == {"losses": [], "grad_norms": [], "consecutive": 0}
    small = SpikeGuard(**{**args, "window": 2})
    small.load_state_dict(whole.state_dict())
    assert list(small.losses) == list(whole.losses)[-2:] and small.consecutive == whole.consecutive


def test_spike_flags_need_a_check():
    with pytest.raises(ArgumentError, match="--spike-window needs --check-for-spiky-loss"):
        validate_args(parse_args(mock(100) + tiny() + ["--spike-window", "3"]), 1)
    assert validate_args(parse_args(mock(100) + tiny() + GUARD + ["--spike-window", "3"]), 1).training.spike_window == 3


BASE = tiny(log_interval=1, eval_iters=0) + ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _train(corpus, tmp_path, name, *flags, check=True, nproc=2):
    """A run on 2 ranks (DP 2): the guard's window is the same on both, saved once. A run expected
    to fail starts its own processes (torchrun and a process per rank, ~3 s of CPU each): where
    the stop across ranks is not what is tested, it runs as one process (nproc=1)."""
    records, proc = run_pretrain(nproc, corpus + BASE + list(flags), tmp_path, name, check=check)
    return records, proc


def _trains_on(corpus, tmp_path, ck, name, expect_success: bool) -> bool:
    """Whether the latest checkpoint under ck, resumed with a sane learning rate and without its
    optimizer state, gives 6 finite losses that fall, from no higher than untrained weights give
    (ln V: weights that give 1e7 may well fall, but from there; a run expected to succeed goes to
    the pool of ready ranks, one expected to fail is one process: the same global batch on DP 1,
    what is judged is the checkpoint's weights)."""
    iters = str(read_tracker(ck) + 6)
    records, proc = _train(corpus, tmp_path, name, "--train-iters", iters, "--lr", "1e-3", "--load", ck,
                           "--no-load-optim", check=expect_success, nproc=2 if expect_success else 1)
    losses = train_losses(records)
    return (proc.returncode == 0 and len(losses) == 6 and all(map(math.isfinite, losses))
            and losses[-1] < losses[0] <= math.log(CORPUS_VOCAB))


# the case of the issue: the learning rate at 1e6 (or 1e3) from the first update, no clipping,
# a checkpoint every iteration; the guard at its defaults, the NaN check on (its default)
def _diverge(lr, iters=50):
    return ["--lr", lr, "--min-lr", "0", "--clip-grad", "0", "--train-iters", str(iters), "--save-interval", "1"]


def test_divergence_leaves_a_checkpoint_that_trains(corpus, tmp_path):
    """4 healthy iterations (checkpoints at 2 and 4), then the run goes on at --lr 1e3, whose
    first update gives a finite loss of about 3e7 against 6: a spike against the window restored
    from the checkpoint of iteration 4, and so are the next four (the weights stay broken), so
    the run stops without writing the checkpoint of 5. Without the guard the run saves every
    iteration and its latest checkpoint cannot train on."""
    healthy = str(tmp_path / "healthy")
    _train(corpus, tmp_path, "healthy", "--train-iters", "4", "--lr", "1e-3", "--save", healthy,
           "--save-interval", "2", *GUARD)
    for name in ("guarded", "unguarded"):
        shutil.copytree(healthy, tmp_path / name)
    ck = str(tmp_path / "guarded")
    records, proc = _train(corpus, tmp_path, "guarded", *_diverge("1e3"), *GUARD, "--load", ck, "--save", ck,
                           "--override-opt_param-scheduler", check=False)  # (not the checkpoint's lr)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr, proc.stderr[-3000:]  # torchrun's status: 1
    assert "5 iterations in a row skipped for spikes" in proc.stderr, proc.stderr[-3000:]
    assert [r["iteration"] for r in records if r.get("event") == "spike"] == [6, 7, 8, 9, 10]
    assert "checkpoint of iteration 5 not written" in proc.stdout and read_tracker(ck) == 4
    assert _trains_on(corpus, tmp_path, ck, "resume-guarded", expect_success=True)
    ck = str(tmp_path / "unguarded")
    _train(corpus, tmp_path, "unguarded", *_diverge("1e3", iters=8), "--load", ck, "--save", ck,
           "--override-opt_param-scheduler")  # finite losses
    assert read_tracker(ck) > 5 and not _trains_on(corpus, tmp_path, ck, "resume-unguarded", expect_success=False)


def test_first_update_that_breaks_the_weights_writes_no_checkpoint(corpus, tmp_path):
    """The case of the issue from the first iteration. (At --lr 1e6 this model's loss after the
    first update is NaN at once and the NaN check stops the run before any checkpoint, as
    test_nan_check.py tests.) At 1e3 it is finite, 3e7, judged against the first loss (6.2)
    alone: a spike, so the weights of the first update are never saved, nor any later, and the
    run stops after --spike-patience, saying there is no checkpoint to resume from. One process
    (`python pretrain_gpt.py`): the stop on 2 ranks under torchrun is test_divergence_...'s."""
    ck = str(tmp_path / "ck")
    records, proc = _train(corpus, tmp_path, "fresh", *_diverge("1e3"), *GUARD, "--save", ck, check=False, nproc=1)
    assert proc.returncode != 0 and "No checkpoint of weights that trained on was written" in proc.stderr, \
        proc.stderr[-3000:]
    assert [r["iteration"] for r in records if r.get("event") == "spike"] == [2, 3, 4, 5, 6]
    assert "checkpoint of iteration 1 not written" in proc.stdout and read_tracker(ck) is None


@pytest.mark.parametrize("data", ["mock", "corpus"])
def test_healthy_run_is_unchanged_bit_for_bit(data, corpus, tmp_path):
    """The default guard judges from the second iteration on: a healthy run's early losses fall
    fast, on real text (corpus) as on random tokens (mock), and are never flagged."""
    flags = (mock(256) if data == "mock" else corpus) + tiny(
        train_iters=6, log_interval=1, eval_iters=0, global_batch_size=4) + ["--hidden-dropout", "0.1",
                                                                             "--save-interval", "2"]
    plain, _ = run_pretrain(1, flags + ["--save", str(tmp_path / "plain")], tmp_path, "plain")
    guarded, proc = run_pretrain(1, flags + GUARD + ["--save", str(tmp_path / "guarded")], tmp_path, "guarded")
    assert train_losses(plain) == train_losses(guarded) and grad_norms(plain) == grad_norms(guarded)
    if data == "corpus":
        assert train_losses(plain)[-1] < train_losses(plain)[0] - 0.1  # it learns: judged all along
    assert not [r for r in guarded if r.get("event") == "spike"]
    for it in (2, 4, 6):
        files = [f"iter_{it:07d}/rank_00000.safetensors"]
        for f in files:
            a, b = load_file(str(tmp_path / "plain" / f)), load_file(str(tmp_path / "guarded" / f))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (it, f)
        meta = [json.load(open(tmp_path / d / f"iter_{it:07d}" / "metadata.json")) for d in ("plain", "guarded")]
        assert meta[0]["consumed_samples"] == meta[1]["consumed_samples"]
    assert os.path.isdir(tmp_path / "guarded" / "iter_0000006")


def _guard_in(root: str, iteration: int) -> dict:
    with open(os.path.join(root, f"iter_{iteration:07d}", "metadata.json")) as f:
        return json.load(f)["spike_guard"]


def test_resumed_run_flags_the_same_spikes(corpus, tmp_path):
    """A tight guard (factor 1.05, window 2) on 2 ranks flags the early gradient norms (1.74 after
    1.61, ...); the run resumed from its checkpoint of iteration 2 (itself skipped) flags the same
    iterations and trains bit for bit as the uninterrupted run, its checkpoints holding the same
    window, because the window of iteration 2 comes back with the checkpoint (an empty one would
    take iteration 3 unjudged)."""
    flags = corpus + tiny(train_iters=8, log_interval=1, eval_iters=0) + GUARD + [
        "--spike-factor", "1.05", "--spike-window", "2", "--spike-patience", "20", "--save-interval", "2"]
    whole_ck, ck = str(tmp_path / "whole"), str(tmp_path / "resumed")
    whole, _ = run_pretrain(2, flags + ["--save", whole_ck], tmp_path, "whole")
    spikes = [r["iteration"] for r in whole if r.get("event") == "spike"]
    assert 2 in spikes and 3 in spikes, spikes  # the test needs a spike on each side of the resume
    # the saved window: the values of the accepted iterations up to 2 (the checkpoint's), the skips in a row
    logs = [r for r in whole if "consumed_samples" in r]
    accepted = [r for r in logs if r["iteration"] <= 2 and not r["skipped_iterations"]]
    assert _guard_in(whole_ck, 2) == {"losses": [r["lm_loss"] for r in accepted][-2:],
                                      "grad_norms": [r["grad_norm"] for r in accepted][-2:], "consecutive": 1}
    os.makedirs(ck)
    shutil.copytree(os.path.join(whole_ck, "iter_0000002"), os.path.join(ck, "iter_0000002"))
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    resumed, _ = run_pretrain(2, flags + ["--load", ck, "--save", ck], tmp_path, "resumed")
    assert [r["iteration"] for r in resumed if r.get("event") == "spike"] == [i for i in spikes if i > 2]
    assert train_losses(resumed) == train_losses(whole)[2:] and grad_norms(resumed) == grad_norms(whole)[2:]
    for it in (4, 6, 8):
        assert _guard_in(ck, it) == _guard_in(whole_ck, it), it
