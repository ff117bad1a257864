"""--fake-process-group --dry-run: one rank of a layout built and stepped on the meta device.

Against two references: a real CPU run's `memory_footprint` record (the same code on real
tensors: parameter, gradient and optimizer bytes equal exactly, rank by rank), and tools/plan.py's
arithmetic (exact for those three; activations within 10% without, with selective and with
full recompute, TP with and without SP, PP with ZeRO-1 in bf16, ZeRO-3, and Mixture-of-Experts
layouts with expert parallelism). The 175B example's flags run at their real world size (1,024 ranks,
rank 1,023) with the global batch cut to 2 micro-batches (benchmarks/bench_dry_run.py runs them
whole); an MoE model runs as rank 255 of 256 with EP 8.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dist_helpers import ROOT, run_pretrain
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.dry_run import dry_run
from tiny import mock, tiny


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool_under_test", os.path.join(ROOT, "tools", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "1000", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
SELECTIVE = ["--recompute-activations"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
LAYOUTS = {  # id: (world size, flags)
    "no-recompute": (1, []),
    "full-recompute": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
    "tp2": (2, SELECTIVE + ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, SELECTIVE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-dp2-zero1-bf16": (4, SELECTIVE + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                           "--bf16"]),
    "zero2-dp4": (4, SELECTIVE + ["--data-parallel-sharding-strategy", "optim_grads"]),
    "zero3-dp4": (4, SELECTIVE + ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    # dropout: the meta device keeps its masks in the activations' dtype, the plan counts 1 byte
    "dropout-0.1": (1, SELECTIVE + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]),
    # Mixture of Experts (balanced routing on the meta device, as the plan assumes): EP taken from
    # DP, without ZeRO (DataParallel does not yet shard expert weights over the expert-DP group)
    "moe-dp4-ep2-alltoall": (4, SELECTIVE + MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                                   "alltoall", "--moe-aux-loss-coeff", "1e-2"]),
    "moe-tp2-sp-dp2-ep2-bf16-shared": (4, SELECTIVE + MOE + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2", "--bf16",
        "--swiglu", "--moe-shared-expert-intermediate-size", "256", "--moe-shared-expert-gate", "--moe-z-loss-coeff",
        "1e-3"]),
    # --expert-tensor-parallel-size 1 under TP2: whole experts, each rank's own tokens dispatched
    "moe-tp2-sp-etp1-ep2-alltoall": (4, SELECTIVE + MOE + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--swiglu"]),
    # FP8 (through torchao, emulated on the meta device): its linears keep FP8 inputs for backward
    "fp8-tensorwise-bf16": (1, SELECTIVE + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    "fp8-tp2-sp-swiglu-delayed": (2, SELECTIVE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  "--swiglu", "--fp8-format", "hybrid"]),
    "moe-pp2-dp2-ep2-allgather-every-2nd": (4, SELECTIVE + MOE + [
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--moe-layer-freq", "2",
        "--moe-ffn-hidden-size", "512"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_verify_matches_the_dry_run(layout):
    world, flags = LAYOUTS[layout]
    tool = _plan_tool()
    config, _ = tool.parse(BASE + flags + ["--world-size", str(world)])
    plan = tool.report.make_plan(config, 80.0)
    rows = tool.verify(config, plan)
    assert [r["pp_rank"] for r in rows] == sorted({0, config.parallel.pipeline_model_parallel_size - 1})
    for row in rows:
        got, want = row["measured"], row["planned"]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert got[key] == want[key], (row["rank"], key)
        stage = plan["stages"][row["pp_rank"]]
        assert (got["num_params"], got["num_expert_params"]) == (stage["num_params"], stage["num_expert_params"])
        assert abs(got["activation_bytes"] - want["activation_bytes"]) <= 0.1 * want["activation_bytes"], row
        assert got["step_peak_bytes"] >= got["activation_bytes"] > 0
        # ZeRO-2/3's staging buckets and gathered units: none without them; with them at most the
        # plan's bound (it assumes a prefetched unit and 4 staging buckets in flight)
        plan_ws, ws = want["zero_working_set_bytes"], got["zero_working_set_bytes"]
        assert ws == 0 if plan_ws == 0 else 0 < ws <= plan_ws, row
    assert "measured" in tool.format_verify(rows)


def test_dry_run_bytes_equal_a_real_run(tmp_path):
    """Every rank of PP 2 x DP 2 under ZeRO-3: the dry run's bytes are the real run's."""
    flags = mock(1000) + tiny(train_iters=1, eval_iters=0) + ["--pipeline-model-parallel-size", "2",
                                                               "--data-parallel-sharding-strategy", "optim_grads_params"]
    records, _ = run_pretrain(4, flags, tmp_path)
    (footprint,) = [r for r in records if r.get("event") == "memory_footprint"]
    config = validate_args(parse_args(flags + ["--fake-process-group", "--dry-run"]), 4)
    for real in footprint["ranks"]:
        dry = dry_run(config, real["rank"])
        assert (dry.rank, dry.pp, dry.dp) == (real["rank"], real["pp"], real["dp"])
        for key in ("num_params", "param_bytes", "grad_bytes", "optimizer_bytes"):
            assert getattr(dry, key) == real[key], (real["rank"], key)


def test_175b_example_rank_1023_dry_runs_from_the_command_line(tmp_path):
    env = dict(os.environ, DRY_RUN="1", NNODES="128", MASTER_ADDR="node0")
    printed = subprocess.run(["bash", os.path.join(ROOT, "examples", "gpt3_175B.sh")], env=env, capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    flags = printed.split("pretrain_gpt.py ", 1)[1].split()
    jsonl = tmp_path / "dry.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1024", RANK="1023", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--global-batch-size", "16",
                           "--fake-process-group", "--dry-run", "--log-jsonl", str(jsonl)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "> note: --save is not used by --dry-run" in proc.stdout
    (record,) = [json.loads(line) for line in open(jsonl)]
    assert record["event"] == "memory_footprint" and record["dry_run"]
    (rank,) = record["ranks"]
    assert (rank["rank"], rank["tp"], rank["pp"], rank["dp"]) == (1023, 7, 15, 7)
    plan = _plan_tool().make_plan(flags + ["--global-batch-size", "16", "--world-size", "1024"])
    last = plan["stages"][-1]
    assert [rank[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")] == \
        [last[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
    assert not os.path.exists(tmp_path / "runs" / "gpt3_175B" / "checkpoints")  # --save: nothing written


def test_moe_rank_of_a_large_world_dry_runs_from_the_command_line(tmp_path):
    """A Mixtral-shaped MoE (8 experts, top-2, SwiGLU, RMSNorm, RoPE, GQA; shrunk) on 256 ranks:
    TP 2 x PP 2 x DP 64, EP 8 taken from DP (expert-DP 8), alltoall dispatch. Its last rank holds
    one expert per MoE layer and the bytes the plan says."""
    flags = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "8",
             "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "128", "--vocab-size", "1000",
             "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
             "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall", "--bf16",
             "--recompute-activations"]
    jsonl = tmp_path / "dry.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(WORLD_SIZE="256", RANK="255", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--mock-data",
                           "--train-iters", "1", "--lr", "1e-4", "--fake-process-group", "--dry-run", "--log-jsonl",
                           str(jsonl)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in open(jsonl)]
    (rank,) = record["ranks"]
    assert (rank["rank"], rank["tp"], rank["pp"], rank["dp"]) == (255, 1, 1, 63)
    plan = _plan_tool().make_plan(flags + ["--world-size", "256"])
    last = plan["stages"][-1]
    assert plan["moe"]["experts_per_gpu"] == 1 and plan["moe"]["expert_dp"] == 8
    assert (rank["num_params"], rank["num_expert_params"]) == (last["num_params"], last["num_expert_params"])
    assert [rank[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")] == \
        [last[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
    assert rank["activation_bytes"] > 0


@pytest.mark.parametrize("env,extra,message", [
    ({"WORLD_SIZE": "2"}, ["--dry-run"], "--dry-run with WORLD_SIZE 2 needs --fake-process-group"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, ["--dry-run", "--fake-process-group"], "RANK must be an integer in [0, 2)"),
    ({}, ["--dry-run", "--compile"], "--dry-run cannot --compile"),
])
def test_refused(monkeypatch, env, extra, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ArgumentError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_args(mock(100) + tiny() + extra), int(env.get("WORLD_SIZE", "1")))
