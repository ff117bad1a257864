#!/usr/bin/env python3
"""Recovery from a failed rank on this machine: the time from the fault to the next completed
iteration, and the iterations redone, for torchrun's restart (--max-restarts 1) resuming from

- `persistent`: the latest persistent checkpoint on disk (--save-interval S), and
- `local`: the latest non-persistent local checkpoint (--non-persistent-save-interval 1,
  --non-persistent-ckpt-type local, --replication --replication-jump 1), with the persistent ones,

against in-process restart (`python -m megalite.inprocess`, megalite/inprocess/):

- `inprocess`: --inprocess-restart with --non-persistent-ckpt-type in_memory (a snapshot every
  iteration, --replication --replication-jump 1); the survivors keep their processes,

for three faults of rank 1: `kill` (kill -9), `stop` (SIGSTOP: under torchrun found by the
collective timeout, --distributed-timeout-minutes; in process by its stale heartbeat,
--inprocess-heartbeat-timeout), `lost` (its copy of its state gone: under torchrun kill -9 and
its local checkpoint directory deleted, the state comes back from its replica, persistent runs:
the same as kill; in process a killed rank's memory is always gone, so `lost` is kill -9 with no
warm spare: a new process takes its place, where kill and stop hand the rank to a warm spare,
--inprocess-active-world-size N of N + 1).

    python benchmarks/bench_resilience.py [--worlds 4 8] [--faults kill stop lost] [--modes ...]

Each run: pretrain_gpt.py on gloo (CPU, one thread per rank), a 4-layer GPT (hidden 256, seq 128,
mock data); the fault hits when iteration --fault-at is logged; times come from when each JSONL
record appears (polled every 20 ms).
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from proc_helpers import children, end_launcher, kill_all, ranks_now, start_torchrun, workers  # noqa: E402

MODEL = ["--mock-data", "--vocab-size", "1024", "--num-layers", "4", "--hidden-size", "256",
         "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "1", "--lr", "1e-4",
         "--log-interval", "1", "--eval-iters", "0", "--train-iters", "40"]


INPROCESS = ["--inprocess-restart", "--inprocess-heartbeat-interval", "1", "--inprocess-heartbeat-timeout", "5",
             "--inprocess-monitor-process-interval", "0.05", "--non-persistent-save-interval", "1",
             "--non-persistent-ckpt-type", "in_memory", "--replication", "--replication-jump", "1"]


def flags(mode: str, tmp: str, save_interval: int, timeout_min: float) -> list:
    f = MODEL + ["--global-batch-size", "8", "--save", f"{tmp}/ck", "--load", f"{tmp}/ck", "--save-interval",
                 str(save_interval), "--distributed-timeout-minutes", str(timeout_min)]
    if mode == "inprocess":
        f += INPROCESS
    if mode == "local":
        f += ["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "local",
              "--non-persistent-local-ckpt-dir", f"{tmp}/local", "--replication", "--replication-jump", "1"]
    return f


class Watch:
    """The JSONL's training records, each with the wall time it was first seen."""

    def __init__(self, path: str):
        self.path, self.offset, self.seen = path, 0, []

    def poll(self) -> None:
        import json
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                r = json.loads(line)
                if "consumed_samples" in r:
                    self.seen.append((r["iteration"], time.time()))


