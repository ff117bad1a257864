"""In-process restart (--inprocess-restart under python -m megalite.inprocess) with
--non-persistent-ckpt-type in_memory (megalite/inprocess/, checkpoint/native/memory.py).

On 4 gloo ranks (DP 4, dropout on, so RNG states matter; a snapshot every iteration replicated on
the neighbour, --replication-jump 1), one run meets two faults: rank 1 frozen (SIGSTOP, found by
its stale heartbeat and killed by the launcher; a warm spare, --inprocess-active-world-size 4 of 5,
takes its place), then rank 2 killed (kill -9; a new process takes its place). Each time the
survivors restart in their processes, the replacement gets its state from its replica, and the
final weights equal an uninterrupted run's bit for bit. A second run meets a fault while the
ranks regroup after the first (rank 3 killed as rank 1's replacement is published): exact too.
The time from a fault to the next logged iteration is printed, not asserted
(benchmarks/bench_resilience.py measures it). Cost: ~47 s wall on 2 cores (the reference run, two
launcher runs); the flag checks, the launcher's bookkeeping (a store, stand-in processes) and
HostSnapshots take ~2 s.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import ROOT, run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.native.memory import HostSnapshots
from proc_helpers import children, end_launcher, records, wait_for
from tiny import mock, tiny

ITERS = 16
BASE = mock(256) + tiny(log_interval=1, eval_iters=0, hidden_dropout=0.1, train_iters=ITERS)
IN_MEMORY = ["--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1", "--replication",
             "--replication-jump", "1"]
INPROCESS = ["--inprocess-restart", "--inprocess-heartbeat-interval", "0.3", "--inprocess-heartbeat-timeout", "3",
             "--inprocess-monitor-process-interval", "0.05"] + IN_MEMORY


@pytest.mark.parametrize("extra, message", [
    (["--inprocess-restart"], "needs --non-persistent-ckpt-type in_memory"),
    (INPROCESS, "needs megalite's launcher: python -m megalite.inprocess"),
    (["--inprocess-heartbeat-timeout", "5"], "--inprocess-heartbeat-timeout needs --inprocess-restart"),
    (["--inprocess-soft-timeout", "5"], "--inprocess-soft-timeout is not supported: megalite's in-process restart"),
    (["--inprocess-restart", "--inprocess-granularity", "node"] + IN_MEMORY, "granularity node is not supported"),
    (["--inprocess-restart"] + IN_MEMORY[:4], "in_memory needs --replication"),
])
def test_inprocess_flags_refused_where_they_cannot_act(extra, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(BASE + extra), 4)


def test_megatron_lm_in_process_settings_accepted_under_the_launcher(monkeypatch):
    """Megatron-LM's --inprocess-* flags at its defaults (arguments.py), as its users pass them."""
    monkeypatch.setenv("MEGALITE_INPROCESS_STORE", "127.0.0.1:1")
    megatron = ["--inprocess-restart", "--inprocess-max-iterations", "3", "--inprocess-heartbeat-interval", "30",
                "--inprocess-heartbeat-timeout", "60", "--inprocess-barrier-timeout", "120",
                "--inprocess-monitor-process-interval", "1.0", "--inprocess-granularity", "rank",
                "--inprocess-active-world-size", "4", "--inprocess-empty-cuda-cache"]
    r = validate_args(parse_args(BASE + megatron + IN_MEMORY), 4).resilience
    assert (r.inprocess_restart, r.inprocess_heartbeat_timeout, r.inprocess_active_world_size) == (True, 60.0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="without CUDA, --distributed-backend nccl runs on gloo")
def test_nccl_is_refused_under_the_launcher(monkeypatch):
    monkeypatch.setenv("MEGALITE_INPROCESS_STORE", "127.0.0.1:1")
    with pytest.raises(ArgumentError, match="--inprocess-restart runs on --distributed-backend gloo only"):
        validate_args(parse_args(BASE + INPROCESS + ["--distributed-backend", "nccl"]), 4, check_files=False)


