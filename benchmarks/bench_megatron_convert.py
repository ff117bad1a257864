"""Peak memory of `tools/checkpoint/convert.py --loader megatron --saver hf` on a >= 1 GB checkpoint.

    PYTHONPATH=. python benchmarks/bench_megatron_convert.py [--work /tmp/megatron_convert] [--keep]

1. megatron-core (tests/megatron_core_ref.py: its GPTModel, local spec, on CPU) saves a torch_dist
   checkpoint of a GPT-2-medium-shaped model (24 layers, h 1024, vocabulary 50304; fp32, 1.42 GB)
   into --work (never into the repository); reused when already there.
2. The same architecture at 2 layers and h 64 is converted first: the converter's peak RSS with
   everything imported and every code path run, but negligible tensors (the "interpreter" baseline).
3. The large checkpoint is converted in a child process; its peak RSS is the child's ru_maxrss
   (os.wait4), checked against 1.5 x the checkpoint's largest tensor + the baseline.

Memory, not time: the load on the machine does not change the numbers. Writes the Markdown table
to stdout (benchmarks/RESULTS_megatron_convert.md holds a run).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

BIG = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304, seq_length=1024)
SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)


def make_checkpoint(path: str, shape: dict) -> None:
    import megatron_core_ref as ref
    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        return
    ref.run(ref.Spec(**shape), [ref.save_torch_dist(path, iteration=1)], timeout=3600)


def convert_peak_rss(src: str, dst: str) -> int:
    """Peak RSS (bytes) of the converter run as a child process."""
    shutil.rmtree(dst, ignore_errors=True)
    argv = [sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), "--model-type", "GPT",
            "--loader", "megatron", "--saver", "hf", "--load-dir", src, "--save-dir", dst, "--no-tokenizer"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the converter failed ({proc.returncode}): {' '.join(argv)}")
    return usage.ru_maxrss * 1024  # kilobytes on Linux


def checkpoint_facts(path: str) -> tuple[int, str, int]:
    """(total bytes of the tensors, the largest tensor's key, its bytes) from the checkpoint's metadata."""
    import torch
    from megalite.checkpoint.paths import read_tracker
    from megalite.checkpoint.megatron.format import DistCheckpoint
    ckpt = DistCheckpoint(os.path.join(path, f"iter_{read_tracker(path):07d}"))
    sizes = {k: torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
             for k, (shape, dtype) in ckpt.keys().items()}
    key = max(sizes, key=sizes.get)
    return sum(sizes.values()), key, sizes[key]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/megatron_convert")
    p.add_argument("--keep", action="store_true", help="keep the Hugging Face output")
    args = p.parse_args()
    big, small = os.path.join(args.work, "megatron_big"), os.path.join(args.work, "megatron_small")
    make_checkpoint(small, SMALL)
    make_checkpoint(big, BIG)
    total, key, largest = checkpoint_facts(big)
    baseline = convert_peak_rss(small, os.path.join(args.work, "hf_small"))
    peak = convert_peak_rss(big, os.path.join(args.work, "hf_big"))
    bound = 1.5 * largest + baseline
    out_bytes = sum(os.path.getsize(os.path.join(args.work, "hf_big", f)) for f in os.listdir(os.path.join(args.work, "hf_big")))
    if not args.keep:
        shutil.rmtree(os.path.join(args.work, "hf_big"))
    mb = 1 << 20
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()} {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; commit {commit}")
    print(f"model: {BIG} (megatron-core 0.16 GPTModel, fp32)\n")
    print("| what | MiB |\n|---|---:|")
    for what, n in (("checkpoint tensors (torch_dist, all keys)", total),
                    (f"largest tensor ({key})", largest), ("Hugging Face output (safetensors + config)", out_bytes),
                    ("baseline: the converter's peak RSS on the 2-layer h 64 model", baseline),
                    ("bound: 1.5 x largest tensor + baseline", bound),
                    ("**peak RSS of the conversion**", peak)):
        print(f"| {what} | {n / mb:,.0f} |")
    print(f"\npeak {'<' if peak < bound else '>='} bound: {peak / mb:,.0f} MiB of {bound / mb:,.0f} MiB; "
          f"{peak / total:.2f}x the checkpoint's tensors")
    if peak >= bound:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
