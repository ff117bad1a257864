"""Dry runs at full scale on one CPU: every launch script in examples/ at its real world size and
sizes, one rank per distinct pipeline-stage position (first, a middle one, last), plus a 70B
Llama-style model under ZeRO-3 over DP 256; each a `pretrain_gpt.py --fake-process-group
--dry-run` process (the rank built on the meta device and stepped once: every micro-batch of the
schedule and the optimizer step). Records wall time, peak RSS of the process, the rank's bytes,
and tools/plan.py's bytes for the same stage.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_dry_run.py [--only 175B] [--json out.json]

Results: benchmarks/RESULTS_dry_run.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

# script -> nodes of 8 GPUs, as each script's header gives its layout
SCRIPTS = {"125M": 1, "350M": 1, "760M": 1, "1.3B": 2, "2.7B": 4, "6.7B": 8, "13B": 16, "175B": 128}
# Llama 2 70B (Touvron et al. 2023, Table 1 / its config), ZeRO-3 over 256 data-parallel ranks
LLAMA_70B = ("--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention "
             "--num-query-groups 8 --ffn-hidden-size 28672 --swiglu --normalization RMSNorm "
             "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
             "--hidden-dropout 0 --attention-dropout 0 --seq-length 4096 --max-position-embeddings 4096 --mock-data --vocab-size 32000 --micro-batch-size 1 "
             "--global-batch-size 256 --train-iters 1000 --lr 1.5e-4 --bf16 --recompute-activations "
             "--data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce --overlap-param-gather"
             ).split()


def script_flags(name: str, nodes: int) -> list[str]:
    env = dict(os.environ, DRY_RUN="1", NNODES=str(nodes), MASTER_ADDR="node0")
    out = subprocess.run(["bash", os.path.join(ROOT, "examples", f"gpt3_{name}.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    return out.split("pretrain_gpt.py ", 1)[1].split()


def dry_run(flags: list[str], world: int, rank: int, workdir: str, name: str) -> dict:
    jsonl = os.path.join(workdir, f"{name}-{rank}.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(WORLD_SIZE=str(world), RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    start = time.perf_counter()
    with open(jsonl + ".out", "w") as out, open(jsonl + ".err", "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--fake-process-group",
                                 "--dry-run", "--log-jsonl", jsonl], cwd=workdir, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(open(jsonl + ".err").read()[-3000:])
    (record,) = [json.loads(line) for line in open(jsonl)]
    return {**record["ranks"][0], "wall_s": wall, "max_rss_kb": usage.ru_maxrss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="names of SCRIPTS and/or 70B")
    ap.add_argument("--json")
    a = ap.parse_args()
    import plan as plan_tool
    cases = [(name, script_flags(name, nodes), 8 * nodes) for name, nodes in SCRIPTS.items()]
    cases.append(("70B-zero3", LLAMA_70B, 256))
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, flags, world in cases:
            if a.only and name.removesuffix("-zero3") not in a.only:
                continue
            config, _ = plan_tool.parse(flags + ["--world-size", str(world)])
            plan = plan_tool.report.make_plan(config, 80.0)
            p = config.parallel
            stride = world // p.pipeline_model_parallel_size  # ranks of one stage (tp-cp-dp-pp order)
            stages = sorted({0, p.pipeline_model_parallel_size // 2, p.pipeline_model_parallel_size - 1})
            for stage in stages:
                rank = stage * stride + stride - 1  # the stage's last rank: TP, DP the highest
                r = dry_run(flags, world, rank, work, name)
                st = plan["stages"][stage]
                row = {"case": name, "world": world, **r,
                       "plan": {k: st[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")}}
                results.append(row)
                print(f"{name:10s} world {world:5d} rank {rank:5d} (pp {stage:2d}) {r['wall_s']:6.1f} s "
                      f"RSS {r['max_rss_kb'] / 2**20:.2f} GiB | params "
                      f"{r['param_bytes'] / 2**30:7.2f} GiB grads {r['grad_bytes'] / 2**30:7.2f} optimizer "
                      f"{r['optimizer_bytes'] / 2**30:7.2f} activations {r['activation_bytes'] / 2**30:7.2f} "
                      f"(plan {st['activation_bytes'] / 2**30:7.2f}) | plan exact: "
                      f"{all(r[k] == st[k] for k in ('param_bytes', 'grad_bytes', 'optimizer_bytes'))}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
