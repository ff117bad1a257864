"""Optimizer state in lower precision (numbers go to benchmarks/RESULTS_optimizer_precision.md;
tests never assert on them).

    python benchmarks/bench_optimizer_precision.py bytes
    OMP_NUM_THREADS=1 python benchmarks/bench_optimizer_precision.py loss [--train-iters 200]

bytes: the demo model (`make demo`'s flags) run for one iteration with each state dtype choice
(fp32 moments; bf16 moments; fp16 first and bf16 second moment; with --bf16 parameters: fp32 masters, fp16 masters, fp16
masters and bf16 moments), the optimizer bytes of its `memory_footprint` record per parameter
beside tools/plan.py's for the same flags.

loss: the demo itself (200 iterations on the bundled corpus, data/build: `make data`) with fp32
moments and with bf16 moments (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16), fp32 parameters; the validation loss at iteration 200 of each and
their relative difference. The loss does not depend on the machine's load, only on the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import commit, machine  # noqa: E402

DATA = ["--data-path", "data/build/corpus_text_document", "--split", "98,2,0", "--tokenizer-type",
        "SentencePieceTokenizer", "--tokenizer-model", "data/build/tokenizer.model"]
DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "16", "--global-batch-size", "32", "--train-iters", "200",
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "10", "--eval-interval", "100",
        "--eval-iters", "5"]
PA = ["--use-precision-aware-optimizer"]
BF16_MOMENTS = PA + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
CHOICES = {  # name: flags
    "fp32 params, fp32 moments": [],
    "fp32 params, bf16 moments": BF16_MOMENTS,
    "fp32 params, fp16 exp_avg, bf16 exp_avg_sq": PA + ["--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "bf16"],
    "bf16 params, fp32 masters, fp32 moments": ["--bf16"],
    "bf16 params, fp16 masters, fp32 moments": ["--bf16"] + PA + ["--main-params-dtype", "fp16"],
    "bf16 params, fp16 masters, bf16 moments": ["--bf16"] + BF16_MOMENTS + ["--main-params-dtype", "fp16"],
}


def with_value(flags: list[str], name: str, value: str) -> list[str]:
    out = list(flags)
    out[out.index(name) + 1] = value
    return out


def run(flags: list[str], tmp: str, name: str) -> tuple[list[dict], int]:
    """(the run's JSONL records, its vocabulary size as the start-up line gives it)."""
    jsonl = os.path.join(tmp, f"{name}.jsonl")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--log-jsonl", jsonl],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(jsonl) as f:
        return [json.loads(line) for line in f], int(proc.stdout.split(" vocab ")[1].split(" ")[0])


def bytes_table() -> list[str]:
    import plan
    one_step = with_value(with_value(with_value(with_value(DEMO, "--train-iters", "1"), "--micro-batch-size", "1"),
                                     "--global-batch-size", "1"), "--lr-warmup-iters", "0") + ["--eval-iters", "0"]
    rows = ["| state | measured optimizer bytes / parameter | plan.py |", "| --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(CHOICES.items()):
            records, vocab = run(DATA + one_step + flags, tmp, f"bytes{i}")
            (rank,) = [r for r in records if r.get("event") == "memory_footprint"][0]["ranks"]
            stage = plan.make_plan(one_step + flags + ["--vocab-size", str(vocab)])["stages"][0]
            n = rank["num_params"]
            assert stage["num_params"] == n, (name, stage["num_params"], n)
            rows.append(f"| {name} | {rank['optimizer_bytes'] / n:g} | {stage['optimizer_bytes'] / n:g} |")
            print(rows[-1], flush=True)
    return rows


def loss_table(train_iters: int) -> list[str]:
    rows = ["| moments | validation lm loss at iteration %d |" % train_iters, "| --- | --- |"]
    losses = {}
    flags = with_value(DEMO, "--train-iters", str(train_iters))
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("fp32", []), ("bf16", BF16_MOMENTS)):
            records, _ = run(DATA + flags + extra, tmp, name)
            (valid,) = [r for r in records if r.get("split") == "valid" and r["iteration"] == train_iters]
            losses[name] = valid["lm_loss"]
            rows.append(f"| {name} | {losses[name]:.6f} |")
            print(rows[-1], flush=True)
    rel = (losses["bf16"] - losses["fp32"]) / losses["fp32"]
    rows.append(f"\nbf16 vs fp32 moments: {100 * rel:+.3f}% (within 1%: {abs(rel) < 0.01})")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["bytes", "loss"])
    p.add_argument("--train-iters", type=int, default=200)
    a = p.parse_args(argv)
    print(f"machine: {machine()}\ncommit: {commit()}\ncommand: python benchmarks/bench_optimizer_precision.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}", flush=True)
    rows = bytes_table() if a.what == "bytes" else loss_table(a.train_iters)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
