"""Peak memory of the vocabulary-parallel cross entropy (forward, then forward + backward) over the
memory resident before it, one process, against the unfused form every trainer without a fused
loss runs (an fp32 copy of the logits into F.cross_entropy, as transformers' GPT2LMHeadModel does).

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/bench_cross_entropy_memory.py \
        [--vocab 50304 131072] [--tokens 4096] [--dtype bfloat16] [--out benchmarks/RESULTS_cross_entropy.md]

Contestants: megalite's loss (`vocab_parallel_cross_entropy`), the same with
--cross-entropy-loss-fusion (`fused_vocab_parallel_cross_entropy`), and `F.cross_entropy(x.float())`.
The mmap threshold is pinned so that freed buffers go back to the OS, and the peak RSS (VmHWM,
reset through /proc/self/clear_refs) measures what was held at once; Linux only. The logits'
gradient (one logits-sized tensor in the logits' dtype) is part of every contestant's backward.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


def contestants():
    from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
    return {"megalite": lambda x, t, v: vocab_parallel_cross_entropy(x, t, None, v),
            "megalite --cross-entropy-loss-fusion": lambda x, t, v: fused_vocab_parallel_cross_entropy(x, t, None, v),
            "F.cross_entropy(logits.float())": lambda x, t, v: F.cross_entropy(
                x.float().flatten(0, 1), t.flatten(), reduction="none").view(t.shape)}


def measure(fn, tokens: int, vocab: int, dtype) -> tuple[float, float, float]:
    """(logits MiB, forward peak MiB, forward + backward peak MiB) over the resident memory before."""
    x = torch.randn(tokens, 1, vocab).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens, 1))
    fn(x[:1], t[:1], vocab).sum().backward()  # warm-up
    x.grad = None
    open("/proc/self/clear_refs", "w").write("5")
    base = kib("VmRSS")
    loss = fn(x, t, vocab)
    fwd = kib("VmHWM") - base
    loss.sum().backward()
    tot = kib("VmHWM") - base
    return x.numel() * x.element_size() / 2**20, fwd / 1024, tot / 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[50304, 131072])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    rows = []
    for vocab in a.vocab:
        for name, fn in contestants().items():
            logits, fwd, tot = measure(fn, a.tokens, vocab, dtype)
            rows.append(f"| {vocab} | {name} | {logits:.0f} | {fwd:.0f} | {tot:.0f} |")
            print(rows[-1], flush=True)
    from bench_throughput import commit
    text = ["# Cross-entropy memory: megalite's loss against an fp32 copy into F.cross_entropy", "",
            f"Commit {commit()}, torch {torch.__version__}, CPU, one thread; {a.tokens} tokens, "
            f"{a.dtype} logits. Command: `MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python "
            f"benchmarks/bench_cross_entropy_memory.py --vocab {' '.join(map(str, a.vocab))} --tokens {a.tokens} "
            f"--dtype {a.dtype}`.", "",
            "| vocabulary | loss | logits (MiB) | forward peak over start (MiB) | forward + backward peak (MiB) |",
            "|---|---|---|---|---|", *rows, ""]
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
