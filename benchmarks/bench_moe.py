"""Mixture of Experts on CPU (numbers go to benchmarks/RESULTS_moe.md; tests never assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py moe-vs-dense [--steps 100] [--contestants moe moe-grouped dense]
    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py moe-vs-dense --profile [--profile-steps 5]
    python benchmarks/bench_moe.py ep-scaling [--steps 12] [--rounds 2]

moe-vs-dense: an MoE GPT (8 SwiGLU experts of ffn F per layer, top-2, aux loss 1e-2) against
the dense GPT of equal active parameters (one SwiGLU MLP of ffn 2F: the same MLP FLOPs per
token; the MoE adds its router), both trained by pretrain_gpt.py's own train_step in this
process on the bundled corpus (data/build, `make data`), one step each in turn so that a shared
machine slows both alike. Reported: tokens/s (median step), the lm loss after the same tokens
(mean of the last 10 steps), and the MoE layers' time in token dispatch and combine (routing
excluded: MoELayer's dispatch and combine phases in the forward, summed over layers; backward not
split).
Each step is timed in wall-clock and in this process's CPU time; the ratio MoE / dense of both
medians is printed (on a shared machine the CPU-time ratio is the steadier one). `moe-grouped` is
the MoE model with --moe-grouped-gemm.

--profile: after two warm-up steps, torch.profiler over --profile-steps steps of each contestant
(one step of each in turn);
every operator's self time is given to the part of the model that ran it (forward: the module
whose forward it ran in; backward: the forward operator that recorded its autograd node) and to
a kind of operator (GEMM, copies, gather/scatter/sort, the rest), in ms per step. An operator's
time is the median of its calls of the same input shapes times their number: robust to the
preemptions of a shared machine, which would otherwise land on whichever operator was running.

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
        """The layer's dispatch and combine phases (MoELayer.dispatch / .combine), timed in the
        forward (instance attributes only; the experts run between the two)."""
        for phase in ("dispatch", "combine"):
            def timed(*args, _fn=getattr(layer, phase)):
                t = time.perf_counter()
                out = _fn(*args)
                self.dispatch_s += time.perf_counter() - t
                return out
            setattr(layer, phase, timed)

    def step(self) -> float:
        from megalite.training import train_step
        return train_step(self.run)["lm_loss"]


def contestant_flags(a, name: str) -> list[str]:
    common = DATA + ["--train-iters", str(a.steps), "--global-batch-size", str(a.micro_batch_size)]
    if name == "dense":
        return common + model_flags(a, False)
    return common + model_flags(a, True) + (["--moe-grouped-gemm"] if name == "moe-grouped" else [])


def moe_vs_dense(a) -> dict:
    contestants = [Contestant(name, contestant_flags(a, name)) for name in a.contestants]
    if a.profile:
        return profile_contestants(a, contestants)
    params = {c.name: sum(p.numel() for m in c.run.model for p in m.parameters()) for c in contestants}
    times, cpu, losses = ({c.name: [] for c in contestants} for _ in range(3))
    for i in range(a.steps):
        for c in contestants:
            t, p = time.perf_counter(), time.process_time()
            losses[c.name].append(c.step())
            times[c.name].append(time.perf_counter() - t)
            cpu[c.name].append(time.process_time() - p)
        if i == 1:  # the first two steps (warm-up) are not timed
            for c in contestants:
                c.dispatch_s = 0.0
    tokens = a.micro_batch_size * a.seq_length
    out = {"params": params, "tokens_per_step": tokens, "steps": a.steps}
    for c in contestants:
        ts = times[c.name][2:]
        out[c.name] = {"tokens_per_s_median": tokens / statistics.median(ts), "step_s_median": statistics.median(ts),
                       "step_cpu_s_median": statistics.median(cpu[c.name][2:]),
                       "loss_first": losses[c.name][0], "loss_last10_mean": statistics.mean(losses[c.name][-10:]),
                       "dispatch_combine_forward_s_per_step": c.dispatch_s / len(ts)}
    print("params: " + ", ".join(f"{name} {n:,}" for name, n in params.items()) + " (MoE: active per token ~ dense)")
    for name in a.contestants:
        r = out[name]
        print(f"{name:11s} tokens/s {r['tokens_per_s_median']:8.0f}  step {1e3 * r['step_s_median']:7.1f} ms "
              f"(CPU {1e3 * r['step_cpu_s_median']:7.1f} ms)  loss {r['loss_first']:.3f} -> {r['loss_last10_mean']:.3f} "
              f"(last 10)  dispatch+combine fwd {1e3 * r['dispatch_combine_forward_s_per_step']:.1f} ms/step")
    if "dense" in out:
        dense = out["dense"]
        for name in a.contestants:
            if name != "dense":
                r = out[name]
                r["ratio_to_dense"] = {"wall": r["step_s_median"] / dense["step_s_median"],
                                       "cpu": r["step_cpu_s_median"] / dense["step_cpu_s_median"]}
                print(f"ratio {name} / dense (median step): wall {r['ratio_to_dense']['wall']:.3f}, "
                      f"CPU {r['ratio_to_dense']['cpu']:.3f}")
    return out


# -- profile -----------------------------------------------------------------------------------
KINDS = {  # operator -> kind (self CPU time); the rest: "other"
    "GEMM": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul",
             "aten::linear"},
    "copy/stack": {"aten::stack", "aten::cat", "aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy",
                   "aten::to", "aten::new_zeros", "aten::zeros", "aten::zero_", "aten::fill_", "aten::zeros_like"},
    "gather/scatter/sort": {"aten::index_select", "aten::index_add_", "aten::index_add", "aten::index",
                            "aten::index_put_", "aten::scatter_add_", "aten::scatter_", "aten::scatter", "aten::gather",
                            "aten::argsort", "aten::sort", "aten::masked_fill", "aten::cumsum", "aten::topk",
                            "aten::index_select_backward", "aten::embedding_dense_backward"},
}
REGION = "region:"


def _kind(event) -> str:
    if event.name.startswith(REGION) or event.name.startswith("autograd::") or event.name.endswith("Backward0") \
            or event.name.endswith("Backward1") or event.name.endswith("BackwardBackward"):
        return "overhead"  # time of the Python code and autograd engine between operators
    return next((kind for kind, names in KINDS.items() if event.name in names), "other")


def _label_regions(c: Contestant) -> None:
    """record_function around the forward of each part of the model (innermost wins)."""
    from torch.profiler import record_function
    from megalite.model.moe.layer import MoELayer

    def label(module, name):
        state = {}
        module.register_forward_pre_hook(lambda m, i: state.setdefault("rf", []).append(
            record_function(REGION + name).__enter__()))
        module.register_forward_hook(lambda m, i, o: state["rf"].pop().__exit__(None, None, None))

    for m in c.run.model:
        label(m, "embedding, output, loss")
        for layer in m.decoder.layers:
            label(layer.self_attention, "attention")
            for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                label(norm, "norms")
            if isinstance(layer.mlp, MoELayer):
                label(layer.mlp, "moe: layer rest")
                label(layer.mlp.router, "moe: router")
                label(layer.mlp.experts, "moe: experts")
                for phase in ("dispatch", "combine"):
                    def region(*args, _fn=getattr(layer.mlp, phase)):
                        with record_function(REGION + "moe: dispatch+combine"):
                            return _fn(*args)
                    setattr(layer.mlp, phase, region)
            else:
                label(layer.mlp, "dense mlp")
    opt = c.run.state.optimizer
    step = opt.step

    def opt_step(*args, **kw):
        with record_function(REGION + "optimizer"):
            return step(*args, **kw)
    opt.step = opt_step


def _region_of(event, seq_region: dict) -> tuple[str, str]:
    """(phase, region) of an operator event."""
    e = event
    while e is not None:
        if e.name.startswith(REGION):
            return "forward" if e.name != REGION + "optimizer" else "step", e.name[len(REGION):]
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "backward", seq_region.get((e.thread, e.sequence_nr), "other")
        e = e.cpu_parent
    return "step", "outside the model"  # zeroing gradients, the loss's reduction, the gradient check


def profile_table(sessions, steps: int) -> dict:
    """{(phase, region): {kind: ms per step}} from the events of profiler sessions."""
    # a shared machine preempts the process mid-operator and the clock runs on: each operator's
    # time is the median of its calls with the same input shapes, times their number
    calls: dict = {}
    for events in sessions:
        seq_region = {}
        for e in events:  # forward operators that recorded an autograd node: their region
            if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
                phase, region = _region_of(e, {})
                if phase == "forward":
                    seq_region.setdefault((e.thread, e.sequence_nr), region)
        for e in events:
            phase, region = _region_of(e, seq_region)
            key = (phase, region, _kind(e), e.name, str(e.input_shapes))
            calls.setdefault(key, []).append(e.self_cpu_time_total)
    table: dict = {}
    for (phase, region, kind, _, _), times in calls.items():
        row = table.setdefault((phase, region), {})
        row[kind] = row.get(kind, 0.0) + statistics.median(times) * len(times) / 1e3 / steps
    return table


def print_profile(name: str, table: dict, wall_ms: float) -> None:
    kinds = ["GEMM", "copy/stack", "gather/scatter/sort", "other", "overhead"]
    total = sum(sum(r.values()) for r in table.values())
    print(f"\n{name}: {wall_ms:.1f} ms/step under the profiler, {total:.1f} ms/step of operator self time"
          " (ms/step; overhead: Python and autograd between operators)")
    print(f"| phase | part | total | {' | '.join(kinds)} |")
    print("|---|---|---|" + "---|" * len(kinds))
    order = {"forward": 0, "backward": 1, "step": 2}
    for (phase, region), row in sorted(table.items(), key=lambda kv: (order[kv[0][0]], -sum(kv[1].values()))):
        print(f"| {phase} | {region} | {sum(row.values()):.1f} | "
              + " | ".join(f"{row.get(k, 0.0):.1f}" for k in kinds) + " |")
    print(f"| all | | {total:.1f} | " + " | ".join(
        f"{sum(r.get(k, 0.0) for r in table.values()):.1f}" for k in kinds) + " |")


def profile_contestants(a, contestants) -> dict:
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for c in contestants:
        _label_regions(c)
        for _ in range(2):  # warm-up
            c.step()
    sessions, wall = {c.name: [] for c in contestants}, {c.name: 0.0 for c in contestants}
    for _ in range(a.profile_steps):  # one step of each in turn, as the timing does
        for c in contestants:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                t = time.perf_counter()
                c.step()
                wall[c.name] += time.perf_counter() - t
            sessions[c.name].append(prof.events())
    for c in contestants:
        table = profile_table(sessions[c.name], a.profile_steps)
        wall_ms = wall[c.name] * 1e3 / a.profile_steps
        print_profile(c.name, table, wall_ms)
        out[c.name] = {"wall_ms_per_step": wall_ms,
                       "table": [{"phase": ph, "part": rg, **row} for (ph, rg), row in table.items()]}
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
    p.add_argument("--contestants", nargs="+", choices=["moe", "moe-grouped", "dense"], default=["moe", "dense"],
                   help="moe-vs-dense: the models, stepped in turn (moe-grouped: with --moe-grouped-gemm)")
    p.add_argument("--profile", action="store_true", help="moe-vs-dense: where each step's time goes, by part and kind")
    p.add_argument("--profile-steps", type=int, default=5)
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
