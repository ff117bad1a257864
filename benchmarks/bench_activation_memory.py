"""Activation memory of one GPT model under no / selective / full recompute, with and without
sequence parallelism, next to Megatron-LM's estimate (numbers go to
benchmarks/RESULTS_activation_memory.md; tests never assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_activation_memory.py [--device cpu|cuda] [--json out.json]

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Sec. 4,
estimate the activations one transformer layer keeps for backward, in bytes with 16-bit activations:

    no recompute       s·b·h·(34 + 5·a·s/h)          TP t without SP: s·b·h·(10 + 24/t + 5·a·s/(h·t))
    selective          s·b·h·34                       (the 5·a·s/h term: softmax, its dropout mask
                                                       and output; also gone with a fused kernel)
    full (per layer)   s·b·h·2                        (the layer input only)
    with SP            every term above divided by t

Each case runs in fresh processes (one, or two gloo ranks for TP=2), does one warm-up step at
micro-batch 1, then one forward/backward at the benchmark's micro-batch and reports per rank:

- saved bytes: everything autograd keeps for backward at the end of the forward pass, counted with
  saved-tensor hooks, one count per storage, parameters excluded (megalite.recompute.SavedActivations).
  "layers" is what the transformer layers keep (per layer), "model" adds embedding, final norm,
  logits and loss. This is what the estimate describes;
- peak: on CUDA, max_memory_allocated() minus the memory allocated before the step; on CPU, the
  peak resident set (VmHWM, reset through /proc/self/clear_refs) minus the RSS before the step,
  with glibc's mmap threshold pinned so freed activations go back to the OS. It includes what the
  saved bytes cannot: the layer being recomputed during backward, gradients and temporaries.
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


def megatron_estimate(s, b, h, a, t, sp, recompute) -> float:
    """Bytes per layer per rank, 16-bit activations (Korthikanti et al. 2022, Eq. 1-2, Table 2)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp or t == 1:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)


