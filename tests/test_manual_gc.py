"""--manual-gc: Python's collector is off during training and runs at the same iterations on
every rank (a function of the iteration number alone) and around evaluations; and the
operations flags refuse values that cannot work."""
import gc

import pytest

import pretrain_gpt
from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny

FLAGS = mock(100) + tiny(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, global_batch_size=None,
                          train_iters=7, log_interval=7)


@pytest.mark.parametrize("extra,collections", [
    (["--manual-gc-interval", "3", "--eval-iters", "0"], 1 + 2),  # start, iterations 3 and 6
    (["--manual-gc-interval", "2", "--eval-iters", "1"], 1 + 3 + 2 * 2),  # + before and after valid and test
    (["--manual-gc-interval", "2", "--eval-iters", "1", "--no-manual-gc-eval"], 1 + 3),
])
def test_manual_gc_collects_at_fixed_iterations(monkeypatch, extra, collections):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(gc.isenabled()) or 0)
    assert gc.isenabled()
    assert pretrain_gpt.main(FLAGS + ["--manual-gc"] + extra) == 0
    assert len(calls) == collections and not any(calls)  # automatic collection off all along
    assert gc.isenabled()  # and back on for the caller


@pytest.mark.parametrize("extra,message", [
    (["--manual-gc-interval", "5"], "--manual-gc-interval / --no-manual-gc-eval need --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be an integer >= 0"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be a number > 0"),
    (["--distributed-timeout-minutes", "nan"], "--distributed-timeout-minutes must be a number > 0"),
])
def test_operations_flags_are_checked(extra, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(FLAGS + extra), 1, check_files=False)
