"""Checkpoints resume exactly, on the same layout or another, survive a kill mid-save, and
refuse a model they do not fit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_helpers import ROOT, load_params, run_pretrain
from tiny import tiny

MODEL = tiny(num_layers=4, train_iters=20, lr=3e-3, log_interval=1, eval_iters=1, eval_interval=1000, seed=5)
# mock tokens where only the process's behaviour matters (kill, SIGTERM, a mismatched model);
# resumption is checked on real text, where a model that lost its weights would show it
BASE = ["--mock-data", "--vocab-size", "1000"] + MODEL
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def losses(records):
    return {r["iteration"]: r["lm_loss"] for r in records if "consumed_samples" in r}


def assert_resume_matches(straight, first, second, rtol):
    a, b = losses(straight), {**losses(first), **losses(second)}
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert a[20] < a[1] - 0.5, a  # the model learns: a resumed run that lost its weights would show it
    worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
    assert worst <= rtol, f"resumed run differs by {worst:.2e} (> {rtol:.0e})"


@pytest.fixture(scope="module")
def straight_with_dropout(corpus, tmp_path_factory):
    """The uninterrupted 20 iterations both resumptions below compare with (run once)."""
    return run_pretrain(1, corpus + MODEL, tmp_path_factory.mktemp("straight"), "straight")[0]


@pytest.mark.parametrize("extra", [[], ["--async-save"], ["--ckpt-format", "torch_dist", "--async-save",
                                                          "--save-retain-interval", "20"]],
                         ids=["sync", "async", "torch_dist-async"])
def test_resume_same_layout_is_exact_with_dropout(corpus, straight_with_dropout, tmp_path, extra):
    flags = corpus + MODEL
    straight = straight_with_dropout
    ck = str(tmp_path / "ck")
    first, _ = run_pretrain(1, flags + ["--save", ck, "--save-interval", "10", "--exit-interval", "10"] + extra,
                            tmp_path, "first")
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "10"
    again = ["--save", ck, "--save-interval", "10"] + extra if "torch_dist" in extra else []
    second, _ = run_pretrain(1, flags + ["--load", ck] + again, tmp_path, "second")
    assert_resume_matches(straight, first, second, 1e-6)
    if "torch_dist" in extra:  # Megatron-LM's format resumes exactly too (optimizer state, RNG), and
        # --save-retain-interval 20 deleted the half-way checkpoint once the final one was in place
        assert sorted(os.listdir(ck)) == ["iter_0000020", "latest_checkpointed_iteration.txt"]


def test_resume_across_layouts_with_distributed_optimizer(corpus, tmp_path):
    zero = NO_DROPOUT + ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
    big = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    flags = corpus + MODEL + zero
    straight, _ = run_pretrain(1, corpus + MODEL + NO_DROPOUT, tmp_path, "straight")
    for name, (n1, l1), (n2, l2) in [("to-dp4", (8, big), (4, [])), ("to-tp2pp2", (4, []), (8, big))]:
        ck = str(tmp_path / name)
        first, _ = run_pretrain(n1, flags + l1 + ["--save", ck, "--save-interval", "10", "--exit-interval", "10"],
                                tmp_path, name + "-1")
        second, _ = run_pretrain(n2, flags + l2 + ["--load", ck], tmp_path, name + "-2")
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
    """Saved without biases; resumed with 6 layers instead of 4 and biases: one error line names
    both flags, each value the right way round, and the flag that would take them."""
    ck = str(tmp_path / "ck")
    run_pretrain(1, BASE + ["--train-iters", "2", "--save", ck, "--disable-bias-linear"], tmp_path, "first")
    _, proc = run_pretrain(1, BASE + ["--train-iters", "2", "--num-layers", "6", "--load", ck], tmp_path, "second",
                           check=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].endswith(
        "does not match this model: --num-layers is 4 in the checkpoint and 6 in this run; --disable-bias-linear is "
        "True in the checkpoint and False in this run. --use-checkpoint-args takes these from the checkpoint "
        "(--num-layers only where the command line leaves it off)"), errors[0]


def test_a_longer_schedule_is_refused_overridden_or_kept(tmp_path):
    """Saved at 4 of 8 iterations (warmup 2, linear decay over 8); resumed for 12: refused naming
    the decay length; --override-opt_param-scheduler runs the decay over 12 from iteration 5 on,
    --use-checkpoint-opt_param-scheduler the uninterrupted run's decay over 8 (then the minimum)."""
    lr, min_lr = 3e-3, 1e-4
    flags = BASE + ["--lr-warmup-iters", "2", "--min-lr", str(min_lr)]
    ck = str(tmp_path / "ck")
    first, _ = run_pretrain(1, flags + ["--train-iters", "8", "--save", ck, "--save-interval", "4", "--exit-interval",
                                        "4"], tmp_path, "first")
    longer = flags + ["--train-iters", "12", "--load", ck]
    _, proc = run_pretrain(1, longer, tmp_path, "refused", check=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert ("the decay length (--train-iters, with no --lr-decay-iters) is 8 iterations in the checkpoint and 12 "
            "iterations in this run") in errors[0]

    def expected(iteration, decay):  # the rate of an iteration: the schedule at the step before it
        step = iteration - 1
        if step <= 2:
            return lr * step / 2
        return min_lr + (lr - min_lr) * (1 - (step - 2) / (decay - 2)) if step <= decay else min_lr

    def lrs(records):
        return {r["iteration"]: r["lr"] for r in records if "consumed_samples" in r}
    assert lrs(first) == pytest.approx({i: expected(i, 8) for i in range(1, 5)}, rel=1e-12)
    for name, decay in (("--override-opt_param-scheduler", 12), ("--use-checkpoint-opt_param-scheduler", 8)):
        records, _ = run_pretrain(1, longer + [name], tmp_path, name[2:])
        assert lrs(records) == pytest.approx({i: expected(i, decay) for i in range(5, 13)}, rel=1e-12), name


def test_finetune_and_no_load_optim_load_weights_but_not_optimizer_state(corpus, tmp_path):
    """After 4 iterations, one more step three ways: resumed (optimizer state loaded),
    --no-load-optim, and --finetune. A fresh Adam's first step is lr·g/|g| (bias-corrected m̂ = g,
    v̂ = g²), so it moves every weight with a gradient by exactly lr; with loaded moments the
    steps are m̂/√v̂·lr, mostly smaller. The weights themselves must be loaded every time."""
    lr = 1e-2
    flags = corpus + tiny(micro_batch_size=4, global_batch_size=None, train_iters=None, lr=lr, lr_decay_style="constant",
                          weight_decay=0, log_interval=1, eval_iters=0, seed=5) + NO_DROPOUT
    ck = str(tmp_path / "ck")
    first, _ = run_pretrain(1, flags + ["--train-iters", "4", "--save", ck], tmp_path, "first")
    loaded = load_params(ck)
    runs = {}
    for name, extra, iters in (("resume", [], 5), ("no-load-optim", ["--no-load-optim"], 5),
                               ("finetune", ["--finetune"], 1)):
        records, _ = run_pretrain(1, flags + ["--train-iters", str(iters), "--load", ck, "--save",
                                              str(tmp_path / name)] + extra, tmp_path, name)
        runs[name] = records, load_params(str(tmp_path / name))
    (resume, resumed), (nlo, nlo_params), (ft, ft_params) = runs["resume"], runs["no-load-optim"], runs["finetune"]
    assert sorted(losses(resume)) == sorted(losses(nlo)) == [5]  # iteration and data position loaded
    assert sorted(losses(ft)) == [1]  # --finetune: iteration 0, the data from its start
    # weights loaded: the same loss and gradient norm as the resumed run on the same batch, and on
    # the first batch a loss far below the freshly initialised model's
    assert abs(losses(nlo)[5] - losses(resume)[5]) <= 1e-6 * losses(resume)[5]
    assert abs(nlo[-1]["grad_norm"] - resume[-1]["grad_norm"]) <= 1e-5 * resume[-1]["grad_norm"]
    assert losses(ft)[1] < losses(first)[1] - 0.5, (losses(ft), losses(first))

    def fraction_stepped_by_lr(after):
        """Of the weight matrices' elements, the fraction that moved by lr (within 1 %)."""
        n = hit = 0
        for name, w in loaded.items():
            if w.dim() == 2 and name.startswith("decoder."):
                step = (after[name] - w).abs()
                hit += int(((step - lr).abs() < 0.01 * lr).sum())
                n += w.numel()
        return hit / n

    # measured: ~0.9 fresh (the rest have |g| within a few hundred x Adam's eps), 0.0 continued
    fresh_nlo, fresh_ft, continued = (fraction_stepped_by_lr(p) for p in (nlo_params, ft_params, resumed))
    assert fresh_nlo > 0.8 and fresh_ft > 0.8, (fresh_nlo, fresh_ft)
    assert continued < 0.1, continued
    meta = json.load(open(os.path.join(ck, "iter_0000004", "metadata.json")))
    assert meta["layout"]["tp"] == 1 and meta["iteration"] == 4 and meta["model_config"]["hidden_size"] == 64
