"""torchrun runs a test can reach into: find each worker's PID by rank, pause or kill it, and
clean up every process it started.

torchrun starts each worker in a session of its own, so killing torchrun's process group does
not reach them: workers are found as torchrun's children (/proc/*/stat) and addressed by PID.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from dist_helpers import ROOT


def start_torchrun(nproc: int, flags: list[str], tmp_path, name: str, torchrun_args: tuple = ()) -> tuple:
    """Popen of `torchrun --standalone --nproc_per_node nproc [torchrun_args] pretrain_gpt.py flags`
    with --log-jsonl tmp_path/name.jsonl; returns (process, jsonl path). stdout/stderr go to
    tmp_path/name.out / .err."""
    jsonl = os.path.join(str(tmp_path), f"{name}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_args, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--log-jsonl", jsonl]
    out = open(os.path.join(str(tmp_path), f"{name}.out"), "w")
    err = open(os.path.join(str(tmp_path), f"{name}.err"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=str(tmp_path))
    proc.logs = (out, err)
    proc.seen = set()  # every worker PID found, killed at cleanup even if torchrun is gone
    return proc, jsonl


def output(proc) -> tuple[str, str]:
    for f in proc.logs:
        if not f.closed:
            f.flush()
    return open(proc.logs[0].name).read(), open(proc.logs[1].name).read()


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's PID
                out.append(int(entry))
    return out


def ranks_now(proc) -> dict[int, int]:
    """{global rank: PID} of torchrun's workers now (found by their RANK variable), each PID
    remembered in proc.seen so that a test can kill it later."""
    found = {}
    for pid in children(proc.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = pid
    proc.seen.update(found.values())
    return found


def workers(proc, nproc: int, timeout: float = 120.0) -> dict[int, int]:
    """{global rank: PID} of torchrun's current workers, once all `nproc` are up."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = ranks_now(proc)
        if len(found) == nproc:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"torchrun's {nproc} workers did not all start (found {len(found)})")


def state(pid: int) -> str:
    """The process's scheduler state: R (running), S (sleeping, e.g. blocked in a collective), T (stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def records(jsonl: str) -> list[dict]:
    if not os.path.exists(jsonl):
        return []
    with open(jsonl) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_for(predicate, timeout: float, proc=None, what: str = "") -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{output(proc)[1][-3000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"pretrain_gpt.py" in f.read()
    except OSError:
        return False


def kill_pids(pids) -> None:
    """Each of `pids` that still exists killed (continued first, if stopped)."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def end_launcher(proc, pids=()) -> None:
    """`pids` and every child of the launcher `proc` killed, then `proc` itself."""
    kill_pids(set(pids) | set(children(proc.pid)))
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def kill_all(proc) -> None:
    """Every worker of `proc` (continued first if stopped), then torchrun itself."""
    pids = set(proc.seen) | (set(children(proc.pid)) if proc.poll() is None else set())
    kill_pids(p for p in pids if _is_worker(p))
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in proc.logs:
        f.close()
