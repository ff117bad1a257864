"""FP8 (--fp8-format, through torchao) against bf16: validation loss on the demo model (CPU,
emulated FP8) and tokens/s of layer stacks on an FP8 GPU (numbers go to benchmarks/RESULTS_fp8.md;
tests never assert on them).

    # the CPU: the Makefile demo's model (4 layers, hidden 128, seq 128, global batch 32) on the
    # bundled corpus, 200 iterations, bf16 against FP8 hybrid tensorwise and blockwise (emulated)
    OMP_NUM_THREADS=1 python benchmarks/bench_fp8.py loss [--data-dir data/build] [--train-iters 200] [--parallel 3]

    # an FP8 GPU (compute capability 8.9+, torch._scaled_mm): tokens/s of a 1.3B-shaped and an
    # 8B-shaped layer stack (Llama-3 8B's layer, fewer of them) in bf16 and in FP8 (mock data)
    python benchmarks/bench_fp8.py speed [--iters 20] [--stacks 1.3b 8b] [--compile layer|decoder]

`loss` reports each run's validation loss (--eval-iters batches of the held-out 2%) every
--eval-interval iterations and the final one's difference from bf16's in percent (the issue's
bar: 1 %). Loss against tokens does not depend on the machine's load. `speed` reports the median
tokens/s of the iterations after the first few (warm-up, allocator) and FP8's ratio to bf16's.
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
DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--split", "98,2,0", "--seed", "1234", "--bf16"]
TOKENS_PER_ITER = 32 * 128
FP8 = {"bf16": [],
       "fp8-hybrid-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
       "fp8-hybrid-blockwise": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]}
# layer stacks: GPT-3 1.3B's layer (24 of them) and Llama-3 8B's (4 of its 32: one H200 holds them
# with the optimizer), bf16 parameters, the flags the Megatron-LM scripts give
STACKS = {
    "1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--micro-batch-size", "4", "--global-batch-size", "32"],
    "8b": ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
           "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192", "--micro-batch-size", "1",
           "--global-batch-size", "8", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
           "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
}
SPEED = ["--bf16", "--mock-data", "--vocab-size", "32000", "--lr", "1e-4", "--log-interval", "1",
         "--eval-iters", "0", "--use-distributed-optimizer"]


def start(argv: list, jsonl: str):
    env = dict(os.environ, PYTHONPATH=ROOT)
    log = open(jsonl + ".log", "w")
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--log-jsonl", jsonl],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def records(proc, jsonl: str) -> list:
    if proc.wait() != 0:
        with open(jsonl + ".log") as f:
            raise RuntimeError(f"{' '.join(proc.args)} failed:\n{f.read()[-3000:]}")
    with open(jsonl) as f:
        return [json.loads(line) for line in f]


def loss(args) -> str:
    curves = {}
    with tempfile.TemporaryDirectory() as work:
        names = list(FP8)
        for i in range(0, len(names), args.parallel):
            running = []
            for name in names[i:i + args.parallel]:
                jsonl = os.path.join(work, f"{name}.jsonl")
                argv = [*DEMO, "--data-path", os.path.join(args.data_dir, "corpus_text_document"),
                        "--tokenizer-type", "SentencePieceTokenizer",
                        "--tokenizer-model", os.path.join(args.data_dir, "tokenizer.model"),
                        "--data-cache-path", os.path.join(work, f"cache-{name}"),
                        "--train-iters", str(args.train_iters), "--lr-warmup-iters", str(args.train_iters // 10),
                        "--log-interval", "50", "--eval-interval", str(args.eval_interval),
                        "--eval-iters", str(args.eval_iters), *FP8[name]]
                running.append((name, start(argv, jsonl), jsonl))
            for name, proc, jsonl in running:
                curves[name] = [(r["iteration"] * TOKENS_PER_ITER, r["lm_loss"]) for r in records(proc, jsonl)
                                if r.get("split") == "valid"]
                print(f"{name}: final validation loss {curves[name][-1][1]:.4f}", flush=True)
    base = curves["bf16"][-1][1]
    lines = ["| run | " + " | ".join(f"{t // 1000}k" for t, _ in curves["bf16"]) + " | final vs bf16 |",
             "|---|" + "---|" * (len(curves["bf16"]) + 1)]
    for name, curve in curves.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for _, v in curve)
                     + f" | {100 * (curve[-1][1] - base) / base:+.2f} % |")
    return "\n".join(lines)


def speed(args) -> str:
    lines = ["| stack | bf16 tokens/s | FP8 tokens/s | FP8 / bf16 |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        for stack in args.stacks:
            rates = {}
            for name in ("bf16", "fp8-hybrid-tensorwise"):
                jsonl = os.path.join(work, f"{stack}-{name}.jsonl")
                argv = [*STACKS[stack], *SPEED, "--train-iters", str(args.iters), *FP8[name],
                        *(["--compile", "--compile-scope", args.compile] if args.compile else [])]
                rs = [r["tokens_per_sec"] for r in records(start(argv, jsonl), jsonl) if "tokens_per_sec" in r]
                rates[name] = statistics.median(rs[args.warmup:])
                print(f"{stack} {name}: {rates[name]:.0f} tokens/s", flush=True)
            bf16, fp8 = rates["bf16"], rates["fp8-hybrid-tensorwise"]
            shown = f"{stack}, --compile-scope {args.compile}" if args.compile else stack
            lines.append(f"| {shown} | {bf16:.0f} | {fp8:.0f} | {fp8 / bf16:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    lo = sub.add_parser("loss", help="validation loss, bf16 against emulated FP8 (CPU)")
    lo.add_argument("--data-dir", default=os.path.join(ROOT, "data", "build"),
                    help="corpus_text_document.{bin,idx} and tokenizer.model (`make data`)")
    lo.add_argument("--train-iters", type=int, default=200, help="the demo's 200; warmup is a tenth")
    lo.add_argument("--eval-interval", type=int, default=50)
    lo.add_argument("--eval-iters", type=int, default=4)
    lo.add_argument("--parallel", type=int, default=1, help="runs at once (each one process)")
    sp = sub.add_parser("speed", help="tokens/s, bf16 against FP8, on an FP8 GPU")
    sp.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    sp.add_argument("--iters", type=int, default=20)
    sp.add_argument("--warmup", type=int, default=5, help="first iterations left out of the median")
    sp.add_argument("--compile", choices=["layer", "decoder"], default=None,
                    help="both runs with --compile and this --compile-scope (the FP8 products stay eager)")
    args = ap.parse_args()
    table = loss(args) if args.what == "loss" else speed(args)
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(table)


if __name__ == "__main__":
    main()
