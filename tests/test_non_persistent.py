"""--non-persistent-save-interval / --non-persistent-ckpt-type local|global, --replication*
(checkpoint/non_persistent.py, checkpoint/native/local.py).

On 2 gloo ranks (DP 2, dropout on, so RNG states matter): a run stops after iteration 3 having
written persistent checkpoints at 2 (and 3 at its exit, which the test withdraws: the job "died"
before it) and a non-persistent one every iteration; the resumed run (--load) takes the newer
non-persistent checkpoint of 3 and its weights after 6 iterations equal an uninterrupted run's bit
for bit: local with replication after rank 1's directory is deleted (its node's disk lost: its
state comes from rank 0's copy), global; local without replication after the same loss falls
back to the persistent checkpoint of 2, exactly too. Cost: ~60 s wall on the shared 2 cores (7 pool runs).
"""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.native.local import replication_groups
from megalite.checkpoint.paths import TRACKER
from tiny import mock, tiny

BASE = mock(256) + tiny(log_interval=1, eval_iters=0, hidden_dropout=0.1, train_iters=6)


def test_replication_groups_as_megatron_lm():
    assert replication_groups(8, 4, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replication_groups(8, 1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replication_groups(12, 2, 3) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    with pytest.raises(ValueError, match="must divide the world size"):
        replication_groups(6, 4, 2)


@pytest.mark.parametrize("extra, message", [
    (["--non-persistent-ckpt-type", "local"], "go together"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local"], "needs --non-persistent-local"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "in_memory"], "in_memory needs "
     "--inprocess-restart"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global", "--save", "s", "--replication",
      "--replication-jump", "1"], "--replication needs --non-persistent-ckpt-type local"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
      "d", "--replication"], "needs --replication-jump"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
      "d", "--replication", "--replication-jump", "2"], "must divide the world size"),
    (["--replication-jump", "2"], "needs --replication"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"], "needs --non-persistent-global"),
])
def test_settings_that_would_change_nothing_are_refused(extra, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(BASE + extra), 2)


def _files(root, iteration):
    d = os.path.join(root, f"iter_{iteration:07d}")
    return {f: load_file(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    records, _ = run_pretrain(2, BASE + ["--save", str(tmp / "ck"), "--save-interval", "6"], tmp, "reference")
    return train_losses(records), _files(str(tmp / "ck"), 6)


@pytest.mark.parametrize("kind, replication, resumed_from", [
    ("local", True, 3), ("global", False, 3), ("local", False, 2)])
def test_resume_takes_the_newest_and_is_exact(kind, replication, resumed_from, reference, tmp_path):
    ck, local = str(tmp_path / "ck"), str(tmp_path / "local")
    flags = BASE + ["--save", ck, "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", kind]
    if kind == "local":
        flags += ["--non-persistent-local-ckpt-dir", local]
    if replication:
        flags += ["--replication", "--replication-jump", "1"]
    run_pretrain(2, flags + ["--save-interval", "2", "--exit-interval", "3"], tmp_path, "first")
    with open(os.path.join(ck, TRACKER), "w") as f:  # the job died before its persistent save of 3
        f.write("2\n")
    if kind == "local":  # and rank 1's node with its disk
        shutil.rmtree(os.path.join(local, "rank_00001"))
    else:
        assert sorted(os.listdir(os.path.join(ck, "non_persistent"))) == ["iter_0000003", TRACKER]
    records, proc = run_pretrain(2, flags + ["--load", ck, "--save-interval", "6"], tmp_path, "resumed")
    losses, weights = reference
    assert train_losses(records) == losses[resumed_from:]
    got = _files(ck, 6)
    assert got.keys() == weights.keys()
    for f in weights:
        assert all(torch.equal(got[f][k], weights[f][k]) for k in weights[f]), f
    if kind == "local" and replication:
        assert "resumed from the local non-persistent checkpoint of iteration 3" in proc.stdout
        assert "rank(s) [1] from their replicas" in proc.stdout
