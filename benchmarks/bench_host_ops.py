"""Host work per training step: megalite beside GPT2LMHeadModel + torch AdamW + clip_grad_norm_.

    OMP_NUM_THREADS=1 python benchmarks/bench_host_ops.py [--sizes 125M 350M] [--microbatches 1 8] \
        [--steps 5] [--out benchmarks/RESULTS_host_ops.md]

On a GPU every aten op is a dispatch and, most of them, a kernel launch: a step whose op count
grows with the model waits on the host (benchmarks/RESULTS_gpu.md). Counted here on the CPU, where
the figures do not need a GPU and do not depend on the machine:

- aten ops per step: torch.profiler's CPU events whose name starts with `aten::`, nested ones
  included (a composite op and the ops it calls each count), for one step after two warm-up
  steps, with the part inside the optimizer's step (unscaling, the gradient norm, clipping, the
  update, the master-to-model copies) apart for megalite;
- host time per step: wall time of a step of the same layers and parameter tensors at hidden
  size 64 (the compute is then a small part of the step, what remains is dispatch and Python),
  median over --steps steps after warm-up, both contestants alternating step by step.

The model and batch are the same for both: GPT-2's shapes (12 x 768 / 24 x 1024, vocabulary 50304,
learned positions, tied embeddings, dropout 0), micro-batches of 1 x 32 tokens, fp32, one process.
The reference accumulates its micro-batches with one backward each, as megalite does.
`count_step_ops` and `Reference` serve tests/test_host_ops.py too.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import commit, machine  # noqa: E402

SHAPES = {"125M": (12, 768, 12), "350M": (24, 1024, 16)}  # layers, hidden, heads (GPT-3 paper, Table 2.1)
VOCAB, SEQ = 50304, 32


def megalite_flags(layers: int, hidden: int, heads: int, microbatches: int, vocab: int = VOCAB,
                   extra: list | None = None) -> list[str]:
    return ["--mock-data", "--vocab-size", str(vocab), "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(SEQ), "--max-position-embeddings", "1024",
            "--micro-batch-size", "1", "--global-batch-size", str(microbatches), "--train-iters", "1000000",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "1.0",
            "--eval-iters", "0", "--make-vocab-size-divisible-by", "128", "--log-interval", "1000000"] + (extra or [])


class Megalite:
    name = "megalite"

    def __init__(self, layers, hidden, heads, microbatches, vocab=VOCAB, extra=None):
        from megalite.arguments import parse_args, validate_args
        from megalite.training import setup
        self.run = setup(validate_args(parse_args(megalite_flags(layers, hidden, heads, microbatches, vocab, extra)), 1))

    def step(self) -> None:
        from megalite.training import train_step
        train_step(self.run)

    def optimizer_step(self):
        """The callable whose ops count as the optimizer's part."""
        return self.run.state.optimizer, "step"

    def close(self) -> None:
        self.run.closing.close()


class Reference:
    """GPT2LMHeadModel (SDPA) + torch AdamW (fused where the device has it) + clip_grad_norm_."""
    name = "GPT2LMHeadModel + AdamW + clip_grad_norm_"

    def __init__(self, layers, hidden, heads, microbatches, vocab=VOCAB):
        from transformers import GPT2Config, GPT2LMHeadModel

        from megalite.optimizer.optimizer import _torch_fused_supported
        cfg = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=heads,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                     fused=_torch_fused_supported(torch.device("cpu")))
        self.microbatches = microbatches
        self.ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))

    def step(self) -> None:
        for _ in range(self.microbatches):
            (self.model(input_ids=self.ids, labels=self.ids).loss / self.microbatches).backward()
        self.update()
        self.opt.zero_grad(set_to_none=True)

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def optimizer_step(self):
        return self, "update"

    def close(self) -> None:
        pass


