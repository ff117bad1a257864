"""`python -m megalite.inprocess`: the parent of an in-process-restart job.

    python -m megalite.inprocess --nproc-per-node 4 pretrain_gpt.py --inprocess-restart \\
        --non-persistent-ckpt-type in_memory --non-persistent-save-interval 1 \\
        --replication --replication-jump 1 ...

hosts the store, starts --nproc-per-node workers (the first --inprocess-active-world-size of them
train; the others wait as warm spares), and then watches, every --inprocess-monitor-process-interval
seconds:

- a worker killed by a signal (kill -9, the OOM killer, or this launcher for a stale heartbeat):
  its rank goes to a spare, or to a new process, in the next generation (membership.py); the
  survivors restart in process (worker.py). More than --inprocess-max-iterations restarts ends the job.
- a heartbeat older than --inprocess-heartbeat-timeout (heartbeat.py): that worker is killed.
- a worker that exits with a status of its own (a refused input, 2, or a bug, 1): the job ends
  with that status, every other worker stopped; every rank done: the job ends with 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..config.resilience import LAUNCHER_ENV, REPLACEMENT_ENV, SLOT_ENV
from ..errors import UserError, cli
from . import membership
from .heartbeat import HeartbeatWatch
from .membership import FINISHED


def log(msg: str) -> None:
    print(f"megalite.inprocess: {msg}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, store, addr: str, command: list[str], nproc: int, r):
        self.store, self.addr, self.command, self.nproc, self.r = store, addr, command, nproc, r
        self.active = r.inprocess_active_world_size or nproc
        self.next_slot = 0
        self.procs: dict[int, subprocess.Popen] = {}  # slot -> its process (dead ones removed)
        self.rank_slot: dict[int, int] = {}  # rank -> the slot that is it
        self.done: set[int] = set()
        self.generation = self.restarts = 0
        self.watch = HeartbeatWatch(store, startup_s=r.inprocess_barrier_timeout)

    def spawn(self, replacement: bool = False) -> int:
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        env = dict(os.environ, WORLD_SIZE=str(self.active), MASTER_ADDR=self.addr, MASTER_PORT=str(self.store.port),
                   **{LAUNCHER_ENV: f"{self.addr}:{self.store.port}", SLOT_ENV: str(slot)})
        if replacement:  # it joins this job's run: --save's checkpoints are its own (arguments/paths.py)
            env[REPLACEMENT_ENV] = "1"
        env.pop("RANK", None)  # a worker learns its rank from the generation it joins
        self.procs[slot] = subprocess.Popen(self.command, env=env)
        self.watch.started(slot)
        return slot

    def run(self) -> int:
        slots = [self.spawn() for _ in range(self.nproc)]
        self.rank_slot = {rank: slots[rank] for rank in range(self.active)}
        membership.publish(self.store, 0, {s: r for r, s in self.rank_slot.items()})
        try:
            while True:
                status = self.tick()
                if status is not None:
                    return status
                time.sleep(self.r.inprocess_monitor_process_interval)
        except BaseException as e:  # Ctrl-C, SIGTERM (main's handler), a bug: the workers are told first
            self.end(1, f"the launcher stopped ({type(e).__name__})")
            raise
        finally:
            self.stop_all()

    def tick(self) -> int | None:
        """One look at every worker; the job's exit status once it is over."""
        training = {s: rank for rank, s in self.rank_slot.items()}
        for slot, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None:
                finished = self.store.check([membership.key(f"done/{slot}")])
                age = self.watch.age(slot) if slot in training and not finished else 0.0
                if age > self.r.inprocess_heartbeat_timeout:
                    log(f"rank {training[slot]} (slot {slot}, pid {proc.pid}): no heartbeat for {age:.1f} s "
                        f"(--inprocess-heartbeat-timeout {self.r.inprocess_heartbeat_timeout:g}): killed")
                    proc.kill()
                continue
            del self.procs[slot]
            if rc == 0:
                self.done.add(slot)
            elif rc > 0:
                return self.end(rc, f"slot {slot} exited with status {rc}")
            elif slot in training:
                status = self.replace(training[slot], slot, -rc)
                if status is not None:
                    return status
        if all(s in self.done for s in self.rank_slot.values()):
            self.end(0, FINISHED)
            return 0
        return None

    def replace(self, rank: int, slot: int, signum: int) -> int | None:
        self.restarts += 1
        limit = self.r.inprocess_max_iterations
        if limit is not None and self.restarts > limit:
            return self.end(1, f"rank {rank} died ({signal.Signals(signum).name}) after {limit} in-process restarts "
                               "(--inprocess-max-iterations)")
        spares = [s for s in self.procs if s not in self.rank_slot.values()]
        new = spares[0] if spares else self.spawn(replacement=True)
        self.rank_slot[rank] = new
        self.generation += 1
        membership.publish(self.store, self.generation, {s: r for r, s in self.rank_slot.items()})
        log(f"rank {rank} (slot {slot}) died ({signal.Signals(signum).name}); generation {self.generation}: rank "
            f"{rank} is slot {new} ({'a warm spare' if spares else 'a new process'})")
        return None

    def end(self, status: int, reason: str) -> int:
        self.store.set(membership.key("abort"), reason)
        if status:
            log(f"the job ends: {reason}")
        return status

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Every worker gone: spares and finished ones exit on the abort key; after a failure the
        ones still training are sent SIGTERM (as torchrun); any left after `grace_s` are killed."""
        deadline = time.monotonic() + grace_s
        if membership.aborted(self.store) != FINISHED:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
                    proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@cli("python -m megalite.inprocess")
def main(argv=None) -> int:
    import datetime

    import torch.distributed as dist

    from ..arguments.inprocess_launcher import parse_launcher_args
    a = parse_launcher_args(argv)
    r = a.resilience
    try:
        store = dist.TCPStore(a.master_addr, a.master_port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=r.inprocess_barrier_timeout))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise UserError(f"--master-port {a.master_port} on {a.master_addr} is in use by another process: pick a "
                        "free port, or 0 for one the OS picks") from None
    signal.signal(signal.SIGTERM, _terminated)  # as SIGINT: the workers stopped, not orphaned
    return Launcher(store, a.master_addr, [sys.executable, *a.command], a.nproc, r).run()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


__all__ = ["Launcher", "main"]
