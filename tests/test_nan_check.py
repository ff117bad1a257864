"""--check-for-nan-in-loss-and-grad (on by default): a run driven to divergence stops with a
non-zero status naming the iteration and the rank(s), before the optimizer writes NaN/Inf into
the weights, so its latest checkpoint holds finite weights; a save of non-finite weights is
refused; the flag's negation restores the old behaviour."""
import os

import pytest
import torch

from dist_helpers import run_pretrain
from megalite.checkpoint.paths import read_tracker
from megalite.checkpoint.offline import load_full_state_dict
from megalite.checkpoint.native.save import CheckpointSaver
from megalite.errors import CheckpointError
from tiny import mock, tiny

DIVERGE = mock(1000) + tiny(global_batch_size=4, train_iters=30, lr=1e6, clip_grad=0, log_interval=1, eval_iters=0,
                             pipeline_model_parallel_size=2)


def test_divergence_stops_before_the_step_and_checkpoints_stay_finite(tmp_path):
    ck = str(tmp_path / "ck")
    records, proc = run_pretrain(2, DIVERGE + ["--save", ck, "--save-interval", "1"], tmp_path, "diverge", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors, proc.stderr[-3000:]
    last = read_tracker(ck)
    # stopped at the first non-finite iteration: the one after the latest checkpoint, named with its rank(s)
    assert f"iteration {last + 1}:" in errors[0] and "rank(s) [" in errors[0], errors[0]
    assert "stopped before the optimizer step" in errors[0]
    assert max(r["iteration"] for r in records if "consumed_samples" in r) == last
    _, state = load_full_state_dict(ck)
    assert state and all(bool(torch.isfinite(t).all()) for t in state.values())


def test_the_check_can_be_turned_off(tmp_path):
    records, proc = run_pretrain(2, DIVERGE + ["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad"],
                                 tmp_path, "unchecked")  # must exit 0 (so on the pool of ready ranks)
    losses = [r["lm_loss"] for r in records if "consumed_samples" in r]
    assert len(losses) == 4 and not all(map(lambda x: x == x and abs(x) != float("inf"), losses))


@pytest.fixture
def train_state():
    from test_optimizer_step_count import build
    _, state = build(per_group=False)
    return state


def test_a_save_of_non_finite_weights_is_refused(tmp_path, train_state, monkeypatch):
    monkeypatch.setattr("megalite.checkpoint.native.save.rng_state", lambda ts: ({"rng/torch": torch.get_rng_state()}, {}))
    name, p = train_state.named_params[3]
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match=rf"iteration 7: non-finite values in rank 0: param/{name}/0"):
        CheckpointSaver(str(tmp_path)).save(train_state, 7)
    assert os.listdir(tmp_path) == []  # nothing written, the latest pointer untouched
    CheckpointSaver(str(tmp_path), check_finite=False).save(train_state, 7)  # what the flag's negation allows
    assert read_tracker(str(tmp_path)) == 7
