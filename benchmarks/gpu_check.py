"""The GPU checks in one command (`make gpu-check`), for a machine with CUDA and a plain checkout
(no virtual environment, no registry: `PYTHONPATH=. python3 benchmarks/gpu_check.py`):

  1. the GPU tests (pytest -m gpu tests/test_gpu.py: bf16 training against the CPU in fp32,
     exact resume, no host sync per micro-batch, NCCL at world size 1);
  2. training throughput of megalite beside transformers' GPT2LMHeadModel in bf16 at the 125M,
     350M and 1.3B sizes (benchmarks/bench_throughput.py);
  3. a TP=1 run and a ZeRO-3 (optim_grads_params) run of pretrain_gpt.py on one GPU, bf16, mock
     data: tokens/s and peak memory from their JSONL records;

then writes the results file (default benchmarks/RESULTS_gpu.md: machine, commit, commands,
numbers). Without CUDA it says so and exits 0, writing nothing. Budget: about 20 minutes on an
H100 (each step has its own timeout).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # GPT-3 paper, Table 2.1 (sequence 2048 there; 1024 here keeps the three within budget)
    "125M": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--micro-batch-size", "8"],
    "350M": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--micro-batch-size", "8"],
    "1.3B": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--micro-batch-size", "4"],
}


def _run(cmd: list[str], timeout: float, log: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(cmd, 124, e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout} s")
    log.append({"command": " ".join(cmd), "status": proc.returncode, "seconds": round(time.time() - start, 1)})
    return proc


def gpu_tests(log: list) -> str:
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], 600, log)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return "\n".join(["```", *tail, "```"])


def throughput(log: list, work: str) -> str:
    rows = ["| size | megalite tokens/s | megalite --compile tokens/s | transformers tokens/s | megalite / transformers | MFU |",
            "|---|---|---|---|---|---|"]
    for name, flags in SIZES.items():
        out = os.path.join(work, f"throughput-{name}.json")
        proc = _run([sys.executable, "benchmarks/bench_throughput.py", *flags, "--seq-length", "1024",
                     "--vocab-size", "50257", "--bf16", "--device", "cuda", "--steps", "10", "--json", out], 300, log)
        if proc.returncode or not os.path.exists(out):
            rows.append(f"| {name} | failed (status {proc.returncode}): {(proc.stderr or proc.stdout)[-300:]!r} |")
            continue
        rows.append(f"| {name} | {_throughput_cells(json.load(open(out)))} |")
    return "\n".join(rows)


def _throughput_cells(r: dict) -> str:
    """The cells of one row from bench_throughput.py's --json object (wall-clock figures)."""
    wall = {name: c.get("wall", {}) for name, c in r.get("contestants", {}).items()}

    def tok(name):
        return f"{wall[name]['tokens_per_s']['median']:.0f}" if "tokens_per_s" in wall.get(name, {}) else "-"
    ours = wall.get("megalite", {})
    ratio, mfu = ours.get("speed_ratio_vs_transformers_median"), ours.get("mfu")
    return " | ".join([tok("megalite"), tok("megalite --compile"), tok("transformers GPT2LMHeadModel"),
                       f"{ratio:.2f}" if ratio else "-", f"{100 * mfu:.1f}%" if mfu else "-"])


def one_gpu_runs(log: list, work: str) -> str:
    base = SIZES["1.3B"] + ["--seq-length", "1024", "--mock-data", "--vocab-size", "50257", "--global-batch-size", "8",
                            "--train-iters", "10", "--lr", "1e-4", "--bf16", "--log-interval", "5", "--eval-iters", "0",
                            "--log-memory-to-tensorboard", "--distributed-backend", "nccl"]
    rows = ["| run | tokens/s (iterations 6-10) | peak allocated (GiB) | status |", "|---|---|---|---|"]
    for name, extra in (("TP=1, no_shard", []),
                        ("ZeRO-3 (optim_grads_params)", ["--data-parallel-sharding-strategy", "optim_grads_params"])):
        jsonl = os.path.join(work, f"{name.split()[0]}.jsonl")
        proc = _run([sys.executable, "pretrain_gpt.py", *base, *extra, "--log-jsonl", jsonl], 300, log)
        records = [json.loads(line) for line in open(jsonl)] if os.path.exists(jsonl) else []
        last = [r for r in records if r.get("iteration") == 10]
        if proc.returncode or not last:
            rows.append(f"| {name} | - | - | failed ({proc.returncode}): {proc.stderr[-300:]!r} |")
            continue
        peak = last[0].get("mem_max_allocated_bytes") or last[0].get("max_allocated_bytes")
        rows.append(f"| {name} | {last[0]['tokens_per_sec']:.0f} | {peak / 2**30:.2f} | ok |" if peak else
                    f"| {name} | {last[0]['tokens_per_sec']:.0f} | - | ok |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS_gpu.md"))
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} cannot import torch; nothing written")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False); nothing written")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    log: list = []
    with tempfile.TemporaryDirectory() as work:
        sections = [("GPU tests", gpu_tests(log)), ("Throughput, bf16, sequence 1024, beside transformers", throughput(log, work)),
                    ("pretrain_gpt.py on one GPU (1.3B, bf16, mock data)", one_gpu_runs(log, work))]
    text = [f"# GPU check ({datetime.date.today()})", "",
            f"Machine: {torch.cuda.get_device_name(0)}, {platform.node()}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}; commit {commit or 'unknown'}. Command: `make gpu-check` "
            f"(`PYTHONPATH=. python3 benchmarks/gpu_check.py`).", ""]
    for title, body in sections:
        text += [f"## {title}", "", body, ""]
    text += ["## Commands", "", "| command | status | seconds |", "|---|---|---|"]
    text += [f"| `{r['command']}` | {r['status']} | {r['seconds']} |" for r in log]
    with open(a.out, "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"gpu-check: wrote {a.out}")
    return 0 if all(r["status"] == 0 for r in log) else 1


if __name__ == "__main__":
    sys.exit(main())
