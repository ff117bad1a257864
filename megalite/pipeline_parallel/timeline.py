"""--log-pipeline-timeline: when each pass of one iteration ran on each rank, and how long each rank idled.

Each rank records its passes' (kind, chunk, micro-batch, start, end): F a forward, B an input
gradient, W a weight gradient (the zero-bubble schedules' split backward, tensor_parallel/wgrad.py),
BW a whole backward (1F1B, interleaved 1F1B, no pipelining). The logging rank gathers them into one
`pipeline_timeline` JSONL record per iteration, times in seconds from the iteration's first start on
any rank (wall clocks: the ranks of one machine share it; across machines it is as good as their
clock sync), with each rank's idle fraction: the share of the span from the first start to the last
end on any rank in which the rank ran no pass. tools/plot_metrics.py draws it, one row per rank.
"""
from __future__ import annotations

import contextlib
import time

import torch

from .. import comm


class Timeline:
    """This rank's passes in the current iteration."""

    def __init__(self, device: torch.device | None = None):
        self.sync = device is not None and device.type == "cuda"  # kernels run async: time their completion
        self.events: list = []

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.time()

    @contextlib.contextmanager
    def span(self, kind: str, chunk: int, microbatch: int):
        start = self._now()
        yield
        self.events.append((kind, chunk, microbatch, start, self._now()))

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def idle_fractions(ranks: list[list]) -> list[float]:
    """Per rank, the idle share of the span over all ranks' (kind, chunk, mb, start, end) events."""
    starts = [e[3] for events in ranks for e in events]
    ends = [e[4] for events in ranks for e in events]
    if not starts:
        return [0.0 for _ in ranks]
    span = max(ends) - min(starts)
    return [1.0 - min(1.0, sum(e[4] - e[3] for e in events) / span) if span > 0 else 0.0 for events in ranks]


def gather_record(timeline: Timeline, ps, iteration: int) -> dict | None:
    """Every rank's events of the iteration, on the logging rank (None elsewhere): a collective."""
    mine = {"rank": ps.rank, "pp_rank": ps.pp_rank, "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank,
            "cp_rank": ps.cp_rank, "events": timeline.take()}
    gathered = comm.gather_object(mine, ps.logging_rank, comm.world_group())
    if gathered is None:
        return None
    gathered.sort(key=lambda r: (r["pp_rank"], r["rank"]))
    t0 = min((e[3] for r in gathered for e in r["events"]), default=0.0)
    idle = idle_fractions([r["events"] for r in gathered])
    ranks = [{**{k: v for k, v in r.items() if k != "events"}, "idle_fraction": round(f, 4),
              "events": [[k, c, mb, round(a - t0, 6), round(b - t0, 6)] for k, c, mb, a, b in r["events"]]}
             for r, f in zip(gathered, idle)]
    return {"event": "pipeline_timeline", "iteration": iteration, "ranks": ranks}


def idle_line(record: dict) -> str:
    """The console line: each rank's idle fraction."""
    parts = [f"rank {r['rank']} (pp {r['pp_rank']}) {100 * r['idle_fraction']:.1f}%" for r in record["ranks"]]
    return f" pipeline idle (iteration {record['iteration']}): " + ", ".join(parts)


def report(timeline: Timeline, ps, iteration: int, write, log) -> None:
    """Gather the iteration's timeline (a collective), `write` its record and `log` the idle line."""
    record = gather_record(timeline, ps, iteration)
    if record is not None:
        write(record)
        log(idle_line(record))
