"""The optimizer step with the gradient factor folded into fused AdamW's `grad_scale`
(optimizer/optimizer.py) beside the same step making the explicit passes (unscale, clip) over the
fp32 gradients first: time per step on the CPU, where the step is bound by memory as on a GPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_grad_scale_fold.py [--layers 12] [--hidden 768] [--steps 9]

A GPT-2-shaped model (fp32, bf16 parameters with fp32 masters when --bf16), one step of real
gradients, then --steps optimizer steps per contestant on those gradients (restored before each),
alternating folded and explicit step by step; a loss scale of 1024 and --clip-grad 0.05 make every
step unscale and clip (the case the fold serves). Median seconds per step and their ratio."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megalite.config import DDPConfig, OptimizerConfig  # noqa: E402
from megalite.distributed import DataParallel  # noqa: E402
from megalite.model import GPTConfig, GPTModel  # noqa: E402
from megalite.optimizer import build_optimizer  # noqa: E402
from megalite.parallel_state import single_process_state  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import commit, machine  # noqa: E402

LOSS_SCALE = 1024.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--steps", type=int, default=9)
    a = p.parse_args(argv)
    config = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.hidden // 64,
                       vocab_size=50304, padded_vocab_size=50304, seq_length=32, max_position_embeddings=32,
                       hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config)
    model.initialize(seed=1)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], single_process_state(), DDPConfig(), num_microbatches=1)
    opt = build_optimizer(named, OptimizerConfig(lr=1e-4, lr_decay_style="constant", lr_decay_iters=100,
                                                 clip_grad=0.05), dp, single_process_state())
    assert opt.fold_scale, "the fold needs torch's fused AdamW on this device"
    tokens = torch.randint(0, 50304, (1, 33), generator=torch.Generator().manual_seed(0))
    (model(tokens[:, :-1], torch.arange(32)[None], labels=tokens[:, 1:]).mean() * LOSS_SCALE).backward()
    dp.finish_grad_sync()
    grads = [g.clone() for g in opt.grad_flats]
    times = {True: [], False: []}
    for i in range(2 * (a.steps + 1)):
        fold = i % 2 == 0
        for g, saved in zip(opt.grad_flats, grads):
            g.copy_(saved)
        opt.fold_scale = fold
        t0 = time.perf_counter()
        opt.step(1e-4, grad_scale=1.0 / LOSS_SCALE)
        if i >= 2:  # the first of each: warm-up
            times[fold].append(time.perf_counter() - t0)
    folded, explicit = statistics.median(times[True]), statistics.median(times[False])
    elements = sum(g.numel() for g in opt.grad_flats)
    print(f"machine: {machine()}; commit {commit()}; torch {torch.__version__}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{a.layers} x {a.hidden}, {elements / 1e6:.1f}M fp32 gradient elements, {a.steps} steps each, alternating")
    print(f"explicit passes: {explicit * 1e3:.1f} ms per step; folded: {folded * 1e3:.1f} ms; "
          f"folded / explicit {folded / explicit:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
