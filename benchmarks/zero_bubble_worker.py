#!/usr/bin/env python3
"""One torchrun job that trains the same model under 1F1B and ZB-H1 in alternating iterations
(bench_zero_bubble.py starts it; not a tool of its own).

On a shared or throttled host the speed of a core drifts by tens of percent within minutes, more
than the difference being measured; two runs one after the other compare two moments as much as
two schedules. Here the contestants alternate every iteration in one process, on one model, one
optimizer and one data stream, so that a drift hits both alike: before each iteration the
schedule is swapped (`Run.forward_backward`) and the weight-gradient store attached (ZB-H1) or
detached (1F1B, whose backward is then the plain one). The ranks meet at a barrier before each
iteration; its time is the logging rank's wall time from there to the end of the optimizer step
(whose gradient-norm reduction waits for every rank). Each iteration's `pipeline_timeline` record
goes into one JSONL file per schedule (tools/plot_metrics.py --timeline draws it), and one
summary record per iteration into --out-jsonl (with each rank's minor page faults in the
iteration: fresh host memory the allocator had to map).

    torchrun --nproc_per_node 2 benchmarks/zero_bubble_worker.py --out-jsonl R.jsonl \\
        --timeline-prefix T --schedules 1f1b zb_h1 --rounds N -- <pretrain_gpt.py flags with --pipeline-schedule zb_h1>
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-jsonl", required=True)
    ap.add_argument("--timeline-prefix", required=True, help="writes <prefix>-<schedule>.jsonl")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1"])
    ap.add_argument("--rounds", type=int, default=4, help="iterations per schedule (after one warm-up each)")
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags

    from megalite import comm
    from megalite.arguments import parse_config
    from megalite.initialize import setup
    from megalite.pipeline_parallel.schedules import get_schedule, splits_backward
    from megalite.pipeline_parallel.timeline import gather_record
    from megalite.tensor_parallel.wgrad import attach
    from megalite.training import train_step

    cfg = parse_config(flags)
    if not cfg.parallel.delay_wgrad_compute:
        raise SystemExit("error: give the flags of a zero-bubble run (--pipeline-schedule zb_h1): its store is the one attached")
    run = setup(cfg)
    with run.closing:
        store, state = run.wgrad_store, run.state
        logging = state.ps.rank == state.ps.logging_rank
        outs = {s: open(f"{args.timeline_prefix}-{s}.jsonl", "w") for s in args.schedules} if logging else {}
        summary = open(args.out_jsonl, "w") if logging else None
        # one warm-up iteration each, then `rounds` iterations each, the order alternating
        order = list(args.schedules) + [s for r in range(args.rounds)
                                        for s in (args.schedules if r % 2 == 0 else args.schedules[::-1])]
        for i, name in enumerate(order):
            split = splits_backward(name)
            run.forward_backward = get_schedule(name)
            attach(run.model, store if split else None)
            run.wgrad_store = store if split else None
            comm.barrier()
            faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            out = train_step(run)
            elapsed = time.perf_counter() - start
            faults = comm.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                                            comm.world_group())
            state.iteration += 1
            state.consumed_samples += out["global_batch_size"]
            record = gather_record(run.timeline, state.ps, state.iteration)
            if logging:
                warm = i >= len(args.schedules)
                outs[name].write(json.dumps(record) + "\n")
                summary.write(json.dumps({"schedule": name, "iteration": state.iteration, "measured": warm,
                                          "step_ms": 1e3 * elapsed, "lm_loss": out["lm_loss"],
                                          "idle": [r["idle_fraction"] for r in record["ranks"]],
                                          "page_faults": faults}) + "\n")
                summary.flush()
        attach(run.model, store)
        run.wgrad_store = store
        for f in list(outs.values()) + ([summary] if summary else []):
            f.close()
        comm.barrier()


if __name__ == "__main__":
    main()
