"""Checkpoints resume exactly, on the same layout or another, survive a kill mid-save, and
refuse a model they do not fit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_helpers import ROOT, run_pretrain

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "1000",
        "--seed", "5"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def losses(records):
    return {r["iteration"]: r["lm_loss"] for r in records if "consumed_samples" in r}


def assert_resume_matches(straight, first, second, rtol):
    a, b = losses(straight), {**losses(first), **losses(second)}
    assert sorted(a) == sorted(b) == list(range(1, 21))
    worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
    assert worst <= rtol, f"resumed run differs by {worst:.2e} (> {rtol:.0e})"


@pytest.mark.parametrize("extra", [[], ["--async-save"]], ids=["sync", "async"])
def test_resume_same_layout_is_exact_with_dropout(tmp_path, extra):
    straight, _ = run_pretrain(1, BASE, tmp_path, "straight")
    ck = str(tmp_path / "ck")
    first, _ = run_pretrain(1, BASE + ["--save", ck, "--save-interval", "10", "--exit-interval", "10"] + extra,
                            tmp_path, "first")
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "10"
    second, _ = run_pretrain(1, BASE + ["--load", ck], tmp_path, "second")
    assert_resume_matches(straight, first, second, 1e-6)


def test_resume_across_layouts_with_distributed_optimizer(tmp_path):
    zero = NO_DROPOUT + ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
    big = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    straight, _ = run_pretrain(1, BASE + NO_DROPOUT, tmp_path, "straight")
    for name, (n1, l1), (n2, l2) in [("to-dp4", (8, big), (4, [])), ("to-tp2pp2", (4, []), (8, big))]:
        ck = str(tmp_path / name)
        first, _ = run_pretrain(n1, BASE + zero + l1 + ["--save", ck, "--save-interval", "10", "--exit-interval", "10"],
                                tmp_path, name + "-1")
        second, _ = run_pretrain(n2, BASE + zero + l2 + ["--load", ck], tmp_path, name + "-2")
        assert_resume_matches(straight, first, second, 1e-5)


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ck")
    run_pretrain(1, BASE + ["--train-iters", "20", "--save", ck, "--save-interval", "5", "--exit-interval", "5"],
                 tmp_path, "first")
    # second run: the save at iteration 10 stalls before publishing; kill it there
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MEGALITE_TEST_SAVE_DELAY_S="60")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--save", ck, "--load", ck,
           "--save-interval", "5"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp_dir = os.path.join(ck, "iter_0000010.tmp")
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(tmp_dir, "rank_00000.safetensors")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(tmp_dir) and not os.path.exists(os.path.join(ck, "iter_0000010"))
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "5"
    # the previous checkpoint loads and training goes on (and the stale temporary is replaced)
    records, proc = run_pretrain(1, BASE + ["--load", ck, "--save", ck, "--save-interval", "5"], tmp_path, "third")
    assert "loaded checkpoint" in proc.stdout and "iteration 5" in proc.stdout
    assert min(losses(records)) == 6 and max(losses(records)) == 20
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "20"
    assert not os.path.exists(tmp_dir)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    ck = str(tmp_path / "ck")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--train-iters", "100000", "--save", ck,
           "--exit-signal-handler", "--log-jsonl", str(tmp_path / "m.jsonl")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(tmp_path / "m.jsonl") and len(open(tmp_path / "m.jsonl").readlines()) > 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "exiting at iteration" in out and "SIGTERM" in out
    it = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read())
    assert it >= 3 and os.path.isdir(os.path.join(ck, f"iter_{it:07d}"))


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    ck = str(tmp_path / "ck")
    run_pretrain(1, BASE + ["--train-iters", "2", "--save", ck], tmp_path, "first")
    flags = [f if f != "64" else "128" for f in BASE]  # --hidden-size 128
    _, proc = run_pretrain(1, flags + ["--load", ck], tmp_path, "second", check=False)
    assert proc.returncode != 0
    assert "--hidden-size is 64 in the checkpoint and 128 in this run" in proc.stderr


def test_finetune_and_no_load_optim(tmp_path):
    ck = str(tmp_path / "ck")
    run_pretrain(1, BASE + ["--train-iters", "4", "--save", ck], tmp_path, "first")
    records, proc = run_pretrain(1, BASE + ["--train-iters", "3", "--load", ck, "--finetune"], tmp_path, "ft")
    assert sorted(losses(records)) == [1, 2, 3]  # iteration 0, fresh optimizer, fresh data order
    meta = json.load(open(os.path.join(ck, "iter_0000004", "metadata.json")))
    assert meta["layout"]["tp"] == 1 and meta["iteration"] == 4 and meta["model_config"]["hidden_size"] == 64
    records, _ = run_pretrain(1, BASE + ["--train-iters", "6", "--load", ck, "--no-load-optim"], tmp_path, "nlo")
    assert sorted(losses(records)) == [5, 6]
