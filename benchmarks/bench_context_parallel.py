"""Activation memory per rank and step time of one GPT against the context-parallel size c (1, 2,
4) at a long sequence, beside the estimate (numbers go to benchmarks/RESULTS_context_parallel.md;
tests never assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel.py [--seq 2048] [--hidden 128] [--heads 4]
        [--query-groups G] [--layers 2] [--json out.json]

Each c runs in c fresh gloo processes (model/context_parallel.py: rank r holds chunks r and
2c-1-r of 2c, keys/values all-gathered), one warm-up step, then per rank:
- saved bytes: what autograd keeps for backward at the end of the forward pass, one count per
  storage, parameters excluded (megalite.recompute.SavedActivations), for the transformer layers
  ("layers", per layer) and the whole model;
- step time: the mean of --steps forward/backward passes of one micro-batch (wall clock, gloo on
  CPU: the K/V all-gather is a real collective between processes).
Estimate per layer (tools/plan.py's accounting, Korthikanti et al. 2022 Table 2 with s -> s/c):
    (s/c)·b·h·(10 + 4 + 4·(g/a)·(1 + c if c > 1 else 1) + 16 + 5·a·s/h) x 2 (fp32)
where the (1 + c) counts the local and the gathered keys and values, and the scores are [s/c, s].
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2**20


def estimate_layer_bytes(s, b, h, a, g, c, ffn, scores=True) -> float:
    attention = 4 + 4 * g / a * (1 + c if c > 1 else 1)
    return (s / c) * b * h * (10 + attention + 4 * ffn / h + (5 * a * s / h if scores else 0)) * 2


def measure(m: dict, group, rank: int, world: int) -> dict:
    import gc

    import torch

    from megalite.data.batch import build_batch
    from megalite.model import ExecutionConfig, GPTConfig, GPTModel
    from megalite.context_parallel.attention import set_hierarchy
    from megalite.context_parallel.sharding import slice_batch
    from megalite.recompute import SavedActivations
    cfg = GPTConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                    vocab_size=m["vocab"], padded_vocab_size=m["vocab"], seq_length=m["seq"],
                    max_position_embeddings=m["seq"], hidden_dropout=0.0, attention_dropout=0.0,
                    position_embedding_type="rope",
                    num_query_groups=m["groups"])
    model = GPTModel(cfg, cp_group=group, execution=ExecutionConfig(cp_comm_type=(m.get("cp_type", "allgather"),)))
    if m.get("levels"):
        set_hierarchy(model, m["levels"])
    model.initialize(1234)
    model.train()
    params = list(model.parameters())
    tokens = torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1), generator=torch.Generator().manual_seed(1))
    batch = slice_batch(build_batch(tokens), world, rank)

    def step(counter=None):
        with counter if counter is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            losses = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"])
        loss = losses.float().sum() / batch.get("num_tokens_sequence", batch["loss_mask"].sum())
        loss.backward()

    if m["steps"]:
        step()  # warm-up
    gc.collect()
    counter = SavedActivations(params)
    counter.region = "embedding"
    model.decoder.register_forward_pre_hook(lambda *_: setattr(counter, "region", "layers"))
    model.decoder.register_forward_hook(lambda *_: setattr(counter, "region", "head"))
    for layer in model.decoder.layers:  # --types: the attention block's part of each layer
        layer.self_attention.register_forward_pre_hook(lambda *_: setattr(counter, "region", "attention"))
        layer.self_attention.register_forward_hook(lambda *_: setattr(counter, "region", "layers"))
    step(counter)
    times = []
    for _ in range(m["steps"]):
        if group is not None:
            torch.distributed.barrier(group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    attention = counter.nbytes("attention") / m["layers"]
    return {"rank": rank, "layers_bytes": counter.nbytes("layers") / m["layers"] + attention,
            "attention_bytes": attention, "model_bytes": counter.nbytes(),
            "step_s": sum(times) / len(times) if times else float("nan")}


def _rank_main(rank, world, port, m, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        group = None
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        if m.get("cp_type") == "a2a+p2p":  # --hierarchical-context-parallel-sizes 2 c/2
            firsts = [dist.new_group(list(range(i, i + 2))) for i in range(0, world, 2)]
            seconds = [dist.new_group(list(range(i, world, 2))) for i in range(2)]
            m = dict(m, levels=[firsts[rank // 2], seconds[rank % 2]])
        queue.put(("ok", measure(m, group, rank, world)))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run(m: dict, c: int) -> list[dict]:
    import torch.multiprocessing as mp
    from megalite.rendezvous import free_port
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, c, port, m, queue)) for r in range(c)]
    for p in procs:
        p.start()
    out = []
    for _ in range(c):
        status, value = queue.get(timeout=1800)
        if status == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(value)
        out.append(value)
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--query-groups", type=int, help="GQA: key/value heads (default: --heads, no GQA)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json")
    ap.add_argument("--types", nargs="+", choices=["allgather", "a2a", "p2p", "a2a+p2p"],
                    help="sweep: per-rank attention activations of each --cp-comm-type at each of --seqs and --cp")
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    a = ap.parse_args()
    if a.types:
        return sweep(a)
    m = {"seq": a.seq, "hidden": a.hidden, "heads": a.heads, "groups": a.query_groups or a.heads, "layers": a.layers, "vocab": 512, "micro_batch": 1,
         "steps": a.steps}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; commit {commit}")
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {m['groups']} query groups, RoPE, fp32, seq {a.seq}, micro-batch 1")
    print("| CP | layer activations / rank (MiB), measured max | estimate without / with the s² scores | "
          "measured ratio to CP 1 | whole model / rank (MiB) | step time (s), slowest rank |")
    print("|---|---|---|---|---|---|")
    rows, base = [], None
    for c in a.cp:
        res = run(m, c)
        layer = max(r["layers_bytes"] for r in res)
        base = base or layer
        est = estimate_layer_bytes(a.seq, 1, a.hidden, a.heads, m["groups"], c, 4 * a.hidden)
        est_fused = estimate_layer_bytes(a.seq, 1, a.hidden, a.heads, m["groups"], c, 4 * a.hidden, scores=False)
        row = {"cp": c, "layer_bytes": layer, "estimate_bytes": est, "model_bytes": max(r["model_bytes"] for r in res),
               "step_s": max(r["step_s"] for r in res), "ranks": res}
        rows.append(row)
        print(f"| {c} | {layer / MiB:.1f} | {est_fused / MiB:.1f} / {est / MiB:.1f} | {layer / base:.3f} | {row['model_bytes'] / MiB:.1f} | "
              f"{row['step_s']:.3f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": commit, "model": m, "rows": rows}, f, indent=1)


def sweep(a) -> None:
    """--types: attention activations per layer and rank (what the self-attention block saves for
    backward) of each type, CP size and sequence length, beside planning/context_parallel.py's."""
    from megalite.planning.context_parallel import attention_activation_bytes
    groups = a.query_groups or a.heads
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
          f"commit {commit}; model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {groups} query groups, "
          f"RoPE, fp32, micro-batch 1")
    print("| seq | CP | --cp-comm-type | attention activations / layer / rank (MiB), measured max | plan.py | "
          "whole layer (MiB) | step (s) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for seq in a.seqs:
        for c in a.cp:
            for t in a.types:
                if t == "a2a+p2p" and c < 4:
                    continue
                m = {"seq": seq, "hidden": a.hidden, "heads": a.heads, "groups": groups, "layers": a.layers,
                     "vocab": 512, "micro_batch": 1, "steps": a.steps, "cp_type": t}
                res = run(m, c)
                att = max(r["attention_bytes"] for r in res)
                est = attention_activation_bytes(t, seq, 1, a.hidden, a.heads, groups, c, a2a=2, dtype_bytes=4)
                if t == "allgather" and c > 1:  # its [s/c, s] fp32 causal mask, shared by the layers
                    est += seq / c * seq * 4 / a.layers
                row = {"seq": seq, "cp": c, "type": t, "attention_bytes": att, "plan_bytes": est,
                       "layer_bytes": max(r["layers_bytes"] for r in res), "step_s": max(r["step_s"] for r in res)}
                rows.append(row)
                print(f"| {seq} | {c} | {t} | {att / MiB:.2f} | {est / MiB:.2f} | {row['layer_bytes'] / MiB:.2f} | "
                      f"{row['step_s']:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": commit, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
