#!/usr/bin/env python3
"""Recovery from a failed rank on this machine: the time from the fault to the next completed
iteration, and the iterations redone, for torchrun's restart (--max-restarts 1) resuming from

- `persistent`: the latest persistent checkpoint on disk (--save-interval S), and
- `local`: the latest non-persistent local checkpoint (--non-persistent-save-interval 1,
  --non-persistent-ckpt-type local, --replication --replication-jump 1), with the persistent ones,

for three faults of rank 1: `kill` (kill -9), `stop` (SIGSTOP: found by the collective timeout,
--distributed-timeout-minutes), `lost` (kill -9 and its local checkpoint directory deleted: the
state comes back from its replica; persistent runs: the same as kill).

    python benchmarks/bench_resilience.py [--worlds 4 8] [--faults kill stop lost] [--out RESULTS.md]

Each run: pretrain_gpt.py under torchrun on gloo (CPU, one thread per rank), a 4-layer GPT
(hidden 256, seq 128, mock data); the fault hits when iteration --fault-at is logged; times come
from when each JSONL record appears (polled every 20 ms). In-process restart (survivors keep
their processes and rebuild their groups) is not built: docs/operations.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from proc_helpers import kill_all, ranks_now, start_torchrun, workers  # noqa: E402

MODEL = ["--mock-data", "--vocab-size", "1024", "--num-layers", "4", "--hidden-size", "256",
         "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "1", "--lr", "1e-4",
         "--log-interval", "1", "--eval-iters", "0", "--train-iters", "40"]


def flags(mode: str, tmp: str, save_interval: int, timeout_min: float) -> list:
    f = MODEL + ["--global-batch-size", "8", "--save", f"{tmp}/ck", "--load", f"{tmp}/ck", "--save-interval",
                 str(save_interval), "--distributed-timeout-minutes", str(timeout_min)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--faults", nargs="+", default=["kill", "stop", "lost"])
    ap.add_argument("--modes", nargs="+", default=["persistent", "local"])
    ap.add_argument("--fault-at", type=int, default=14)
    ap.add_argument("--save-interval", type=int, default=10)
    ap.add_argument("--timeout-minutes", type=float, default=0.25)
    a = ap.parse_args()
    rows = []
    for world in a.worlds:
        for fault in a.faults:
            for mode in a.modes:
                r = one(world, mode, fault, a.fault_at, a.save_interval, a.timeout_minutes)
                rows.append(r)
                print(f"| {world} | {fault} | {mode} | {r['recovery_s']:.1f} | {r['iterations_redone']} | "
                      f"{r['resumed_from']} | {'yes' if r['replica'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
