"""What the loop knows about communication: where the run stands when a collective fails or
hangs, and how long this rank was blocked in collectives.

comm.py tells the installed CommMonitor about every blocking call (a synchronous collective,
the wait() of an asynchronous one, a pipeline send/recv batch):

- **failures and timeouts** (--distributed-timeout-minutes): every process group is created
  with that timeout, so on gloo a collective whose peer is hung, stopped or dead raises after
  it. The monitor turns the backend's error into a `CollectiveError` naming the collective, its
  group and members, the iteration and this rank's pipeline stage, and dumps this rank's Python
  stacks (faulthandler) first, so every rank that is still running shows where it was.
- **a watchdog thread** reports (stacks and the same names) a blocking call that outlives the
  timeout without the backend raising, and on CUDA an iteration that does (NCCL collectives do
  not block the host: a hang surfaces at the next synchronisation, and NCCL's own watchdog then
  aborts the process after the timeout; this report comes first and says where the run was).
- **wait time** (--log-straggler): seconds spent blocked, summed; the straggler detector
  subtracts them from the step time. On CUDA each blocking call is bracketed by
  synchronisations when timing, so the compute queued before it is not counted as waiting.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..comm import CollectiveError


class CommMonitor:
    def __init__(self, ps, device: torch.device, timeout_minutes: float, time_waits: bool = False):
        self.ps, self.device = ps, device
        self.timeout_minutes = timeout_minutes
        self.timeout_s = 60.0 * timeout_minutes
        self.time_waits = time_waits
        self.sync = time_waits and device.type == "cuda"
        self.where = "at start-up"  # set by the loop: "in iteration 7", "in the checkpoint save ...", ...
        self.wait_s = 0.0  # seconds blocked in collectives, summed (read by the straggler detector)
        self.in_flight: tuple | None = None  # (name, group, start) of the blocking call under way
        self.last: tuple | None = None  # the last call entered (NCCL: the last collective issued)
        self.step_start: float | None = None  # CUDA watchdog: when the current iteration started
        self._reported = None
        self._stop = threading.Event()

    # -- called by comm.py -------------------------------------------------------------------------
    def enter(self, name: str, group) -> tuple:
        if self.sync:
            torch.cuda.synchronize()  # compute queued before the collective is compute, not waiting
        token = (name, group, time.perf_counter())
        self.in_flight = self.last = token
        return token

    def exit(self, token: tuple) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.wait_s += time.perf_counter() - token[2]
        self.in_flight = None

    def failed(self, token: tuple, exc: BaseException) -> CollectiveError:
        name, group, start = token
        elapsed = time.perf_counter() - start
        self.in_flight = None
        cause = " ".join(str(exc).split())
        timed_out = elapsed >= 0.9 * self.timeout_s or "timed out" in cause.lower()
        what = (f"timed out after {elapsed:.1f} s (--distributed-timeout-minutes {self.timeout_minutes:g}): a rank "
                f"of that group is hung, stopped or dead, or far slower than this one" if timed_out else
                f"failed after {elapsed:.1f} s: a rank of that group died or closed its connection")
        msg = f"{self.rank_description()} {self.where}: {name} over {self.group_description(group)} {what}"
        self._dump(msg)
        return CollectiveError(f"{msg}. This rank's Python stacks are printed above. Backend error: {cause}")

    # -- naming ------------------------------------------------------------------------------------
    def rank_description(self) -> str:
        ps = self.ps
        return (f"rank {ps.rank} (pipeline stage {ps.pp_rank} of {ps.pp_size}, TP rank {ps.tp_rank}, "
                f"DP rank {ps.dp_rank})")

    def group_description(self, group) -> str:
        ps = self.ps
        if group is None:
            return "the pipeline point-to-point channel"
        named = [(ps.tp_group, "tensor-parallel", ps.tp_ranks), (ps.pp_group, "pipeline-parallel", ps.pp_ranks),
                 (ps.dp_group, "data-parallel", ps.dp_ranks), (ps.embedding_group, "embedding", ps.embedding_ranks),
                 (ps.mp_group, "model-parallel", None),
                 (getattr(ps, "cp_group", None), "context-parallel", getattr(ps, "cp_ranks", None)),
                 (getattr(ps, "dp_cp_group", None), "data-parallel x context-parallel", getattr(ps, "dp_cp_ranks", None)),
                 (getattr(ps, "ep_group", None), "expert-parallel", getattr(ps, "ep_ranks", None)),
                 (getattr(ps, "etp_group", None), "expert-tensor-parallel", getattr(ps, "etp_ranks", None)),
                 (getattr(ps, "expert_dp_group", None), "expert-data-parallel", getattr(ps, "expert_dp_ranks", None))]
        for g, label, ranks in named:
            if g is not None and group is g:
                if ranks is None:
                    ranks = sorted(dist.get_process_group_ranks(g))
                return f"the {label} group (ranks {ranks})"
        if group is dist.group.WORLD:
            return f"the world group ({ps.world_size} ranks)"
        return f"a group of ranks {sorted(dist.get_process_group_ranks(group))}"

    def _dump(self, msg: str) -> None:
        print(f"megalite: {msg}; this rank's Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()

    # -- watchdog ----------------------------------------------------------------------------------
    def start_watchdog(self, grace_s: float = 10.0) -> None:
        """Report (once per stall) a blocking call, or on CUDA an iteration, that outlives the
        timeout by `grace_s` without the backend raising."""
        def watch():
            period = min(1.0, max(0.05, self.timeout_s / 20))
            while not self._stop.wait(period):
                self.check(time.perf_counter(), grace_s)

        self._thread = threading.Thread(target=watch, name="megalite-comm-watchdog", daemon=True)
        self._thread.start()

    def check(self, now: float, grace_s: float) -> str | None:
        """The watchdog's test, one tick; returns the report it printed, if any."""
        stalled = None
        token = self.in_flight
        if token is not None and now - token[2] > self.timeout_s + grace_s:
            stalled = (token, f"{token[0]} over {self.group_description(token[1])} has blocked for "
                              f"{now - token[2]:.0f} s")
        elif self.device.type == "cuda" and self.step_start is not None and now - self.step_start > self.timeout_s:
            last = self.last
            issued = f"; the last collective issued was {last[0]} over {self.group_description(last[1])}" if last else ""
            stalled = (self.step_start, f"the iteration has run for {now - self.step_start:.0f} s{issued}")
        if stalled is None or stalled[0] == self._reported:  # once per stall
            return None
        self._reported = stalled[0]
        msg = (f"{self.rank_description()} {self.where}: {stalled[1]}, longer than --distributed-timeout-minutes "
               f"{self.timeout_minutes:g}; a rank is hung, stopped or dead (pid {os.getpid()})")
        self._dump(msg)
        return msg

    def stop(self) -> None:
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join()
            self._thread = None
