#!/usr/bin/env python3
"""The ZeRO ladder on this machine: memory per rank and step time for every data-parallel
sharding strategy, the two measured design choices, the FSDP2 trial, and the memory wall.

    python benchmarks/bench_zero.py strategies [--dp 2 4 8]   bytes per rank by category (the run's
                                                              memory_footprint record and DataParallel's
                                                              peaks) and step time, beside the formula
    python benchmarks/bench_zero.py alternatives              ZeRO-2: reduce every micro-batch vs accumulate
                                                              locally; ZeRO-3 under PP: re-gather vs keep
    python benchmarks/bench_zero.py fsdp2                     megalite's GPT under torch's fully_shard (FSDP2)
    python benchmarks/bench_zero.py memory-wall [--strategy optim_grads_params] [--iters 3]
                                                              the plain torchrun pretrain_gpt.py command on 8
                                                              gloo ranks, a ~730M GPT (24 layers, hidden 1536,
                                                              vocab 32000, seq 128), megalite's defaults; each
                                                              rank's peak RSS

The first three run pretrain_gpt.py's own setup/train under torchrun (gloo, CPU, one thread per
rank) through this script's `worker` mode, which also writes one JSON line per run with every
rank's peak RSS (resource.getrusage), its RSS before the model was built, and DataParallel's
counters. memory-wall runs pretrain_gpt.py itself, as a user does (`user-rank`: its main, then
the process's peak RSS). Results and the commands are in benchmarks/RESULTS_zero.md. Step times
on a shared 2-core machine are noisy: each is the median over the iterations after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megalite.config.sharding import STRATEGIES  # noqa: E402
GIB, MIB = 2**30, 2**20
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# -- worker: one rank of one configuration ---------------------------------------------------------
def worker(argv) -> None:
    p = argparse.ArgumentParser(prog="bench_zero.py worker")
    p.add_argument("--result", required=True)
    p.add_argument("--local-grad-accumulation", action="store_true",
                   help="DDPConfig.reduce_grads_every_microbatch = False")
    p.add_argument("--keep-params-gathered", action="store_true", help="DDPConfig.keep_params_gathered_in_step = True")
    opts, flags = p.parse_known_args(argv)
    baseline = _max_rss_bytes()  # torch imported, no model yet
    import torch.distributed as dist

    from megalite import comm
    from megalite.arguments import parse_args, validate_args
    from megalite.training import setup, train
    cfg = validate_args(parse_args(flags))
    cfg.ddp.reduce_grads_every_microbatch = not opts.local_grad_accumulation
    cfg.ddp.keep_params_gathered_in_step = opts.keep_params_gathered
    baseline = max(baseline, _max_rss_bytes())
    run = setup(cfg)
    train(run)
    dp, ps = run.dp, run.state.ps
    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank,
            "max_rss_bytes": _max_rss_bytes(), "baseline_rss_bytes": baseline,
            "num_params": sum(q.numel() for q in dp.params), "param_bytes": dp.param_bytes,
            "grad_bytes": dp.grad_bytes, "optimizer_bytes": run.state.optimizer.state_bytes(),
            "buckets": len(dp.layout.buckets),
            "peak_staging_bytes": getattr(dp.grads, "peak_staging_bytes", 0)}
    if dp.strategy.shards_params:
        mine.update(peak_gathered_bytes=dp.param_buffer.peak_gathered_bytes,
                    gathers_per_step=dp.param_buffer.gathers / cfg.training.train_iters)
    ranks = comm.all_gather_object(mine, comm.world_group())
    if ps.rank == 0:
        with open(opts.result, "a") as f:
            f.write(json.dumps({"flags": flags, "local_grad_accumulation": opts.local_grad_accumulation,
                                "keep_params_gathered": opts.keep_params_gathered, "ranks": ranks}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# -- driver --------------------------------------------------------------------------------------
def launch(nproc: int, flags: list[str], tmp: str, worker_opts=(), timeout: float = 3600, env=None) -> dict:
    """Run one configuration; returns {"ranks": [...], "records": [...jsonl...], "wall_s"}."""
    jsonl, result = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "result.jsonl")
    for path in (jsonl, result):
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), "worker", "--result", result, *worker_opts, *flags, "--log-jsonl", jsonl]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    with open(result) as f:
        out = json.loads(f.readline())
    out.update(records=records, wall_s=time.perf_counter() - start, stdout=proc.stdout)
    return out


def step_ms(records) -> float:
    times = [r["elapsed_ms"] for r in records if "consumed_samples" in r]
    return statistics.median(times[1:] if len(times) > 1 else times)


def losses(records) -> list[float]:
    return [r["lm_loss"] for r in records if "consumed_samples" in r]


SMALL = ["--mock-data", "--vocab-size", "8192", "--num-layers", "4", "--hidden-size", "256",
         "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "2", "--lr", "1e-4",
         "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--ddp-bucket-size", "1000000"]


def formula_bytes(strategy: str, n: int, d: int) -> tuple[float, float, float]:
    """fp32 parameters and Adam: (params 4, grads 4, optimizer 8) bytes per parameter, / d where sharded."""
    s = STRATEGIES[strategy]
    return 4 * n / (d if s.shards_params else 1), 4 * n / (d if s.shards_grads else 1), \
        8 * n / (d if s.shards_optimizer else 1)


def bench_strategies(dps, iters: int) -> None:
    print("| DP | strategy | params MiB (formula) | grads MiB (formula) | optimizer MiB (formula) | "
          "gathered / staging peak MiB | step ms | peak RSS MiB (rank 0) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for d in dps:
        for s in STRATEGIES:
            flags = SMALL + ["--global-batch-size", str(4 * d), "--train-iters", str(iters),
                             "--data-parallel-sharding-strategy", s] + (OVERLAP if STRATEGIES[s].shards_optimizer
                                                                          else ["--overlap-grad-reduce"])
            with tempfile.TemporaryDirectory() as tmp:
                out = launch(d, flags, tmp)
            r = out["ranks"][0]
            f = formula_bytes(s, r["num_params"], d)
            peaks = f"{r.get('peak_gathered_bytes', 0) / MIB:.1f} / {r['peak_staging_bytes'] / MIB:.1f}"
            zero = f"ZeRO-{STRATEGIES[s].zero_stage}" if STRATEGIES[s].zero_stage else ""
            print(f"| {d} | {s} {zero} | {r['param_bytes'] / MIB:.2f} ({f[0] / MIB:.2f}) | "
                  f"{r['grad_bytes'] / MIB:.2f} ({f[1] / MIB:.2f}) | "
                  f"{r['optimizer_bytes'] / MIB:.2f} ({f[2] / MIB:.2f}) | "
                  f"{peaks} | {step_ms(out['records']):.0f} | {r['max_rss_bytes'] / MIB:.0f} |", flush=True)


def _alternating(nproc, flags, options, repeats: int = 2):
    """Run each worker option `repeats` times, alternating (A B A B), so that load on a shared
    machine hits both alike; returns {option: [runs]}."""
    runs = {o: [] for o in options}
    for _ in range(repeats):
        for o in options:
            with tempfile.TemporaryDirectory() as tmp:
                runs[o].append(launch(nproc, flags, tmp, [o] if o else []))
    return runs


def _compare(nproc: int, flags: list[str], title: str, columns: str, options, cells) -> None:
    """One table of a design choice: each option run twice, alternately; `cells(rank_0_record)`
    gives the columns between the step times and the last loss."""
    print(title)
    print(f"| {columns.split(' | ')[0]} | step ms (each run) | {columns.split(' | ', 1)[1]} | last loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = _alternating(nproc, flags, [o for o, _ in options])
    for o, name in options:
        times = " / ".join(f"{step_ms(x['records']):.0f}" for x in runs[o])
        print(f"| {name} | {times} | {cells(runs[o][0]['ranks'][0])} | {losses(runs[o][0]['records'])[-1]:.6f} |",
              flush=True)


def bench_alternatives(iters: int) -> None:
    flags = SMALL + ["--num-layers", "8", "--ddp-bucket-size", "500000", "--global-batch-size", "32",
                     "--train-iters", str(iters), "--data-parallel-sharding-strategy", "optim_grads"] + OVERLAP
    _compare(4, flags, "ZeRO-2, DP 4, 8 layers, 4 micro-batches per rank (gradient accumulation), buckets of 500k "
             "elements:", "gradients | peak staging MiB | full fp32 gradients MiB | grad shard MiB",
             [("", "reduce-scattered every micro-batch"), ("--local-grad-accumulation", "accumulated locally, reduced once")],
             lambda r: f"{r['peak_staging_bytes'] / MIB:.2f} | {4 * r['num_params'] / MIB:.2f} | "
                       f"{r['grad_bytes'] / MIB:.2f}")
    flags = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "32",
                     "--train-iters", str(iters), "--data-parallel-sharding-strategy", "optim_grads_params"] + OVERLAP
    _compare(8, flags, "\nZeRO-3, PP 2 x DP 4, 8 layers, 4 micro-batches per rank (1F1B):",
             "parameters | gathers per step (rank 0) | peak gathered MiB | stage params MiB",
             [("", "re-gathered for every use"), ("--keep-params-gathered", "kept gathered through the step")],
             lambda r: f"{r['gathers_per_step']:.0f} | {r['peak_gathered_bytes'] / MIB:.2f} | "
                       f"{4 * r['num_params'] / MIB:.2f}")


# -- FSDP2 trial ---------------------------------------------------------------------------------
def fsdp2_trial_rank() -> None:
    """One rank: megalite's GPT with fully_shard on each layer and the root, 2 micro-batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from megalite.model import GPTConfig, GPTModel
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=8192, padded_vocab_size=8192,
                    seq_length=128, max_position_embeddings=128, hidden_dropout=0, attention_dropout=0)
    model = GPTModel(cfg)
    model.initialize(1)
    with_info = sum(hasattr(p, "megalite_info") for p in model.parameters())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    ids = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(rank))
    pos = torch.arange(128).expand(2, 128)
    times = []
    for it in range(6):
        t = time.perf_counter()
        for mb in range(2):
            model.set_requires_gradient_sync(mb == 1)  # FSDP2's no_sync: unsharded grads kept for accumulation
            model(ids, pos, None, ids).float().mean().backward()
        times.append(1000 * (time.perf_counter() - t))
        if it == 0:
            grad = params[0].grad
        for p in params:
            p.grad = None
    if rank == 0:
        print(json.dumps({"param_types": sorted({type(p).__name__ for p in params}),
                          "megalite_info_kept": sum(hasattr(p, "megalite_info") for p in params),
                          "megalite_info_before": with_info, "post_accumulate_hooks_fired_first_step": len(fired) // 6,
                          "grad_type": type(grad).__name__, "grad_dtype": str(grad.dtype),
                          "grad_local_shape": list(grad.to_local().shape),
                          "forward_backward_ms_median": statistics.median(times[1:])}))
    dist.destroy_process_group()


