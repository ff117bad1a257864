"""--timing-log-level: the Timers class in one process (levels, sums, resets, min and max over
ranks with one all-reduce, Megatron-LM's text block). A 2-rank run with every timer on, and its
console block, JSONL records and TensorBoard / W&B scalars, is in test_tracking.py; a level-0
run with --log-timers-to-tensorboard in test_arguments.py."""
import pytest
import torch

from megalite.runtime import timers as timers_module
from megalite.runtime.timers import INTERVAL_TIMERS, LEVELS, Timers, timers_text

CPU = torch.device("cpu")


@pytest.fixture
def clock(monkeypatch):
    """time.perf_counter of the timers module, moved by hand (seconds)."""
    now = [0.0]
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: now[0])
    return now


def test_levels_gate_the_timers():
    assert set(INTERVAL_TIMERS) | {"save-checkpoint"} == set(LEVELS)
    off = Timers(0, CPU)
    assert not any(off.enabled(n) for n in LEVELS)
    with off("forward-backward"):  # a no-op: nothing to collect, and no collective
        pass
    assert off.collect(LEVELS) == {}
    it = iter([1, 2])
    assert off.wrap("batch-generator", it) is it
    one, two = Timers(1, CPU), Timers(2, CPU)
    assert [n for n in LEVELS if one.enabled(n)] == [n for n in LEVELS if n != "batch-generator"]
    assert all(two.enabled(n) for n in LEVELS)
    with pytest.raises(KeyError, match="no timer named 'forward'"):
        one("forward")


def test_sums_per_iteration_and_resets(clock):
    def source():  # 2.5 ms to make each micro-batch
        for i in range(2):
            clock[0] += 0.0025
            yield i

    t = Timers(2, CPU)
    for _ in range(4):  # 4 iterations: 30 ms of forward-backward, 5 of them making the batches
        with t("forward-backward"):
            batches = t.wrap("batch-generator", source())
            for _ in range(2):
                next(batches)
                clock[0] += 0.0125
        clock[0] += 1.0  # outside every timer
    with pytest.raises(StopIteration):
        next(batches)
    times = t.collect(INTERVAL_TIMERS, normalizer=4)
    assert list(times) == ["forward-backward", "batch-generator"]  # those that ran, in the given order
    assert times["forward-backward"] == pytest.approx((30.0, 30.0))
    assert times["batch-generator"] == pytest.approx((5.0, 5.0))
    assert t.collect(INTERVAL_TIMERS) == {}  # read and reset
    opt = t("optimizer")
    opt.start()
    clock[0] += 0.004
    assert t.collect(["optimizer"])["optimizer"] == pytest.approx((4.0, 4.0))  # counted up to now ...
    clock[0] += 0.002
    opt.stop()  # ... and still running
    assert t.collect(["optimizer"])["optimizer"] == pytest.approx((2.0, 2.0))
    opt.start()
    with pytest.raises(RuntimeError, match="timer optimizer started twice"):
        opt.start()


def test_min_and_max_over_ranks_in_one_all_reduce(clock, monkeypatch):
    """Two ranks emulated: rank 1's all-reduce input is recorded, rank 0's reduced with it (max).
    A timer only one rank ran has that rank's time as min and max; one no rank ran is left out."""
    ranks = [Timers(1, CPU), Timers(1, CPU)]
    for t, ms in zip(ranks, (5, 7)):
        with t("forward-backward"):
            clock[0] += ms / 1e3
    with ranks[1]("optimizer"):
        clock[0] += 0.003
    sent = []
    monkeypatch.setattr(timers_module.comm, "all_reduce", lambda x, group, op: sent.append(x.clone()) or x)
    ranks[1].collect(INTERVAL_TIMERS)
    calls = []
    monkeypatch.setattr(timers_module.comm, "all_reduce",
                        lambda x, group, op: calls.append(op) or x.copy_(torch.maximum(x, sent[0])))
    times = ranks[0].collect(INTERVAL_TIMERS)
    assert calls == [torch.distributed.ReduceOp.MAX]
    assert list(times) == ["forward-backward", "optimizer"]
    assert times["forward-backward"] == pytest.approx((5.0, 7.0))
    assert times["optimizer"] == pytest.approx((3.0, 3.0))


def test_text_is_megatron_lms_block():
    assert timers_text({"forward-backward": (12.341, 13.009), "optimizer": (0.5, 0.5)}) == (
        "(min, max) time across ranks (ms):\n"
        "    forward-backward ...............................: (12.34, 13.01)\n"
        "    optimizer ......................................: (0.50, 0.50)")


def test_flags_are_accepted_and_say_where_the_timers_go():
    from megalite.arguments import parse_args, validate_args
    from tiny import mock, tiny
    base = mock(1000) + tiny(train_iters=2)
    for level in ("1", "2"):  # no longer refused
        config = validate_args(parse_args(base + ["--timing-log-level", level]), world_size=1)
        assert config.training.timing_log_level == int(level)
    alone = validate_args(parse_args(base + ["--log-timers-to-tensorboard"]), world_size=1)
    assert any(n.startswith("--log-timers-to-tensorboard writes to --tensorboard-dir, --wandb-project and --log-jsonl, "
                            "none of which is given") for n in alone.notices), alone.notices
    to_jsonl = validate_args(parse_args(base + ["--log-timers-to-tensorboard", "--log-jsonl", "r.jsonl"]), world_size=1)
    assert to_jsonl.training.log_timers_to_tensorboard and not to_jsonl.notices