def count_step_ops(contestant, warmup: int = 2) -> dict:
    """{"total": aten ops in one step, "optimizer": those inside the optimizer's step, "top": the most
    frequent ops}: torch.profiler CPU events, nested included."""
    from torch.profiler import ProfilerActivity, profile, record_function
    owner, attr = contestant.optimizer_step()
    original = getattr(owner, attr)

    def marked(*args, **kwargs):
        with record_function("bench_host_ops::optimizer"):
            return original(*args, **kwargs)
    for _ in range(warmup):
        contestant.step()
    setattr(owner, attr, marked)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            contestant.step()
    finally:
        setattr(owner, attr, original)
    events = prof.events()
    marks = [e.time_range for e in events if e.name == "bench_host_ops::optimizer"]
    ops = [e for e in events if e.name.startswith("aten::")]
    inside = sum(1 for e in ops if any(r.start <= e.time_range.start and e.time_range.end <= r.end for r in marks))
    return {"total": len(ops), "optimizer": inside,
            "top": collections.Counter(e.name for e in ops).most_common(6)}


def _counted(kind, *shape) -> dict:
    """count_step_ops of a contestant built for it alone (one model of the size in memory at a time)."""
    contestant = kind(*shape)
    try:
        return count_step_ops(contestant)
    finally:
        contestant.close()
        del contestant
        gc.collect()


def host_times(contestants, steps: int) -> dict:
    """Median wall seconds per step, the contestants alternating step by step."""
    times = {c.name: [] for c in contestants}
    for c in contestants:
        c.step()
        c.step()
    for _ in range(steps):
        for c in contestants:
            t = time.perf_counter()
            c.step()
            times[c.name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--microbatches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=5, help="timed steps per contestant for the host time")
    p.add_argument("--out", help="write the results as markdown here")
    a = p.parse_args(argv)
    rows, counts = [], {}
    for size in a.sizes:
        layers, hidden, heads = SHAPES[size]
        for m in a.microbatches:
            c_ours, c_ref = _counted(Megalite, layers, hidden, heads, m), _counted(Reference, layers, hidden, heads, m)
            narrow = [Megalite(layers, 64, 4, m), Reference(layers, 64, 4, m)]
            narrow[0].name = "megalite"
            t = host_times(narrow, a.steps)
            narrow[0].close()
            counts[(size, m)] = (c_ours, c_ref)
            rows.append(f"| {size} | {m} | {c_ours['total']:,} | {c_ref['total']:,} | "
                        f"{c_ours['total'] / c_ref['total']:.2f}x | {c_ours['optimizer']:,} | {c_ref['optimizer']:,} | "
                        f"{t['megalite'] * 1e3:.1f} | {t[Reference.name] * 1e3:.1f} |")
            print(rows[-1], flush=True)
    per_mb = []
    for size in a.sizes:
        ms = sorted(m for s, m in counts if s == size)
        if len(ms) > 1:
            (o1, r1), (o2, r2) = counts[(size, ms[0])], counts[(size, ms[-1])]
            k = ms[-1] - ms[0]
            per_mb.append(f"- {size}: each further micro-batch {(o2['total'] - o1['total']) / k:,.0f} ops against "
                          f"{(r2['total'] - r1['total']) / k:,.0f} "
                          f"({(o2['total'] - o1['total']) / (r2['total'] - r1['total']):.2f}x)")
    text = ["# Host work per step (aten ops and host time), megalite against transformers", "",
            f"Machine: {machine()}; torch {torch.__version__}; commit {commit()}; "
            f"{torch.get_num_threads()} thread(s).", "",
            "Command: `OMP_NUM_THREADS=1 python benchmarks/bench_host_ops.py "
            + " ".join(["--sizes", *a.sizes, "--microbatches", *map(str, a.microbatches), "--steps", str(a.steps)])
            + "` (see the script's docstring for what is counted).", "",
            "| shape | micro-batches | megalite aten ops | reference aten ops | ratio | megalite optimizer ops | "
            "reference optimizer ops (clip + AdamW) | megalite host ms (width 64) | reference host ms (width 64) |",
            "|---|---|---|---|---|---|---|---|---|", *rows, "", *per_mb, ""]
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
