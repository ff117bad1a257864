#!/usr/bin/env python3
"""Zero-bubble pipeline schedules against 1F1B: step time and measured idle per rank, beside plan.py's bubble.

    python benchmarks/bench_zero_bubble.py [--microbatches 4 8] [--rounds 3] [--iters 6]
                                           [--alternations 6] [--out benchmarks/zero_bubble] [--check]

Two gloo ranks (one per core, OMP_NUM_THREADS=1), PP2, a GPT where compute dominates the
point-to-point traffic (8 layers, hidden 512, seq 256, micro-batch 2, untied embeddings, fp32,
mock data), at 4 and 8 micro-batches per iteration. Two measurements:

- 1F1B against ZB-H1 in one run (benchmarks/zero_bubble_worker.py): the two schedules alternate
  every iteration on the same model, so that the drift of a shared host's core speed (tens of
  percent within minutes here) hits both alike; --alternations iterations each after one warm-up.
- 1F1B against ZB-V (--num-layers-per-virtual-pipeline-stage 2: 4 virtual stages in a V, another
  placement of the layers, so another run): pretrain_gpt.py runs under torchrun with
  --log-pipeline-timeline, alternating (1f1b, zbv, 1f1b, ...) over --rounds rounds of --iters
  iterations; per run the median step time after the first iteration, per contestant the median
  over rounds.

Idle is each rank's share of the iteration's span without a pass (the pipeline_timeline records),
the median over the measured iterations. plan.py's bubble for the same layout (zb_h1 / zbv: their
order on unit F = B = W costs) sits beside it. The timeline picture of each contestant's last
iteration is written with tools/plot_metrics.py --timeline into --out. --check: one round of 2
iterations, 4 micro-batches (does the script work; no timings worth keeping).

The machine must be otherwise idle for the timings to mean anything (benchmarks/RESULTS_zero_bubble.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "4096",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--log-pipeline-timeline",
         "--pipeline-model-parallel-size", "2"]
CONTESTANTS = {"1f1b": ["--pipeline-schedule", "1f1b"],
               "zb_h1": ["--pipeline-schedule", "zb_h1"],
               "zbv": ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "2"]}


def flags(name: str, m: int, iters: int) -> list[str]:
    return MODEL + CONTESTANTS[name] + ["--global-batch-size", str(2 * m), "--train-iters", str(iters)]


def _torchrun(script: str, argv: list[str], workdir: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run(name: str, m: int, iters: int, workdir: str) -> tuple[float, list[float], str]:
    """One training run: (median step ms after the first iteration, median idle fraction per rank, its JSONL)."""
    jsonl = os.path.join(workdir, f"{name}-m{m}.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    _torchrun(os.path.join(ROOT, "pretrain_gpt.py"), flags(name, m, iters) + ["--log-jsonl", jsonl], workdir)
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    steps = [r["elapsed_ms"] for r in records if "consumed_samples" in r and r["iteration"] > 1]
    timelines = [r for r in records if r.get("event") == "pipeline_timeline" and r["iteration"] > 1]
    idle = [statistics.median(t["ranks"][i]["idle_fraction"] for t in timelines) for i in range(2)]
    return statistics.median(steps), idle, jsonl


def alternating(m: int, alternations: int, workdir: str) -> dict:
    """1F1B and ZB-H1 alternating every iteration in one run (zero_bubble_worker.py):
    {schedule: (median step ms, median idle per rank, timeline JSONL)}."""
    prefix, summary = os.path.join(workdir, f"alt-m{m}"), os.path.join(workdir, f"alt-m{m}-summary.jsonl")
    _torchrun(os.path.join(ROOT, "benchmarks", "zero_bubble_worker.py"),
              ["--out-jsonl", summary, "--timeline-prefix", prefix, "--rounds", str(alternations),
               "--schedules", "1f1b", "zb_h1", "--", *flags("zb_h1", m, 10 ** 6)], workdir)
    with open(summary) as f:
        records = [r for r in map(json.loads, f) if r["measured"]]
    out = {}
    for name in ("1f1b", "zb_h1"):
        mine = [r for r in records if r["schedule"] == name]
        out[name] = (statistics.median(r["step_ms"] for r in mine),
                     [statistics.median(r["idle"][i] for r in mine) for i in range(2)], f"{prefix}-{name}.jsonl")
    return out


def planned_bubble(name: str, m: int) -> float:
    """tools/plan.py's bubble fraction for the contestant's layout."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    return plan.make_plan(flags(name, m, 2) + ["--world-size", "2"])["bubble_fraction"]


def picture(jsonl: str, out_dir: str, name: str, m: int) -> str:
    png = os.path.join(out_dir, f"timeline-{name}-m{m}.png")
    if os.path.exists(png):
        os.remove(png)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), jsonl, "--timeline",
                    "--output", png, "--title", f"{name}, PP2, {m} micro-batches"], check=True, capture_output=True)
    return png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="1f1b / zbv: runs of each")
    ap.add_argument("--iters", type=int, default=6, help="1f1b / zbv: iterations per run")
    ap.add_argument("--alternations", type=int, default=6, help="1f1b / zb_h1: measured iterations of each in one run")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "zero_bubble"), help="timeline pictures")
    ap.add_argument("--check", action="store_true", help="one round, 2 iterations, 4 micro-batches")
    args = ap.parse_args()
    if args.check:
        args.microbatches, args.rounds, args.iters, args.alternations = [4], 1, 2, 1
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit.strip()}")
    print("| m | measured in | schedule | plan.py bubble | step ms (median) | vs 1f1b | idle rank 0 | idle rank 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as workdir:
        for m in args.microbatches:
            alt = alternating(m, args.alternations, workdir)
            runs = {name: [] for name in ("1f1b", "zbv")}
            last = {}
            for _ in range(args.rounds):
                for name in runs:  # alternating contestants
                    step, idle, jsonl = run(name, m, args.iters, workdir)
                    runs[name].append((step, idle))
                    last[name] = jsonl
            sep = {name: (statistics.median(s for s, _ in rs),
                          [statistics.median(i[r] for _, i in rs) for r in range(2)], last[name])
                   for name, rs in runs.items()}
            for where, results in (("one run, alternating iterations", alt), ("separate runs, alternating", sep)):
                base = results["1f1b"][0]
                for name, (step, idle, jsonl) in results.items():
                    print(f"| {m} | {where} | {name} | {100 * planned_bubble(name, m):.1f}% | {step:.0f} | "
                          f"{step / base:.2f}x | {100 * idle[0]:.1f}% | {100 * idle[1]:.1f}% |", flush=True)
                    if name != "1f1b" or where.startswith("one"):
                        picture(jsonl, args.out, name, m)
    print(f"timeline pictures in {args.out}")


if __name__ == "__main__":
    main()
