import math

import pytest

from megalite.optimizer import LRScheduler


def test_warmup_then_cosine():
    s = LRScheduler(1.0, 0.1, warmup_steps=10, decay_steps=110, decay_style="cosine")
    assert s.get_lr(0) == 0.0 and s.get_lr(5) == 0.5 and s.get_lr(10) == 1.0
    assert s.get_lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert s.get_lr(110) == pytest.approx(0.1) and s.get_lr(500) == 0.1


def test_linear_and_constant():
    lin = LRScheduler(2.0, 0.0, 0, 100, "linear")
    assert lin.get_lr(25) == pytest.approx(1.5)
    const = LRScheduler(2.0, 0.0, 5, 100, "constant")
    assert const.get_lr(3) == pytest.approx(1.2) and const.get_lr(90) == 2.0


def test_wsd_is_flat_until_the_decay_window():
    s = LRScheduler(1.0, 0.0, 10, 100, "WSD", wsd_decay_steps=20, wsd_decay_style="linear")
    assert s.get_lr(50) == 1.0 and s.get_lr(80) == 1.0
    assert s.get_lr(90) == pytest.approx(0.5) and s.get_lr(100) == pytest.approx(0.0)


def test_step_and_state_dict():
    s = LRScheduler(1.0, 0.0, 4, 8)
    for _ in range(2):
        s.step()
    t = LRScheduler(1.0, 0.0, 4, 8)
    t.load_state_dict(s.state_dict())
    assert t.get_lr() == s.get_lr() == 0.5
