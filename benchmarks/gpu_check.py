"""The GPU checks in one command (`make gpu-check`), sized for a short lease of one GPU: at most
8 minutes on one H200, start-up included. For a machine with CUDA and a plain checkout (no
virtual environment, no registry: `PYTHONPATH=. python3 benchmarks/gpu_check.py`):

  1. the GPU tests (pytest -m gpu tests/test_gpu.py: bf16 training against the CPU in fp32,
     exact resume, no host sync per micro-batch, NCCL at world size 1);
  2. training throughput at the GPT-3 125M, 350M and 1.3B shapes (sequence 1024, bf16), each
     with one and with several micro-batches per step: megalite with Megatron-LM's fusions
     (--cross-entropy-loss-fusion; gradient accumulation's is the default), megalite --compile at
     125M (each layer a region, and --compile-scope decoder: the stack one region), and megalite
     without either fusion at 125M and 1.3B, beside transformers' GPT2LMHeadModel and a
     plain-PyTorch nanoGPT-style GPT (compiled only at 125M, eager at 1.3B), MFU against
     the table peak and against a matrix multiply timed in the same run, and a profile of
     megalite's step (host time, device time, kernel launches; benchmarks/bench_throughput.py);
  3. pretrain_gpt.py on one GPU (--cross-entropy-loss-fusion): the 1.3B model with 8
     micro-batches, its ZeRO-3 (optim_grads_params) form, and a DeepSeek-V3-shaped MoE (MLA, MTP, 16 experts top-4 in 4
     groups, a shared expert, grouped GEMM): tokens/s, MFU and peak memory from their JSONL records;

then writes the results file (default benchmarks/RESULTS_gpu.md: machine, commit, commands,
numbers). Each step runs in a process of its own with its own timeout, so one that fails or hangs
costs only its own row, and all of them within one budget (--budget, default 420 s: a step that
the budget no longer covers is cut short or skipped), so the check fits its lease whatever
happens; steps run in order of what they decide: the tests, 125M and 1.3B, the pretrain_gpt.py
runs, then 350M. Without CUDA it says so and exits 0, writing nothing. `--tiny` runs every
step at toy sizes on the CPU in fp32 (the suite does: tests/test_gpu_check.py), so the code paths
cannot rot between GPU leases.
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
# GPT-3 paper, Table 2.1 shapes; sequence 1024 keeps the three within the lease. (micro-batch size,
# several micro-batches, contestants, timeout s, whether megalite's steps are profiled: at 125M,
# where the host decides). On an H200 the whole check took ~7 minutes, start-up included, before
# the two unfused contestants and the compiled loss passes (Inductor's first compile, then its
# cache) were added and the nanoGPT-style contestant left out at 350M: ~30-60 s more is expected,
# unmeasured. At 125M --compile-scope decoder (the layer stack as one region) took the place of the
# eager nanoGPT-style model (301k tokens/s against transformers' 292k in the last run).
SIZES = {
    "125M": (["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12"], 8, 4,
             ["megalite", "megalite-compile", "megalite-compile-decoder", "megalite-unfused", "transformers",
              "nanogpt-compile"], 200, True),
    "1.3B": (["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"], 4, 4,
             ["megalite", "megalite-unfused", "transformers", "nanogpt"], 200, False),
    "350M": (["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16"], 8, 4,
             ["megalite", "transformers"], 90, False),  # nanoGPT-style at 125M and 1.3B only: the lease
}
TINY = (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"], 2, 2,
        ["megalite", "megalite-unfused", "transformers", "nanogpt"], 300, True)
MOE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "2816",
       "--multi-latent-attention", "--q-lora-rank", "384", "--kv-lora-rank", "256", "--qk-head-dim", "64",
       "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--num-experts", "16", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "512",
       "--moe-shared-expert-intermediate-size", "1024", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--mtp-num-layers", "1"]
TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--mtp-num-layers", "1"]


class Commands:
    """The check's commands, each in a process of its own with its own timeout, all within one
    budget (--budget): a step is cut short where the budget has less left than its timeout, and
    skipped where it has under MIN_STEP_S left, so that the check ends within its lease whatever
    hangs. `log`: each command, its status and seconds."""
    MIN_STEP_S = 20

    def __init__(self, budget_s: float):
        self.log: list = []
        self.deadline = time.time() + budget_s

    def run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        left = self.deadline - time.time()
        if left < self.MIN_STEP_S:
            proc = subprocess.CompletedProcess(cmd, 125, "", f"skipped: {max(left, 0):.0f} s of the --budget left")
            self.log.append({"command": _shown(cmd), "status": 125, "seconds": 0.0})
            print(f"gpu-check: {_shown(cmd)[:120]} -> {proc.stderr}", flush=True)
            return proc
        return _run(cmd, min(timeout, left), self.log)


def _shown(cmd: list[str]) -> str:
    return " ".join(c if c != sys.executable else "python3" for c in cmd)


def _run(cmd: list[str], timeout: float, log: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        proc = subprocess.CompletedProcess(cmd, 124, out, err + f"\ntimed out after {timeout:.0f} s")
    log.append({"command": _shown(cmd),
                "status": proc.returncode, "seconds": round(time.time() - start, 1)})
    print(f"gpu-check: {log[-1]['command'][:120]} -> status {proc.returncode} in {log[-1]['seconds']} s", flush=True)
    if proc.returncode:
        print((proc.stdout + proc.stderr)[-3000:], flush=True)
    return proc


def _failed(proc) -> str:
    text = (proc.stderr or proc.stdout or "").strip().splitlines()
    return f"failed (status {proc.returncode}): {(text[-1] if text else '')[:200]}"


def gpu_tests(commands: Commands, tiny: bool) -> str:
    if tiny:  # the GPU tests skip without CUDA: nothing to run here
        return "(skipped: --tiny)"
    proc = commands.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], 90)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
    return "\n".join(["```", *tail, "```"])


def _fmt(x, pattern="{:.0f}"):
    return pattern.format(x) if x is not None else "-"


THROUGHPUT_HEADER = ["| shape | micro-batches | contestant | tokens/s (median) | TFLOP/s | MFU (table peak) | "
                     "MFU (measured GEMM) | vs transformers |", "|---|---|---|---|---|---|---|---|"]


def throughput(commands: Commands, work: str, tiny: bool, steps: int, names) -> tuple[list, list, list]:
    """The throughput rows of the sizes `names`, the profile lines of megalite's step, the peaks."""
    rows, profiles, peaks = [], [], []
    sizes = {"tiny": TINY} if tiny else {name: SIZES[name] for name in names}
    for name, (shape, mbs, several, contestants, timeout, profile) in sizes.items():
        out = os.path.join(work, f"throughput-{name}.json")
        device = ["--device", "cpu", "--vocab-size", "512", "--seq-length", "64"] if tiny else \
            ["--device", "cuda", "--bf16", "--vocab-size", "50304", "--seq-length", "1024"]
        proc = commands.run([sys.executable, "benchmarks/bench_throughput.py", *shape, *device, "--micro-batch-size",
                           str(mbs), "--microbatches", "1", str(several), "--contestants", *contestants, "--steps",
                           str(steps), "--warmup", "1" if tiny else "2", *(["--profile"] if profile else []),
                           "--json", out], timeout)
        if proc.returncode or not os.path.exists(out):
            rows.append(f"| {name} | | | {_failed(proc)} | | | | |")
            continue
        r = json.load(open(out))
        peaks.append(f"{name}: table {r['peak_tflops']['table']}, measured GEMM {r['peak_tflops']['gemm']:.1f} TFLOP/s")
        for m, block in r["by_microbatches"].items():
            for cname, clocks in block["contestants"].items():
                w = clocks["wall"]
                rows.append(f"| {name} | {m} x {mbs} | {cname} | {w['tokens_per_s']['median']:.0f} | {w['tflops']:.1f} | "
                            f"{_fmt(w['mfu_table'], '{:.1%}')} | {_fmt(w['mfu_gemm'], '{:.1%}')} | "
                            f"{_fmt(w['speed_ratio_vs_transformers_median'], '{:.2f}x')} |")
        for m, prof in r.get("profile", {}).items():
            profiles.append(f"- {name}, {m} x {mbs}: wall {prof['wall'] * 1e3:.1f} ms, host time in ops "
                            f"{prof['host_in_ops'] * 1e3:.1f} ms, Python outside ops {prof['Python overhead'] * 1e3:.1f} "
                            f"ms, device busy {prof['device'] * 1e3:.1f} ms, {prof['kernel_launches']:.0f} kernel "
                            f"launches, {prof['aten_ops']:.0f} aten ops per step; most device time: "
                            + "; ".join(f"{n[:50]} {t:.2f} ms x{c:.0f}" for n, t, c in prof["top_device"][:5]))
    return rows, profiles, peaks