def test_the_launcher_runs_in_process_restart_only():
    from megalite.arguments.inprocess_launcher import parse_launcher_args
    a = parse_launcher_args(["--nproc-per-node", "5", "pretrain_gpt.py"] + BASE + INPROCESS
                            + ["--inprocess-active-world-size", "4"])
    assert (a.nproc, a.command[0], a.resilience.inprocess_active_world_size) == (5, "pretrain_gpt.py", 4)
    for bad in (BASE, BASE + INPROCESS + ["--inprocess-active-world-size", "6"]):
        with pytest.raises(SystemExit):
            parse_launcher_args(["--nproc-per-node", "5", "pretrain_gpt.py"] + bad)


def test_launcher_generations_spares_and_max_iterations():
    """The launcher's bookkeeping, on a real store and stand-in processes: a dead rank goes to a
    spare in a new generation; past --inprocess-max-iterations the job ends, every worker told."""
    import torch.distributed as dist
    from megalite.arguments.inprocess_launcher import parse_launcher_args
    from megalite.inprocess import membership
    from megalite.inprocess.launcher import Launcher
    a = parse_launcher_args(["--nproc-per-node", "4", "x.py"] + BASE + INPROCESS + ["--inprocess-max-iterations", "1",
                                                                                    "--inprocess-active-world-size", "2"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = Launcher(store, "127.0.0.1", ["x.py"], a.nproc, a.resilience)
    launcher.procs = {slot: object() for slot in (0, 1, 2, 3)}  # slots 2 and 3: spares
    launcher.rank_slot = {0: 0, 1: 1}
    membership.publish(store, 0, {0: 0, 1: 1})
    del launcher.procs[1]
    assert launcher.replace(1, 1, signal.SIGKILL) is None
    assert membership.current(store) == 1 and membership.rank_of(store, 1, 2) == 1
    assert membership.rank_of(store, 1, 0) == 0 and membership.rank_of(store, 1, 3) is None
    del launcher.procs[2]
    assert launcher.replace(1, 2, signal.SIGKILL) == 1
    assert "--inprocess-max-iterations" in membership.aborted(store)
    with pytest.raises(membership.Aborted):
        membership.wait_after(store, 1, 1.0)


def test_host_snapshots_keep_the_newest_two():
    m = HostSnapshots()
    for it in (3, 4, 5):
        m.keep(it, {0: b"a" * it, 1: b"b"})
    assert sorted(m.by_iteration) == [4, 5] and m.nbytes() == 4 + 1 + 5 + 1


def _weights(ck):
    d = os.path.join(ck, f"iter_{ITERS:07d}")
    return {f: load_file(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    recs, _ = run_pretrain(4, BASE + ["--save", str(tmp / "ck"), "--save-interval", str(ITERS)], tmp, "reference")
    return train_losses(recs), _weights(str(tmp / "ck"))


def _slot(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"MEGALITE_INPROCESS_SLOT"])


def _fault(launcher, jsonl, seen, slot, sig, after):
    """Once iteration `after` is logged, send `sig` to the worker in `slot`; wait for the next
    iteration after it and print the time it took."""
    wait_for(lambda: max((r.get("iteration", 0) for r in records(jsonl)), default=0) >= after, 120, launcher,
             f"iteration {after}")
    seen.update(children(launcher.pid))
    victim = next(p for p in children(launcher.pid) if _slot(p) == slot)
    t0, n = time.time(), len(records(jsonl))
    os.kill(victim, sig)
    wait_for(lambda: len(records(jsonl)) > n, 60, launcher, "an iteration after the fault")
    print(f"{signal.Signals(sig).name} of slot {slot}: fault to the next logged iteration {time.time() - t0:.1f} s")
    seen.update(children(launcher.pid))


def _launch(tmp_path, nproc: int, extra=()) -> subprocess.Popen:
    """The launcher with `nproc` worker processes training BASE in process-restart mode, saving the
    final weights to tmp_path/ck and the log to tmp_path/run.jsonl (stdout and stderr in files)."""
    flags = BASE + INPROCESS + ["--save", str(tmp_path / "ck"), "--save-interval", str(ITERS), "--log-jsonl",
                                str(tmp_path / "run.jsonl"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "megalite.inprocess", "--nproc-per-node", str(nproc),
                                 os.path.join(ROOT, "pretrain_gpt.py"), *flags], env=env, stdout=out, stderr=err,
                                cwd=str(tmp_path))


def test_lost_ranks_are_replaced_in_process_exactly(reference, tmp_path):
    """One run, two faults: rank 1 frozen once iteration 5 is logged (found by its heartbeat, killed,
    replaced by the warm spare: 4 of 5 processes train), then rank 2 killed once iteration 10 is
    logged (no spare left: a new process, whose state comes from its replica)."""
    ck, jsonl = str(tmp_path / "ck"), str(tmp_path / "run.jsonl")
    launcher = _launch(tmp_path, 5, ["--inprocess-active-world-size", "4"])  # slot 4 waits as a warm spare
    seen = set()
    try:
        _fault(launcher, jsonl, seen, 1, signal.SIGSTOP, 5)
        _fault(launcher, jsonl, seen, 2, signal.SIGKILL, 10)
        assert launcher.wait(timeout=120) == 0, open(tmp_path / "err").read()[-3000:]
    finally:
        end_launcher(launcher, seen)
    assert not [p for p in seen if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    stdout, stderr = open(tmp_path / "out").read(), open(tmp_path / "err").read()
    assert "resumed from the in_memory non-persistent checkpoint of iteration" in stdout
    assert "no heartbeat for" in stderr and "a warm spare" in stderr and "a new process" in stderr
    # the replacements' memory was empty: each got its state from its replica
    assert "rank(s) [1] from their replicas" in stdout and "rank(s) [2] from their replicas" in stdout
    losses, weights = reference
    got = _weights(ck)
    assert got.keys() == weights.keys()
    for f in weights:
        assert all(torch.equal(got[f][k], weights[f][k]) for k in weights[f]), f
    by_iteration = {r["iteration"]: r["lm_loss"] for r in records(jsonl) if "lm_loss" in r}
    assert [by_iteration[i] for i in range(1, ITERS + 1)] == losses  # the redone iterations too


def test_a_second_fault_while_the_ranks_regroup_is_survived_exactly(reference, tmp_path):
    """Rank 1 killed once iteration 5 is logged; rank 3 killed as soon as the launcher publishes
    the generation that replaces rank 1, while the survivors gather for it. That generation can
    never form (rank 3 will not arrive): the survivors move on to the next one instead of waiting
    in its process group's rendezvous (which held them for --distributed-timeout-minutes), and
    the final weights still equal an uninterrupted run's bit for bit."""
    jsonl = str(tmp_path / "run.jsonl")
    launcher = _launch(tmp_path, 4)
    seen = set()
    try:
        wait_for(lambda: max((r.get("iteration", 0) for r in records(jsonl)), default=0) >= 5, 120, launcher,
                 "iteration 5")
        seen.update(children(launcher.pid))
        slots = {_slot(p): p for p in children(launcher.pid)}
        os.kill(slots[1], signal.SIGKILL)
        wait_for(lambda: "generation 1:" in open(tmp_path / "err").read(), 60, launcher, "generation 1")
        os.kill(slots[3], signal.SIGKILL)
        assert launcher.wait(timeout=120) == 0, open(tmp_path / "err").read()[-3000:]
    finally:
        seen.update(children(launcher.pid))
        end_launcher(launcher, seen)
    stderr = open(tmp_path / "err").read()
    assert "generation 2: rank 3 is slot 5 (a new process)" in stderr, stderr[-3000:]
    _, weights = reference
    got = _weights(str(tmp_path / "ck"))
    for f in weights:
        assert all(torch.equal(got[f][k], weights[f][k]) for k in weights[f]), f
