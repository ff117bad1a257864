"""Mixture of Experts on CPU (numbers go to benchmarks/RESULTS_moe.md; tests never assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py moe-vs-dense [--steps 100]
    python benchmarks/bench_moe.py ep-scaling [--steps 12] [--rounds 2]

moe-vs-dense: an MoE GPT (8 SwiGLU experts of ffn F per layer, top-2, aux loss 1e-2) against
the dense GPT of equal active parameters (one SwiGLU MLP of ffn 2F: the same MLP FLOPs per
token; the MoE adds its router), both trained by pretrain_gpt.py's own train_step in this
process on the bundled corpus (data/build, `make data`), one step each in turn so that a shared
machine slows both alike. Reported: tokens/s (median step), the lm loss after the same tokens
(mean of the last 10 steps), and the MoE layers' time in token dispatch and combine (routing
excluded: the dispatcher's forward minus its experts', summed over layers; backward not split).

ep-scaling: the MoE GPT on 4 gloo ranks (DP 4) with EP 1, 2 and 4, under torchrun in turn (and
again, --rounds): median step time per run and, from each run's memory_footprint record, the weights, gradients and
optimizer bytes of rank 0, beside tools/plan.py's figures for the same flags.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import commit, machine  # noqa: E402

DATA = ["--data-path", "data/build/corpus_text_document", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", "data/build/tokenizer.model", "--split", "98,2,0"]


def model_flags(a, moe: bool) -> list[str]:
    flags = ["--num-layers", "4", "--hidden-size", str(a.hidden_size), "--num-attention-heads", "4",
             "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-3", "--min-lr", "3e-4",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--clip-grad", "1.0", "--eval-iters", "0",
             "--seed", "1234", "--micro-batch-size", str(a.micro_batch_size), "--distributed-backend", "gloo"]
    if moe:
        return flags + ["--num-experts", str(a.num_experts), "--moe-router-topk", str(a.topk), "--moe-ffn-hidden-size",
                        str(a.ffn), "--moe-aux-loss-coeff", "1e-2"]
    return flags + ["--ffn-hidden-size", str(a.ffn * a.topk)]


class Contestant:
    def __init__(self, name: str, flags: list[str]):
        from megalite.arguments import parse_args, validate_args
        from megalite.training import setup
        self.name = name
        self.run = setup(validate_args(parse_args(flags), 1))
        self.dispatch_s = 0.0
        from megalite.model.moe.balance import moe_layers
        for _, layer in moe_layers(self.run.model):
            self._time_dispatch(layer)

    def _time_dispatch(self, layer) -> None:
        """The dispatcher's forward time minus its experts' (instance attributes only)."""
        dispatcher, experts = layer.dispatcher, layer.experts
        state = {"experts": 0.0}

        def timed(*args):
            t, state["experts"] = time.perf_counter(), 0.0
            out = dispatcher(*args)
            self.dispatch_s += time.perf_counter() - t - state["experts"]
            return out

        def pre(module, inputs):
            state["t"] = time.perf_counter()

        def post(module, inputs, output):
            state["experts"] += time.perf_counter() - state["t"]

        experts.register_forward_pre_hook(pre)
        experts.register_forward_hook(post)
        layer.dispatcher = timed

    def step(self) -> float:
        from megalite.training import train_step
        return train_step(self.run)["lm_loss"]


def moe_vs_dense(a) -> dict:
    common = DATA + ["--train-iters", str(a.steps), "--global-batch-size", str(a.micro_batch_size)]
    contestants = [Contestant("moe", common + model_flags(a, True)), Contestant("dense", common + model_flags(a, False))]
    params = {c.name: sum(p.numel() for m in c.run.model for p in m.parameters()) for c in contestants}
    times, losses = {c.name: [] for c in contestants}, {c.name: [] for c in contestants}
    for i in range(a.steps):
        for c in contestants:
            t = time.perf_counter()
            losses[c.name].append(c.step())
            times[c.name].append(time.perf_counter() - t)
        if i == 1:  # the first two steps (warm-up) are not timed
            for c in contestants:
                c.dispatch_s = 0.0
    tokens = a.micro_batch_size * a.seq_length
    out = {"params": params, "tokens_per_step": tokens, "steps": a.steps}
    for c in contestants:
        ts = times[c.name][2:]
        out[c.name] = {"tokens_per_s_median": tokens / statistics.median(ts), "step_s_median": statistics.median(ts),
                       "loss_first": losses[c.name][0], "loss_last10_mean": statistics.mean(losses[c.name][-10:]),
                       "dispatch_combine_forward_s_per_step": c.dispatch_s / len(ts)}
    print(f"params: moe {params['moe']:,} (active per token ~ dense), dense {params['dense']:,}")
    for name in ("moe", "dense"):
        r = out[name]
        print(f"{name:6s} tokens/s {r['tokens_per_s_median']:8.0f}  step {1e3 * r['step_s_median']:7.1f} ms  loss "
              f"{r['loss_first']:.3f} -> {r['loss_last10_mean']:.3f} (last 10)  dispatch+combine fwd "
              f"{1e3 * r['dispatch_combine_forward_s_per_step']:.1f} ms/step")
    return out


def plan_figures(flags: list[str]) -> dict:
    """tools/plan.py's figures for the same flags: parameters and bytes per GPU, dispatch traffic."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan
    p = plan.make_plan(flags)
    gib = 2 ** 30
    return {"num_params_per_gpu": p["num_params_per_gpu"], "expert_params_per_gpu": p["moe"]["expert_params_per_gpu"],
            "param_bytes": p["memory_gb"]["params"] * gib, "grad_bytes": p["memory_gb"]["grads"] * gib,
            "optimizer_bytes": p["memory_gb"]["optimizer"] * gib,
            "dispatch_bytes_per_iteration": p["moe"]["dispatch_bytes_per_iteration"]}