# -- one rank ----------------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure(case: dict, group, rank: int, device: str) -> dict:
    import gc

    import torch

    from megalite.data.batch import build_batch
    from megalite.model import GPTModel, model_configs
    from megalite.recompute import SavedActivations
    from megalite.tensor_parallel import seed_everything

    m = case["model"]
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rc = {"none": {}, "selective": dict(recompute_granularity="selective"),
          "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}[case["recompute"]]
    cfg, execution = model_configs(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                    vocab_size=m["vocab"], padded_vocab_size=m["vocab"], seq_length=m["seq"],
                    max_position_embeddings=m["seq"], hidden_dropout=0.1, attention_dropout=case["attention_dropout"],
                    sequence_parallel=case["sp"], params_dtype=getattr(torch, m["dtype"]), **rc)
    tracker = seed_everything(1234, rank, 0, dev)
    model = GPTModel(cfg, group, tracker, device=dev, execution=execution)
    model.initialize(1234)
    model.train()
    params = list(model.parameters())

    def step(b, counter=None):
        tokens = torch.randint(0, m["vocab"], (b, m["seq"] + 1), generator=torch.Generator().manual_seed(b))
        batch = {k: (v.to(dev) if v is not None else None) for k, v in build_batch(tokens).items()}
        if counter is None:
            loss = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"]).float().mean()
        else:
            with counter:
                loss = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"]).float().mean()
        loss.backward()

    step(1)  # warm-up: kernels, gradients and allocator pools exist before we measure
    for p in params:
        p.grad.zero_()
    gc.collect()

    counter = SavedActivations(params)
    counter.region = "embedding"
    model.decoder.register_forward_pre_hook(lambda *_: setattr(counter, "region", "layers"))
    if model.decoder.final_layernorm is not None:
        model.decoder.final_layernorm.register_forward_pre_hook(lambda *_: setattr(counter, "region", "head"))
    model.decoder.register_forward_hook(lambda *_: setattr(counter, "region", "head"))

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        exact_peak = True
    else:
        exact_peak = _reset_peak_rss()
        base = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    step(m["micro_batch"], counter)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = (_status_kib("VmHWM") * 1024 if exact_peak else _maxrss_bytes()) - base
    seconds = time.perf_counter() - t0
    return {"rank": rank, "layers_bytes": counter.nbytes("layers"), "model_bytes": counter.nbytes(),
            "peak_bytes": peak, "peak_exact": exact_peak, "step_s": seconds, "device": dev.type}


def _maxrss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_main(rank, world, port, case, device, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        group = None
        if world > 1:
            dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        queue.put(("ok", measure(case, group, rank, device)))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_case(case: dict, device: str) -> list[dict]:
    import torch
    import torch.multiprocessing as mp
    world = case["tp"]
    if device == "cuda" and torch.cuda.device_count() < world:
        device = "cpu"  # one rank per GPU: TP=2 on a single GPU runs on CPU (gloo) instead
    from megalite.rendezvous import free_port
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, case, device, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    for _ in range(world):
        status, value = queue.get(timeout=1800)
        if status == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(value)
        results.append(value)
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    # pinned mmap threshold: large blocks are mmap'ed and unmapped on free, so RSS follows live memory
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                 seq=args.seq_length, micro_batch=args.micro_batch_size, vocab=args.vocab_size, dtype=args.dtype)
    s, b, h, a, L = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads, args.num_layers
    elt = 2 if args.dtype == "bfloat16" else 4
    cases = []
    for tp, sp in ((1, False), (2, False), (2, True)):
        for recompute in ("none", "selective", "full"):
            cases.append(dict(model=model, tp=tp, sp=sp, recompute=recompute, attention_dropout=0.1))
    cases.append(dict(model=model, tp=1, sp=False, recompute="none", attention_dropout=0.0))  # fused kernel

    try:
        import torch
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"commit {commit}{' + uncommitted changes' if dirty else ''}")
    except Exception:  # pragma: no cover - informational only
        pass
    print(f"# model: {L} layers, h {h}, a {a}, s {s}, micro-batch {b}, vocab {args.vocab_size}, {args.dtype}, "
          f"hidden dropout 0.1; full = uniform, 1 layer per chunk")
    print("| layout | recompute | attn. dropout | layers: saved / layer (MiB) | Megatron est. / layer (MiB) "
          "| measured / est. | model: saved (MiB) | peak fwd+bwd (MiB) | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        ranks = run_case(case, args.device)
        est = megatron_estimate(s, b, h, a, case["tp"], case["sp"], case["recompute"]) * elt / 2
        if case["attention_dropout"] == 0 and case["recompute"] == "none":
            est = megatron_estimate(s, b, h, a, case["tp"], case["sp"], "selective") * elt / 2  # fused kernel
        layout = f"TP={case['tp']}" + (" + SP" if case["sp"] else "") + (f" (per rank, {case['tp']} gloo procs)"
                                                                       if case["tp"] > 1 else "")
        per_layer = [r["layers_bytes"] / L for r in ranks]

        def fmt(xs, scale=MiB):
            vals = sorted({round(x / scale, 1) for x in xs})
            return " / ".join(f"{v:.1f}" for v in vals)

        peak_mark = "" if all(r["peak_exact"] for r in ranks) else " (≥, ru_maxrss)"
        print(f"| {layout} | {case['recompute']} | {case['attention_dropout']} | {fmt(per_layer)} | {est / MiB:.1f} | "
              f"{max(per_layer) / est:.2f} | {fmt([r['model_bytes'] for r in ranks])} | "
              f"{fmt([r['peak_bytes'] for r in ranks])}{peak_mark} | {max(r['step_s'] for r in ranks):.1f} |",
              flush=True)
        rows.append({"case": {k: v for k, v in case.items() if k != "model"}, "estimate_bytes_per_layer": est,
                     "ranks": ranks, "wall_s": time.perf_counter() - t0})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