def _records(path: str) -> list:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def one_gpu_runs(commands: Commands, work: str, tiny: bool) -> str:
    if tiny:
        base = ["--seq-length", "64", "--mock-data", "--vocab-size", "512", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-4", "--log-interval", "2",
                "--eval-iters", "0", "--log-memory-to-tensorboard", "--cross-entropy-loss-fusion"]
        dense = TINY[0]
        runs = (("dense, 2 micro-batches", dense, []),
                ("dense, ZeRO-3 (optim_grads_params)", dense, ["--data-parallel-sharding-strategy",
                                                              "optim_grads_params"]),
                ("MoE (tiny)", TINY_MOE, []))
        last, timeout = 4, 300
    else:
        base = ["--seq-length", "1024", "--mock-data", "--vocab-size", "50304", "--micro-batch-size", "4",
                "--global-batch-size", "32", "--train-iters", "10", "--lr", "1e-4", "--bf16", "--log-interval", "5",
                "--eval-iters", "0", "--log-memory-to-tensorboard", "--distributed-backend", "nccl",
                "--cross-entropy-loss-fusion"]
        dense = SIZES["1.3B"][0]
        runs = (("1.3B, 8 micro-batches of 4", dense, []),
                ("1.3B, ZeRO-3 (optim_grads_params), 8 micro-batches of 4", dense,
                 ["--data-parallel-sharding-strategy", "optim_grads_params"]),
                ("DeepSeek-V3-shaped MoE (8 layers, MLA, MTP 1, 16 experts top-4), 8 micro-batches of 4", MOE, []))
        last, timeout = 10, 100
    rows = ["| run | tokens/s (last interval) | MFU | peak allocated (GiB) | status |", "|---|---|---|---|---|"]
    for i, (name, shape, extra) in enumerate(runs):
        jsonl = os.path.join(work, f"run{i}.jsonl")
        proc = commands.run([sys.executable, "pretrain_gpt.py", *shape, *base, *extra, "--log-jsonl", jsonl], timeout)
        final = [r for r in _records(jsonl) if r.get("iteration") == last and "tokens_per_sec" in r]
        if proc.returncode or not final:
            rows.append(f"| {name} | - | - | - | {_failed(proc)} |")
            continue
        r = final[0]
        peak = r.get("mem_max_allocated_bytes")
        mfu = r.get("mfu")
        rows.append(f"| {name} | {r['tokens_per_sec']:.0f} | {_fmt(mfu, '{:.1%}')} | "
                    f"{_fmt(peak / 2**30 if peak else None, '{:.2f}')} | ok |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS_gpu.md"))
    ap.add_argument("--tiny", action="store_true", help="every step at toy sizes on the CPU (the suite's check)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contestant and micro-batch count")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all the steps together (default: 420 on a GPU, an 8-minute lease less the "
                         "machine's start-up; none with --tiny)")
    a = ap.parse_args(argv)
    if a.budget is not None and a.budget <= 0:
        ap.error(f"--budget must be a number of seconds > 0, got {a.budget}")
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} cannot import torch; nothing written")
        return 0
    if not a.tiny and not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False); nothing written")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    commands = Commands(a.budget or (float("inf") if a.tiny else 420.0))
    log = commands.log
    start = time.time()
    with tempfile.TemporaryDirectory() as work:
        tests = gpu_tests(commands, a.tiny)
        # the sizes that decide the targets, the pretrain_gpt.py runs, then 350M (what the budget drops first)
        rows, profiles, peaks = throughput(commands, work, a.tiny, a.steps, ("125M", "1.3B"))
        runs = one_gpu_runs(commands, work, a.tiny)
        more = throughput(commands, work, a.tiny, a.steps, ("350M",)) if not a.tiny else ([], [], [])
    table = "\n".join(THROUGHPUT_HEADER + rows + more[0] + ["", "Peaks: " + "; ".join(peaks + more[2])])
    profiles = "\n".join(profiles + more[1])
    device = "CPU (--tiny)" if a.tiny else torch.cuda.get_device_name(0)
    text = [f"# GPU check ({datetime.date.today()})", "",
            f"Machine: {device}, {platform.node()}; torch {torch.__version__}, CUDA {torch.version.cuda}; commit "
            f"{commit or 'unknown'}{' (with uncommitted changes)' if dirty else ''}. Command: `make gpu-check` "
            f"(`PYTHONPATH=. python3 benchmarks/gpu_check.py{' --tiny' if a.tiny else ''}`), "
            f"{time.time() - start:.0f} s.", "",
            "## GPU tests", "", tests, "",
            "## Throughput (bf16, sequence 1024; tokens/s, wall time, median of the timed steps)", "", table, "",
            "## Where megalite's step goes (torch.profiler, per step)", "", profiles, "",
            "## pretrain_gpt.py on one GPU (bf16, mock data)", "", runs, "",
            "## Commands", "", "| command | status | seconds |", "|---|---|---|",
            *[f"| `{r['command']}` | {r['status']} | {r['seconds']} |" for r in log]]
    with open(a.out, "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"gpu-check: wrote {a.out} ({time.time() - start:.0f} s)")
    return 0 if all(r["status"] == 0 for r in log) else 1


if __name__ == "__main__":
    sys.exit(main())
