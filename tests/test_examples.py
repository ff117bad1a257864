"""The launch scripts in examples/: valid bash, GPT-3's sizes, layouts that validate and fit
(tools/plan.py), the multi-node and SLURM command lines, and real (shrunk) training runs; the
Mixture-of-Experts example (examples/moe/) planned and trained."""
import glob
import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from dist_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402

EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = sorted(glob.glob(os.path.join(EXAMPLES, "*.sh")) + glob.glob(os.path.join(EXAMPLES, "slurm", "*.sh"))
                 + glob.glob(os.path.join(EXAMPLES, "moe", "*.sh")))
MIXTRAL_CPU = os.path.join(EXAMPLES, "moe", "mixtral_8x_cpu.sh")

# Brown et al. 2020, Table 2.1: layers, d_model, heads, batch tokens, lr (13B: 5120, as Megatron-LM;
# XL: 16 heads of 128), and the nodes of 8 GPUs each script's comments recommend
GPT3 = {
    "125M": (12, 768, 12, 0.5e6, 6.0e-4, 1), "350M": (24, 1024, 16, 0.5e6, 3.0e-4, 1),
    "760M": (24, 1536, 16, 0.5e6, 2.5e-4, 1), "1.3B": (24, 2048, 16, 1e6, 2.0e-4, 2),
    "2.7B": (32, 2560, 32, 1e6, 1.6e-4, 4), "6.7B": (32, 4096, 32, 2e6, 1.2e-4, 8),
    "13B": (40, 5120, 40, 2e6, 1.0e-4, 16), "175B": (96, 12288, 96, 3.2e6, 0.6e-4, 128),
}
NOMINAL = {"125M": 125e6, "350M": 350e6, "760M": 760e6, "1.3B": 1.3e9, "2.7B": 2.7e9, "6.7B": 6.7e9, "13B": 13e9,
           "175B": 175e9}


def bash(script, env=None, args=(), timeout=60, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    full_env.update(env or {})
    return subprocess.run(["bash", script, *args], env=full_env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT)


def dry_run(script, env=None, args=()):
    proc = bash(script, dict(env or {}, DRY_RUN="1"), args)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]
    return lines, proc


def split_command(cmd):
    """(torchrun flags, pretrain_gpt.py flags)."""
    i = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    return cmd[:i], cmd[i + 1:]


def test_every_script_is_valid_bash():
    assert len(SCRIPTS) >= 12, SCRIPTS  # 8 sizes, tiny CPU, common.sh, slurm wrapper, MoE on CPU
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


@pytest.mark.parametrize("size", list(GPT3))
def test_size_script_layout_validates_and_fits(size):
    layers, hidden, heads, batch_tokens, lr, nodes = GPT3[size]
    env = {"NNODES": str(nodes), "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"} if nodes > 1 else {}
    ((cmd,), _) = dry_run(os.path.join(EXAMPLES, f"gpt3_{size}.sh"), env)
    launcher, flags = split_command(cmd)
    assert launcher[0] == "torchrun"
    if nodes > 1:
        assert launcher[1:] == ["--nproc_per_node", "8", "--nnodes", str(nodes), "--node_rank", "0",
                                "--master_addr", "10.0.0.1", "--master_port", "6000"]
    else:
        assert launcher[1:] == ["--standalone", "--nproc_per_node", "8"]
    p = plan.make_plan(flags + ["--world-size", str(8 * nodes)])  # validates as pretrain_gpt.py would
    m = p["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"]) == (layers, hidden, heads)
    assert p["layout"]["seq_length"] == 2048 and p["layout"]["precision"] == "bf16"
    assert p["layout"]["distributed_optimizer"] and p["layout"]["recompute"] == "selective"
    assert p["layout"]["sequence_parallel"] == (p["layout"]["tp"] > 1)
    assert abs(p["tokens_per_iteration"] / batch_tokens - 1) < 0.05
    assert float(flags[flags.index("--lr") + 1]) == pytest.approx(lr)
    assert float(flags[flags.index("--min-lr") + 1]) == pytest.approx(lr / 10)
    assert abs(p["num_params_total"] / NOMINAL[size] - 1) < 0.03, p["num_params_total"]
    # 300B tokens; warmup 375M tokens, decay over 260B
    iters = int(flags[flags.index("--train-iters") + 1])
    assert abs(iters * p["tokens_per_iteration"] / 300e9 - 1) < 0.01
    assert p["fits"], (size, p["memory_gb"])


