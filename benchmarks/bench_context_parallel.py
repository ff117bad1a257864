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
import socket
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
    from megalite.model import GPTConfig, GPTModel
    from megalite.context_parallel.sharding import slice_batch
    from megalite.recompute import SavedActivations
    cfg = GPTConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                    vocab_size=m["vocab"], padded_vocab_size=m["vocab"], seq_length=m["seq"],
                    max_position_embeddings=m["seq"], hidden_dropout=0.0, attention_dropout=0.0,
                    position_embedding_type="rope",
                    num_query_groups=m["groups"])
    model = GPTModel(cfg, cp_group=group)
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

    step()  # warm-up
    gc.collect()
    counter = SavedActivations(params)
    counter.region = "embedding"
    model.decoder.register_forward_pre_hook(lambda *_: setattr(counter, "region", "layers"))
    model.decoder.register_forward_hook(lambda *_: setattr(counter, "region", "head"))
    step(counter)
    times = []
    for _ in range(m["steps"]):
        if group is not None:
            torch.distributed.barrier(group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"rank": rank, "layers_bytes": counter.nbytes("layers") / m["layers"], "model_bytes": counter.nbytes(),
            "step_s": sum(times) / len(times)}


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
        queue.put(("ok", measure(m, group, rank, world)))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run(m: dict, c: int) -> list[dict]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
