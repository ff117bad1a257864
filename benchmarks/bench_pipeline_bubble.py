"""Measured pipeline bubble of megalite's schedules next to the theory (p-1)/(v·m + p - 1).

Each model chunk is a stand-in whose forward takes t_f / v seconds and backward 2·t_f / v
(sleeps, so p processes on a 2-core machine behave like p independent devices), run through
the real schedules and point-to-point exchange (gloo). Per rank, idle fraction =
1 - busy time / iteration time. Usage:

    python benchmarks/bench_pipeline_bubble.py [--tf-ms 20] [--output benchmarks/RESULTS_pipeline_bubble.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dist_helpers import spawn  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds, busy):
        ctx.seconds, ctx.busy = seconds, busy
        time.sleep(seconds)
        busy[0] += seconds
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.seconds)
        ctx.busy[0] += 2 * ctx.seconds
        return g, None, None


class StandInChunk(torch.nn.Module):
    def __init__(self, shape, seconds, busy, pre_process, post_process):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.shape, self.seconds, self.busy = shape, seconds, busy
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, input_ids, position_ids, attention_mask, labels):
        x = torch.ones(self.shape) if self.pre_process else self.input_tensor
        y = _Sleep.apply(x * self.w, self.seconds, self.busy)
        return y.sum(-1) if self.post_process else y  # the last stage: "per-token losses"


def _run(rank, world, m, v, tf):
    import torch.distributed as dist

    from megalite import parallel_state
    from megalite.pipeline_parallel import default_schedule_name, get_schedule
    from megalite.pipeline_parallel.p2p import PipeComm

    ps = parallel_state.initialize(tp=1, pp=world, vpp=v)
    shape = (8, 2, 16)
    busy = [0.0]
    chunks = [StandInChunk(shape, tf / v, busy, ps.is_first_stage and c == 0, ps.is_last_stage and c == v - 1)
              for c in range(v)]

    # the schedule reads one micro-batch per chunk per step; the stand-ins ignore all but the mask
    batch = {"input_ids": None, "position_ids": None, "attention_mask": None, "labels": None,
             "loss_mask": torch.ones(shape[:2])}
    fb = get_schedule(default_schedule_name(world, v))
    comm = PipeComm(ps, shape, torch.float32, torch.device("cpu"))
    results = []
    for it in range(3):  # first iteration warms up the communicators
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        fb(batches=[iter(lambda: batch, None) for _ in range(v)], model=chunks, num_microbatches=m,
           backward_scale=1.0, comm=comm)
        dist.barrier()
        wall = time.perf_counter() - start
        if it > 0:
            results.append(1.0 - busy[0] / wall)
    return sum(results) / len(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tf-ms", type=float, default=20.0, help="forward time of one stage for one micro-batch")
    ap.add_argument("--output", help="write a markdown table here")
    args = ap.parse_args()
    tf = args.tf_ms / 1000
    rows = ["| p | m | v | theory (p-1)/(v·m+p-1) | measured idle, mean over stages | per stage |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p, m, v in [(2, 4, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (4, 8, 4)]:
        idle = spawn(_run, p, m, v, tf, timeout=600)
        theory = (p - 1) / (v * m + p - 1)
        mean = sum(idle) / len(idle)
        rows.append(f"| {p} | {m} | {v} | {theory:.3f} | {mean:.3f} | {' '.join(f'{x:.3f}' for x in idle)} |")
        print(rows[-1], flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