def test_environment_overrides_and_passthrough():
    ((cmd,), proc) = dry_run(os.path.join(EXAMPLES, "gpt3_350M.sh"),
                             {"NUM_LAYERS": "6", "TP": "2", "PRECISION": "fp32", "RECOMPUTE": "full",
                              "RECOMPUTE_NUM_LAYERS": "2", "DATA_PATH": "0.3 /d/a 0.7 /d/b", "VOCAB_FILE": "/v.json",
                              "MERGE_FILE": "/m.txt", "WANDB_PROJECT": "proj", "TENSORBOARD_DIR": ""},
                             args=["--eval-iters", "0"])
    _, flags = split_command(cmd)
    text = " ".join(flags)
    assert "--num-layers 6 " in text and "--tensor-model-parallel-size 2 " in text and "--sequence-parallel" in text
    assert "--bf16" not in flags and "--recompute-activations" not in flags
    assert "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2" in text
    assert "--data-path 0.3 /d/a 0.7 /d/b --split 969,30,1 --tokenizer-type GPT2BPETokenizer" in text
    assert "--wandb-project proj --wandb-exp-name gpt3_350M" in text and "--tensorboard-dir" not in flags
    assert "--save runs/gpt3_350M/checkpoints --load runs/gpt3_350M/checkpoints --save-interval 1000" in text
    assert flags[-2:] == ["--eval-iters", "0"]
    assert "mock data" not in proc.stderr


def test_multi_node_needs_master_addr():
    proc = bash(os.path.join(EXAMPLES, "gpt3_13B.sh"), {"NNODES": "2", "DRY_RUN": "1"})
    assert proc.returncode == 2 and "needs MASTER_ADDR" in proc.stderr


def test_slurm_wrapper_starts_one_torchrun_per_node(tmp_path):
    """Fake srun (two nodes, SLURM_NODEID 0 and 1) and scontrol: each node's command line."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do [[ "$1" == *=* ]] || shift; shift; done\n'
                               'for n in 0 1; do SLURM_NODEID=$n "$@" || exit 1; done\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": ROOT}
    lines, _ = dry_run(os.path.join(EXAMPLES, "slurm", "sbatch.sh"), env, args=["examples/gpt3_1.3B.sh", "--seed", "7"])
    assert len(lines) == 2
    for node, cmd in enumerate(lines):
        launcher, flags = split_command(cmd)
        assert launcher[1:] == ["--nproc_per_node", "8", "--nnodes", "2", "--node_rank", str(node),
                                "--master_addr", "gpu-a", "--master_port", str(20000 + 4242)]
        assert flags[-2:] == ["--seed", "7"]
        assert "runs/gpt3_1.3B-4242/metrics.jsonl" in flags


def train_records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if "consumed_samples" in r], records


CPU_ENV = {"OMP_NUM_THREADS": "1", "TORCHRUN": f"{sys.executable} -m torch.distributed.run", "PYTHON": sys.executable}


def checkout_files() -> set:
    """(path, size, mtime) of every file of the checkout but git's, the venv's and Python's caches."""
    found = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "__pycache__", ".pytest_cache")]
        for name in files:
            st = os.stat(os.path.join(top, name))
            found.add((os.path.relpath(os.path.join(top, name), ROOT), st.st_size, st.st_mtime_ns))
    return found


