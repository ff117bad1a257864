"""Muon against AdamW on the demo model (the Makefile's `demo` target: 4 layers, hidden 128, seq 128,
global batch 32, 200 iterations (--train-iters), cosine schedule with a tenth of them warmup, min LR =
LR / 10) on the
bundled corpus, each optimizer at the best learning rate of a sweep (numbers go to
benchmarks/RESULTS_muon.md; tests never assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_muon.py [--data-dir data/build] [--train-iters 200] [--parallel 6]
        [--eval-interval 20] [--eval-iters 4] [--json out.json]

Reported: validation loss (--eval-iters batches of the held-out 2%) every --eval-interval
iterations for every run; each optimizer's best LR by final validation loss; the two best runs'
validation loss at equal tokens; and the tokens the best Muon run needs to reach the best AdamW
run's final validation loss (linear interpolation between evaluations; "not reached" if it does
not). Loss against tokens does not depend on the machine's speed or load: the runs are
deterministic up to float rounding, so only the numbers, not timings, are reported.

Muon runs use --muon-scale-mode spectral with --muon-extra-scale-factor 0.2 (Moonlight's
update-RMS match to AdamW, arXiv 2502.16982 Sec. 2.2), so the two LR grids are comparable;
Muon's scalar optimizer is Adam with the same betas as the AdamW runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "16", "--global-batch-size", "32",
        "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--split", "98,2,0", "--seed", "1234"]
TOKENS_PER_ITER = 32 * 128
GRID = {"adam": [1e-3, 2e-3, 4e-3], "muon": [2e-3, 4e-3, 8e-3]}
MUON = ["--optimizer", "muon", "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2"]


def start(optimizer: str, lr: float, args, work: str):
    """(process, its JSONL path) of one run, started."""
    jsonl = os.path.join(work, f"{optimizer}-{lr:g}.jsonl")
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *DEMO,
            "--data-path", os.path.join(args.data_dir, "corpus_text_document"),
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", os.path.join(args.data_dir, "tokenizer.model"),
            "--data-cache-path", os.path.join(work, f"cache-{optimizer}-{lr:g}"),  # one each: runs may overlap
            "--lr", str(lr), "--min-lr", str(lr / 10),
            "--train-iters", str(args.train_iters), "--lr-warmup-iters", str(args.train_iters // 10),
            "--log-interval", "50", "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
            "--log-jsonl", jsonl, *(MUON if optimizer == "muon" else [])]
    env = dict(os.environ, PYTHONPATH=ROOT)
    log = open(jsonl + ".log", "w")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), jsonl


def finish(proc, jsonl: str) -> list:
    """[(tokens, validation loss)] of a started run, once it ends."""
    if proc.wait() != 0:
        with open(jsonl + ".log") as f:
            raise RuntimeError(f"{' '.join(proc.args)} failed:\n{f.read()[-3000:]}")
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    return [(r["iteration"] * TOKENS_PER_ITER, r["lm_loss"]) for r in records if r.get("split") == "valid"]


def tokens_to_reach(curve: list, target: float) -> float | None:
    """The first token count where `curve` (tokens, loss) reaches `target`, interpolated linearly."""
    prev = None
    for tokens, loss in curve:
        if loss <= target:
            if prev is None:
                return tokens
            t0, l0 = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def report(results: dict) -> str:
    best = {opt: min(runs, key=lambda lr: runs[lr][-1][1]) for opt, runs in results.items()}
    lines = ["| optimizer | LR | " + " | ".join(f"{t // 1000}k" for t, _ in next(iter(results["adam"].values())))
             + " |", "|---|---|" + "---|" * len(next(iter(results["adam"].values())))]
    for opt, runs in results.items():
        for lr, curve in runs.items():
            mark = " (best)" if lr == best[opt] else ""
            lines.append(f"| {opt} | {lr:g}{mark} | " + " | ".join(f"{loss:.4f}" for _, loss in curve) + " |")
    adam, muon = results["adam"][best["adam"]], results["muon"][best["muon"]]
    target = adam[-1][1]
    reach = tokens_to_reach(muon, target)
    lines += ["", f"Best AdamW (LR {best['adam']:g}) final validation loss {target:.4f} after {adam[-1][0]} tokens; "
              f"best Muon (LR {best['muon']:g}) {muon[-1][1]:.4f} at the same tokens.",
              "Tokens Muon needs to reach AdamW's final validation loss: "
              + (f"{reach:.0f} ({reach / adam[-1][0]:.2f} x AdamW's)" if reach is not None else "not reached")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "data", "build"),
                    help="corpus_text_document.{bin,idx} and tokenizer.model (`make data`)")
    ap.add_argument("--train-iters", type=int, default=200, help="the demo's 200; warmup is a tenth")
    ap.add_argument("--eval-interval", type=int, default=20)
    ap.add_argument("--eval-iters", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (each one process)")
    ap.add_argument("--adam-lrs", type=float, nargs="+", default=GRID["adam"], help="AdamW's learning rates")
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=GRID["muon"], help="Muon's learning rates")
    ap.add_argument("--json", help="write every curve here as well (updated after each run)")
    args = ap.parse_args()
    results: dict = {"adam": {}, "muon": {}}
    todo = [("adam", lr) for lr in args.adam_lrs] + [("muon", lr) for lr in args.muon_lrs]
    with tempfile.TemporaryDirectory() as work:
        for i in range(0, len(todo), args.parallel):
            running = [(job, start(*job, args, work))
                       for job in todo[i:i + args.parallel]]
            for (opt, lr), (proc, jsonl) in running:
                results[opt][lr] = finish(proc, jsonl)
                print(f"{opt} lr {lr:g}: final validation loss {results[opt][lr][-1][1]:.4f}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({o: {str(k): v for k, v in r.items()} for o, r in results.items()}, f)
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(report(results))


if __name__ == "__main__":
    main()