def ep_scaling(a) -> dict:
    out = {}
    world = 4
    for ep in [ep for _ in range(a.rounds) for ep in a.ep]:  # the EP sizes in turn, round after round
        flags = DATA + model_flags(a, True) + ["--train-iters", str(a.steps), "--global-batch-size",
                                                str(a.micro_batch_size * world), "--log-interval", "1",
                                                "--expert-model-parallel-size", str(ep),
                                                "--moe-token-dispatcher-type", "alltoall"]
        with tempfile.TemporaryDirectory() as tmp:
            jsonl = os.path.join(tmp, "run.jsonl")
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={world}", "pretrain_gpt.py", *flags, "--log-jsonl", jsonl],
                                  capture_output=True, text=True, env=env, cwd=ROOT)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            with open(jsonl) as f:
                records = [json.loads(line) for line in f]
        steps = [r["elapsed_ms"] for r in records if "consumed_samples" in r][2:]
        rank0 = next(r for r in records if r.get("event") == "memory_footprint")["ranks"][0]
        row = out.setdefault(f"ep{ep}", {"step_ms_median_by_round": [], "rank0": rank0,
                                         "plan": plan_figures(flags + ["--world-size", str(world)])})
        row["step_ms_median_by_round"].append(statistics.median(steps))
        mib, pl = 2 ** 20, row["plan"]
        print(f"EP {ep}: step {row['step_ms_median_by_round'][-1]:.0f} ms (median of {len(steps)})")
        print(f"  rank 0 measured: params {rank0['num_params']:,} (experts {rank0.get('num_expert_params', 0):,}), "
              f"weights {rank0['param_bytes'] / mib:.2f} MiB, grads {rank0['grad_bytes'] / mib:.2f} MiB, "
              f"optimizer {rank0['optimizer_bytes'] / mib:.2f} MiB")
        print(f"  plan.py:         params {pl['num_params_per_gpu']:,} (experts {pl['expert_params_per_gpu']:,}), "
              f"weights {pl['param_bytes'] / mib:.2f} MiB, grads {pl['grad_bytes'] / mib:.2f} MiB, "
              f"optimizer {pl['optimizer_bytes'] / mib:.2f} MiB; dispatch {pl['dispatch_bytes_per_iteration'] / mib:.1f} "
              f"MiB per GPU and iteration")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=["moe-vs-dense", "ep-scaling"])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=256, help="each expert's hidden size (the dense MLP's is topk x this)")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=2, help="ep-scaling: runs of each EP size, in turn")
    p.add_argument("--json")
    a = p.parse_args(argv)
    a.steps = a.steps or (100 if a.which == "moe-vs-dense" else 12)
    import torch
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; commit {commit()}")
    result = {"machine": machine(), "commit": commit(), "config": vars(a)}
    result[a.which] = moe_vs_dense(a) if a.which == "moe-vs-dense" else ep_scaling(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