def test_output_dir_moves_every_output_of_the_cpu_scripts(tmp_path):
    """OUTPUT_DIR: the log and the bundled data's build under it (the data in OUTPUT_DIR/data), as
    `make demo OUTPUT_DIR=...` does; unset, the checkout's data/build and runs/<script>."""
    out = str(tmp_path / "out")
    for script in (os.path.join(EXAMPLES, "train_tiny_cpu.sh"), MIXTRAL_CPU):
        name = os.path.basename(script)[:-3]
        ((cmd,), _) = dry_run(script, {"OUTPUT_DIR": out})
        flags = split_command(cmd)[1]
        assert flags[flags.index("--data-path") + 1] == f"{out}/data/corpus_text_document", script
        assert flags[flags.index("--tokenizer-model") + 1] == f"{out}/data/tokenizer.model", script
        assert flags[flags.index("--log-jsonl") + 1] == f"{out}/metrics.jsonl", script
        ((cmd,), _) = dry_run(script)
        flags = split_command(cmd)[1]
        assert flags[flags.index("--data-path") + 1] == f"{ROOT}/data/build/corpus_text_document", script
        assert flags[flags.index("--log-jsonl") + 1] == f"runs/{name}/metrics.jsonl", script
    assert not os.path.exists(out)  # a dry run builds nothing
    proc = subprocess.run(["make", "-n", "demo", f"OUTPUT_DIR={out}", f"STAMP={__file__}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert f"DATA_BUILD_DIR='{out}/data'" in text and f"--data-path '{out}/data/corpus_text_document'" in text
    assert f"--tokenizer-model '{out}/data/tokenizer.model'" in text and f"--log-jsonl '{out}/metrics.jsonl'" in text
    assert "data/build" not in text and "runs/" not in text


@pytest.mark.slow
def test_tiny_cpu_script_trains(tmp_path):
    """... and with OUTPUT_DIR, from the checkout's root, writes there only (the data built in
    OUTPUT_DIR/data) and nothing into the checkout."""
    before = checkout_files()
    env = dict(CPU_ENV, TRAIN_ITERS="3", LOG_INTERVAL="1", EVAL_ITERS="1", OUTPUT_DIR=str(tmp_path))
    proc = bash(os.path.join(EXAMPLES, "train_tiny_cpu.sh"), env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert checkout_files() == before
    assert os.path.isfile(tmp_path / "data" / "corpus_text_document.idx")
    train, records = train_records(tmp_path)
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) and 0 < r["lm_loss"] < 10 for r in train)
    assert len(records[0]["ranks"]) == 2  # two gloo processes
    assert [r["split"] for r in records if "split" in r] == ["valid"]  # split 98,2,0: no test set


@pytest.mark.slow
def test_shrunk_125m_script_trains(tmp_path):
    """The 125M script as shipped (bf16, ZeRO-1, selective recompute, sequence parallel with TP 2),
    shrunk through the environment to 2 layers of 64 on 2 gloo processes."""
    from megalite.arguments import build_parser
    have = build_parser()._option_string_actions
    env = dict(CPU_ENV, NUM_LAYERS="2", HIDDEN_SIZE="64", NUM_ATTENTION_HEADS="4", SEQ_LENGTH="64",
               MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4", TRAIN_ITERS="3", LOG_INTERVAL="1", EVAL_ITERS="1",
               GPUS_PER_NODE="2", TP="2", VOCAB_SIZE="1000", DISTRIBUTED_BACKEND="gloo", NUM_WORKERS="0",
               OUTPUT_DIR=str(tmp_path), TENSORBOARD_DIR="", CHECKPOINT_PATH="",
               # flags another feature adds: used when the trainer has them
               USE_DISTRIBUTED_OPTIMIZER="1" if "--use-distributed-optimizer" in have else "0",
               OVERLAP_COMM="1" if "--overlap-param-gather" in have else "0",
               SEQUENCE_PARALLEL="auto" if "--sequence-parallel" in have else "0",
               RECOMPUTE="selective" if "--recompute-activations" in have else "none")
    proc = bash(os.path.join(EXAMPLES, "gpt3_125M.sh"), env, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    train, records = train_records(tmp_path)
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in train)
    assert abs(train[0]["lm_loss"] - math.log(1000)) < 0.5  # mock data: about uniform at the start
    assert [(r["tp"], r["dp"]) for r in records[0]["ranks"]] == [(0, 0), (1, 0)]
    assert "bfloat16" in proc.stdout


def test_moe_script_layout():
    """The Mixtral-style example: 8 experts, top-2, on 4 processes with EP 2 taken from DP 4; its
    flags validate as pretrain_gpt.py's and plan to the placement docs/moe.md describes."""
    ((cmd,), _) = dry_run(MIXTRAL_CPU)
    launcher, flags = split_command(cmd)
    assert launcher[-2:] == ["--nproc_per_node", "4"]
    text = " ".join(flags)
    for flag in ("--num-experts 8", "--moe-router-topk 2", "--expert-model-parallel-size 2", "--swiglu",
                 "--normalization RMSNorm", "--position-embedding-type rope", "--moe-token-dispatcher-type alltoall"):
        assert flag in text, flag
    p = plan.make_plan(flags + ["--world-size", "4"])
    moe = p["moe"]
    assert (moe["num_experts"], moe["topk"], moe["ep"], moe["expert_dp"], moe["experts_per_gpu"]) == (8, 2, 2, 2, 4)
    assert p["num_params_active"] < p["num_params_total"]
    ((cmd,), _) = dry_run(MIXTRAL_CPU, {"EP": "4", "DISPATCHER": "allgather"})
    p = plan.make_plan(split_command(cmd)[1] + ["--world-size", "4"])
    assert (p["moe"]["ep"], p["moe"]["experts_per_gpu"], p["moe"]["dispatcher"]) == (4, 2, "allgather")


@pytest.mark.slow
@pytest.mark.parametrize("ep", ["2"])  # EP 1 is the layouts tests' reference
def test_moe_cpu_script_trains(tmp_path, ep):
    """Three iterations on the bundled corpus, 4 gloo processes, EP 2 (expert-DP 2)."""
    env = dict(CPU_ENV, EP=ep, TRAIN_ITERS="3", LOG_INTERVAL="1", EVAL_ITERS="1", OUTPUT_DIR=str(tmp_path))
    proc = bash(MIXTRAL_CPU, env, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    train, records = train_records(tmp_path)
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in train)
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] < math.log(1536) + 1  # SentencePiece vocabulary of 1536
    assert len(records[0]["ranks"]) == 4