def bench_fsdp2() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), "fsdp2-rank"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout.strip() or proc.stderr[-3000:])
    print("megalite ZeRO-3, same model, DP 2, 2 micro-batches of 2 (whole step incl. optimizer):")
    flags = SMALL + ["--global-batch-size", "8", "--train-iters", "6", "--data-parallel-sharding-strategy",
                     "optim_grads_params"] + OVERLAP
    with tempfile.TemporaryDirectory() as tmp:
        out = launch(2, flags, tmp)
    print(f"  step ms (median): {step_ms(out['records']):.0f}")


# -- the memory wall -------------------------------------------------------------------------------
# The command a user runs (docs/zero.md, issue 45): torchrun pretrain_gpt.py with megalite's
# defaults (mock data, its dropouts, no bucket, overlap or malloc flag, nothing in the
# environment) on a ~730M GPT: fp32 (bf16 matmuls are slow on this CPU, and fp32 parameters are
# their own masters: 16 bytes per parameter instead of 18), full recompute (~20 MB of activations
# instead of ~330 MB per rank). Each rank's peak RSS is that process's own (getrusage, as GNU
# time reports it), written when pretrain_gpt.py's main returns (`user-rank`).
WALL = ["--hidden-size", "1536", "--num-attention-heads", "16", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4",
        "--mock-data", "--vocab-size", "32000", "--eval-iters", "0", "--log-interval", "1",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
# The recipe before megalite set these itself (--malloc-env): glibc's mmap threshold at 256 KiB
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144"}
PEAKS_ENV = "BENCH_ZERO_PEAKS"


def user_rank(argv) -> None:
    """One rank of the plain command: pretrain_gpt.py's main in this process (as torchrun runs
    it), then this process's peak RSS appended to $BENCH_ZERO_PEAKS."""
    import runpy
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        with open(os.environ[PEAKS_ENV], "a") as f:
            f.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "max_rss_bytes": _max_rss_bytes()}) + "\n")
    sys.exit(code)