def one(world: int, mode: str, fault: str, fault_at: int, save_interval: int, timeout_min: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench_resilience_")
    proc, jsonl = start_torchrun(world, flags(mode, tmp, save_interval, timeout_min), tmp, "run",
                                 ("--max-restarts", "1"))
    watch = Watch(jsonl)
    try:
        first = workers(proc, world)
        while not any(it >= fault_at for it, _ in watch.seen):
            if proc.poll() is not None:
                raise RuntimeError(open(f"{tmp}/run.err").read()[-3000:])
            watch.poll()
            time.sleep(0.02)
        t_fault = time.time()
        os.kill(first[1], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        if fault == "lost" and mode == "local":
            shutil.rmtree(f"{tmp}/local/rank_00001", ignore_errors=True)
        new = {}
        while len(new) < world:  # torchrun's next attempt: every worker a new process
            watch.poll()
            if proc.poll() is not None:
                raise RuntimeError(open(f"{tmp}/run.err").read()[-3000:])
            new = {r: p for r, p in ranks_now(proc).items() if p not in first.values()}
            time.sleep(0.02)
        done = max(it for it, _ in watch.seen)  # what the first attempt completed
        n = len(watch.seen)
        while len(watch.seen) == n:
            watch.poll()
            if proc.poll() is not None:
                raise RuntimeError(open(f"{tmp}/run.err").read()[-3000:])
            time.sleep(0.02)
        it, t = watch.seen[n]
        out = open(f"{tmp}/run.out").read()
        return {"world": world, "mode": mode, "fault": fault, "recovery_s": t - t_fault,
                "iterations_redone": done - (it - 1), "resumed_from": it - 1, "completed": done,
                "replica": "from their replicas" in out}
    finally:
        if fault == "stop":
            for pid in proc.seen:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        kill_all(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def one_inprocess(world: int, fault: str, fault_at: int, save_interval: int, timeout_min: float) -> dict:
    """The same measurement under python -m megalite.inprocess (a warm spare unless `lost`)."""
    import subprocess
    tmp = tempfile.mkdtemp(prefix="bench_resilience_")
    jsonl = f"{tmp}/run.jsonl"
    spare = fault != "lost"
    f = flags("inprocess", tmp, save_interval, timeout_min) + ["--log-jsonl", jsonl]
    if spare:
        f += ["--inprocess-active-world-size", str(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(f"{tmp}/run.out", "w") as out, open(f"{tmp}/run.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "megalite.inprocess", "--nproc-per-node",
                                 str(world + spare), os.path.join(ROOT, "pretrain_gpt.py"), *f],
                                env=env, stdout=out, stderr=err, cwd=tmp)
    watch, pids = Watch(jsonl), set()

    def alive():
        if proc.poll() is not None:
            raise RuntimeError(open(f"{tmp}/run.err").read()[-3000:])

    try:
        while not any(it >= fault_at for it, _ in watch.seen):
            alive()
            watch.poll()
            time.sleep(0.02)
        pids.update(children(proc.pid))
        victim = next(p for p in pids if slot_of(p) == 1)  # rank 1 of the first generation
        t_fault = time.time()
        os.kill(victim, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        while "generation 1:" not in open(f"{tmp}/run.err").read():  # the launcher replaced rank 1
            alive()
            watch.poll()
            time.sleep(0.02)
        watch.poll()
        done, n = max(it for it, _ in watch.seen), len(watch.seen)
        while len(watch.seen) == n:
            alive()
            watch.poll()
            time.sleep(0.02)
        it, t = watch.seen[n]
        pids.update(children(proc.pid))
        out = open(f"{tmp}/run.out").read()
        return {"world": world, "mode": "inprocess" + ("+spare" if spare else ""), "fault": fault,
                "recovery_s": t - t_fault, "iterations_redone": done - (it - 1), "resumed_from": it - 1,
                "completed": done, "replica": "from their replicas" in out}
    finally:
        end_launcher(proc, pids)
        shutil.rmtree(tmp, ignore_errors=True)


def slot_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"MEGALITE_INPROCESS_SLOT"]) if b"MEGALITE_INPROCESS_SLOT" in env else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--faults", nargs="+", default=["kill", "stop", "lost"])
    ap.add_argument("--modes", nargs="+", default=["persistent", "local", "inprocess"])
    ap.add_argument("--fault-at", type=int, default=14)
    ap.add_argument("--save-interval", type=int, default=10)
    ap.add_argument("--timeout-minutes", type=float, default=0.25)
    a = ap.parse_args()
    rows = []
    for world in a.worlds:
        for fault in a.faults:
            for mode in a.modes:
                run = one_inprocess if mode == "inprocess" else functools.partial(one, mode=mode)
                r = run(world=world, fault=fault, fault_at=a.fault_at, save_interval=a.save_interval,
                        timeout_min=a.timeout_minutes)
                rows.append(r)
                print(f"| {world} | {fault} | {r['mode']} | {r['recovery_s']:.1f} | {r['iterations_redone']} | "
                      f"{r['resumed_from']} | {'yes' if r['replica'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