def run_user_command(nproc: int, flags: list[str], tmp: str, env=None, timeout: float = 3600) -> dict:
    """`torchrun --standalone --nproc_per_node nproc pretrain_gpt.py flags` (each rank through
    `user-rank`); returns {"peaks": [bytes by rank], "records": [...jsonl...], "wall_s"}."""
    jsonl, peaks = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "peaks.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), "user-rank", *flags, "--log-jsonl", jsonl]
    env = dict(os.environ, PYTHONPATH=ROOT, **{PEAKS_ENV: peaks}, **(env or {}))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    with open(peaks) as f:
        by_rank = {r["rank"]: r["max_rss_bytes"] for r in map(json.loads, f)}
    return {"peaks": [by_rank[r] for r in range(nproc)], "records": records, "wall_s": time.perf_counter() - start}


def _commit() -> str | None:
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def bench_memory_wall(strategy: str, iters: int, out_path: str, num_layers: int = 24, bucket_size: int | None = None,
                      overlap: str = "none", malloc_env: bool = False) -> None:
    """By default the plain command: what megalite picks itself (on gloo 4M-element buckets,
    glibc's mmap threshold) is what is measured. The options set by hand what the recipe before
    those defaults set (--bucket-size 4000000 --overlap grads --malloc-env)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan
    flags = ["--num-layers", str(num_layers)] + WALL + ["--train-iters", str(iters),
                                                        "--data-parallel-sharding-strategy", strategy]
    if bucket_size is not None:
        flags += ["--ddp-bucket-size", str(bucket_size)]
    if STRATEGIES[strategy].shards_optimizer:
        flags += {"both": OVERLAP, "grads": OVERLAP[:1], "none": []}[overlap]
    env = MALLOC_ENV if malloc_env else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = run_user_command(8, flags, tmp, env=env)
    # the plan of the buckets the run used (plan.py plans NCCL's 40M where none is given)
    p = plan.make_plan(flags + ["--world-size", "8", "--gpu-memory-gb", "3"]
                       + ([] if bucket_size is not None else ["--ddp-bucket-size", "4000000"]))
    peaks = out["peaks"]
    record = {"event": "memory_wall", "strategy": strategy, "world_size": 8, "commit": _commit(),
              "command": "torchrun --standalone --nproc_per_node 8 pretrain_gpt.py " + " ".join(flags), "env": env,
              "num_params": p["num_params_total"], "losses": losses(out["records"]),
              "step_s": [r["elapsed_ms"] / 1000 for r in out["records"] if "consumed_samples" in r],
              "wall_s": out["wall_s"], "peak_rss_bytes_by_rank": peaks, "max_peak_rss_gb": max(peaks) / 1e9,
              "sum_peak_rss_gib": sum(peaks) / GIB,
              "planned_gib_per_rank_by_strategy": {s: v["total"] for s, v in p["memory_gb_by_strategy"].items()}}
    with open(out_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record, indent=1))
    print("per-rank peak RSS GB:", [round(b / 1e9, 3) for b in peaks])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    if argv and argv[0] == "fsdp2-rank":
        return fsdp2_trial_rank()
    if argv and argv[0] == "user-rank":
        return user_rank(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["strategies", "alternatives", "fsdp2", "memory-wall"])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, help="iterations per run (default: 6; memory-wall: 3)")
    p.add_argument("--strategy", default="optim_grads_params", choices=list(STRATEGIES))
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "memory_wall.jsonl"),
                   help="memory-wall: append the JSON record here")
    p.add_argument("--num-layers", type=int, default=24, help="memory-wall: a smaller model to calibrate with")
    p.add_argument("--bucket-size", type=int, help="memory-wall: --ddp-bucket-size (default: not given)")
    p.add_argument("--overlap", choices=["both", "grads", "none"], default="none",
                   help="memory-wall: --overlap-grad-reduce and --overlap-param-gather, the first, or neither")
    p.add_argument("--malloc-env", action="store_true", help=f"memory-wall: with {MALLOC_ENV} in the environment")
    a = p.parse_args(argv)
    if a.what == "strategies":
        bench_strategies(a.dp, a.iters or 6)
    elif a.what == "alternatives":
        bench_alternatives(a.iters or 6)
    elif a.what == "fsdp2":
        bench_fsdp2()
    else:
        bench_memory_wall(a.strategy, a.iters or 3, a.output, a.num_layers, a.bucket_size, a.overlap, a.malloc_env)


if __name__ == "__main__":
    main()
