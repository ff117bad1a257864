"""Megatron-LM's own launch scripts run on megalite: the flag sets of
examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh (its
real-data and mock-data branches), as examples/megatron/run_cpu.sh passes them (only sizes shrunk;
the other differences follow Megatron-LM's validation or the device), train with TP=2 (the
commands run_cpu.sh passes to torchrun, on 2 ranks of the test pool; the Llama script with its FP8
flags, through torchao); the GPT-3 script as written is refused with Megatron-LM's own reason and
the Llama script is accepted as written; batch ramp-ups and step schedules resume exactly; the per-token loss
changes training when tokens are masked."""
import json
import math
import os
import shlex
import subprocess

import numpy as np
import pytest

from dist_helpers import ROOT, run_pretrain, train_losses
from tiny import mock, tiny
from megalite.arguments import ArgumentError, parse_args, validate_args

SCRIPT = os.path.join(ROOT, "examples", "megatron", "run_cpu.sh")
PY = os.environ.get("PYTHON_FOR_EXAMPLES") or __import__("sys").executable

# The two scripts' flags and values as Megatron-LM's main branch of 2026-08 writes them (paths as
# placeholders). The GPT-3 script's batch ramp-up is a --step-batch-size-schedule with --train-iters
# there; its value is a size (shrunk by run_cpu.sh), so a placeholder stands for it.
GPT3_175B = {
    "--num-layers": "96", "--hidden-size": "12288", "--num-attention-heads": "96", "--seq-length": "2048",
    "--max-position-embeddings": "2048", "--attention-backend": "auto", "--micro-batch-size": "1",
    "--global-batch-size": "1536", "--step-batch-size-schedule": "SCHEDULE", "--train-iters": "500000",
    "--weight-decay": "0.1", "--adam-beta1": "0.9", "--adam-beta2": "0.95", "--init-method-std": "0.006",
    "--clip-grad": "1.0", "--fp16": "", "--lr": "6.0e-5", "--lr-decay-style": "cosine", "--min-lr": "6.0e-6",
    "--lr-warmup-fraction": ".001", "--lr-decay-iters": "430000", "--tensor-model-parallel-size": "8",
    "--pipeline-model-parallel-size": "16", "--data-path": "DATA_text_document", "--vocab-file": "gpt2-vocab.json",
    "--merge-file": "gpt2-merges.txt", "--split": "949,50,1", "--log-interval": "100", "--save-interval": "10000",
    "--eval-interval": "1000", "--save": "ckpt", "--load": "ckpt", "--eval-iters": "10", "--tensorboard-dir": "tb",
}
LLAMA3_8B = {  # its real-data branch (DATA_ARG and TOKENIZER_ARG given), DTYPE=fp8
    "--use-mcore-models": "", "--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "14336",
    "--num-attention-heads": "32", "--group-query-attention": "", "--num-query-groups": "8", "--kv-channels": "128",
    "--seq-length": "8192", "--max-position-embeddings": "8192", "--position-embedding-type": "rope",
    "--rotary-base": "1000000", "--rotary-percent": "1.0", "--attention-dropout": "0.0", "--hidden-dropout": "0.0",
    "--swiglu": "", "--init-method-std": "0.0134", "--attention-backend": "fused", "--apply-layernorm-1p": "",
    "--untie-embeddings-and-output-weights": "", "--disable-bias-linear": "", "--micro-batch-size": "1",
    "--global-batch-size": "128", "--train-samples": "1953125000", "--lr-decay-samples": "1949218748",
    "--lr-warmup-samples": "3906252", "--lr": "0.00015", "--min-lr": "0.00001", "--decoupled-lr": "5.0e-4",
    "--decoupled-min-lr": "4.5e-5", "--lr-decay-style": "cosine", "--clip-grad": "1.0", "--weight-decay": "0.1",
    "--adam-beta1": "0.9", "--adam-beta2": "0.95", "--bf16": "", "--grad-reduce-in-bf16": "",
    "--cross-entropy-loss-fusion": "", "--calculate-per-token-loss": "", "--manual-gc": "",
    "--empty-unused-memory-level": "1", "--exit-duration-in-mins": "235", "--fp8-format": "hybrid",
    "--fp8-amax-history-len": "1024", "--fp8-amax-compute-algo": "max", "--fp8-param-gather": "",
    "--tensor-model-parallel-size": "1", "--context-parallel-size": "1", "--sequence-parallel": "",
    "--use-distributed-optimizer": "", "--overlap-grad-reduce": "", "--overlap-param-gather": "",
    "--data-path": "DATA_text_document", "--tokenizer-type": "HuggingFaceTokenizer", "--tokenizer-model": "tok",
    "--data-cache-path": "cache", "--split": "'99,1,0'", "--no-create-attention-mask-in-dataloader": "",
    "--no-mmap-bin-files": "", "--num-workers": "1", "--vocab-size": "128256", "--log-interval": "1",
    "--eval-iters": "32", "--eval-interval": "100", "--save-interval": "1000", "--log-throughput": "", "--profile": "",
    "--profile-step-start": "4", "--profile-step-end": "6", "--ckpt-format": "torch_dist",
    "--distributed-timeout-minutes": "60", "--save": "ckpt", "--load": "ckpt", "--tensorboard-dir": "tb",
}
# its mock-data branch (the script's default) replaces the data flags with these
LLAMA3_MOCK_DATA = {"--mock-data": "", "--tokenizer-type": "NullTokenizer", "--vocab-size": "128256",
                    "--data-cache-path": "cache", "--tiktoken-pattern": "v2", "--split": "'99,1,0'",
                    "--no-create-attention-mask-in-dataloader": "", "--no-mmap-bin-files": "", "--num-workers": "1"}
# what may differ: sizes (model, batch, iterations and the intervals counted in them), parallel sizes, paths
SIZES = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
         "--kv-channels", "--seq-length", "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
         "--step-batch-size-schedule", "--train-iters", "--lr-decay-iters", "--train-samples", "--lr-decay-samples",
         "--lr-warmup-samples", "--vocab-size",
         "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--log-interval", "--save-interval",
         "--eval-interval", "--eval-iters", "--profile-step-start", "--profile-step-end"}
PATHS = {"--data-path", "--vocab-file", "--merge-file", "--save", "--load", "--tensorboard-dir", "--tokenizer-model",
         "--data-cache-path"}
# Flags another branch is adding; run_cpu.sh passes them once pretrain_gpt.py knows them.
ELSEWHERE = {"--manual-gc", "--distributed-timeout-minutes"}


def known_flags():
    from megalite.arguments import build_parser
    return {f for f in ELSEWHERE if f in build_parser()._option_string_actions}


def flags_of(argv: list[str]) -> dict:
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = ""
        else:
            out[key] = (out[key] + " " + a).strip()
    return out


def commands(tmp_path) -> list[dict]:
    proc = subprocess.run(["bash", SCRIPT, str(tmp_path)], env=dict(os.environ, DRY_RUN="1", PYTHON=PY,
                          PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines() if "pretrain_gpt.py" in line]
    assert len(cmds) == 3 and all("--nproc_per_node" in c for c in cmds)
    return [flags_of(c[next(i for i, a in enumerate(c) if a.endswith("pretrain_gpt.py")) + 1:]) for c in cmds]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    """(work directory, the script's three commands there): one dry run for the tests below."""
    work = tmp_path_factory.mktemp("megatron")
    return work, commands(work)


def test_flag_sets_are_megatron_lms_with_sizes_shrunk(script):
    gpt3, llama, llama_mock = script[1]
    have = known_flags()
    # GPT-3 175B: --global-batch-size dropped (Megatron-LM refuses it beside the schedule), a tokenizer named
    assert set(gpt3) == set(GPT3_175B) - {"--global-batch-size"} | {"--tokenizer-type", "--log-jsonl"}
    assert gpt3["--tokenizer-type"] == "GPT2BPETokenizer" and gpt3["--tensor-model-parallel-size"] == "2"
    assert gpt3["--step-batch-size-schedule"] == "0:2 256:4 768:6"  # one argument, as Megatron-LM reads it
    # Llama-3 8B: its FP8 flags as written (through torchao), --ckpt-format torch_dist left out (run_cpu.sh
    # says why); the flags another branch adds when known
    assert set(llama) == (set(LLAMA3_8B) - {"--ckpt-format"} - (ELSEWHERE - have) | {"--log-jsonl"})
    assert llama["--tensor-model-parallel-size"] == "2"
    # its mock-data branch: the data flags of that branch instead
    data_flags = {"--data-path", "--tokenizer-type", "--tokenizer-model", "--data-cache-path", "--split",
                  "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "--vocab-size"}
    assert set(llama_mock) == set(llama) - data_flags | set(LLAMA3_MOCK_DATA)
    mock_branch = {**{f: v for f, v in LLAMA3_8B.items() if f not in data_flags}, **LLAMA3_MOCK_DATA}
    for ours, theirs in ((gpt3, GPT3_175B), (llama, LLAMA3_8B), (llama_mock, mock_branch)):
        for flag, value in ours.items():
            if flag in theirs and flag not in SIZES | PATHS and flag != "--attention-backend":
                assert value == theirs[flag], flag
    # the one device difference: SDPA's fused kernels need CUDA
    assert llama["--attention-backend"] in ("fused", "unfused")


def argv_of(flags: dict, **changes) -> list[str]:
    flags = {**flags, **changes}
    one = {"--step-batch-size-schedule"}  # one argument holding spaces
    return [t for f, v in flags.items() if v is not None for t in [f, *([v] if f in one else v.split())]]


@pytest.mark.parametrize("script,changes,world,pattern", [
    # as written, Megatron-LM itself stops: --global-batch-size beside the schedule (its tokenizer is
    # pretrain_gpt.py's default, GPT2BPETokenizer)
    (GPT3_175B, {"--step-batch-size-schedule": "0:16 100B:1536"}, 1024,
     "--global-batch-size cannot be combined with --step-batch-size-schedule"),
])
def test_scripts_as_written_are_refused_with_the_reason(script, changes, world, pattern):
    unknown = ELSEWHERE - known_flags()
    flags = {f: v for f, v in script.items() if f not in unknown}
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(argv_of(flags, **changes)), world, check_files=False)


def test_llama_script_is_accepted_as_written():
    """Nothing in the Llama-3 script is refused: its FP8 runs through torchao (delayed scaling,
    Megatron-LM's default recipe, with the script's history of 1024 and max), its
    --fp8-param-gather gets a notice (the gather carries 16-bit weights here), its --ckpt-format
    torch_dist writes Megatron-LM's checkpoints (docs/checkpoints.md)."""
    pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")
    flags = {f: v for f, v in LLAMA3_8B.items() if f not in ELSEWHERE - known_flags()}
    config = validate_args(parse_args(argv_of(flags)), 8, check_files=False)
    assert config.megatron.ckpt_format == "torch_dist"
    f = config.fp8
    assert (f.fp8_format, f.fp8_recipe, f.fp8_amax_history_len, f.fp8_amax_compute_algo) == \
        ("hybrid", "delayed", 1024, "max")
    assert any(n.startswith("--fp8-param-gather: ") for n in config.notices)


def test_llama_mock_branch_flags_that_do_nothing_get_a_notice():
    """The mock-data branch passes four flags that act on nothing there; Megatron-LM accepts and
    ignores them, so megalite does too, with a one-line notice each naming the flag and why."""
    drop = ELSEWHERE | {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
                        "--ckpt-format", "--data-path", "--tokenizer-model"}
    flags = {f: v for f, v in LLAMA3_8B.items() if f not in drop}
    config = validate_args(parse_args(argv_of({**flags, **LLAMA3_MOCK_DATA}, **{"--attention-backend": "auto"})), 8,
                           check_files=False)
    for flag, why in (("--tiktoken-pattern", "has no effect with --tokenizer-type NullTokenizer"),
                      ("--split", "has no effect with --mock-data"), ("--data-cache-path", "has no effect with --mock-data"),
                      ("--no-mmap-bin-files", "has no effect with --mock-data")):
        (notice,) = [n for n in config.notices if n.startswith(flag + " ")]
        assert why in notice and "Megatron-LM accepts and ignores it" in notice, notice


def records(path):
    with open(path) as f:
        rs = [json.loads(line) for line in f]
    return rs[0]["ranks"], [r for r in rs[1:] if "split" not in r], [r for r in rs[1:] if "split" in r]


def prepare_data(work) -> None:
    """The script's own data section (ONLY=none: no training command runs): the tokenizers and
    datasets the three commands read, under work/data."""
    env = dict(os.environ, PYTHON=PY, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", ONLY="none")
    proc = subprocess.run(["bash", SCRIPT, str(work)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert os.path.isfile(os.path.join(str(work), "data", "hf_text_document.idx"))


def run_command(flags: dict, nproc: int = 2) -> str:
    """One of the script's commands (as commands() reads it) trained on `nproc` ranks of the
    test pool: pretrain_gpt.main with the command's own argv, in the directory it writes its
    --log-jsonl to; its stdout."""
    log = flags["--log-jsonl"]
    argv = argv_of(flags, **{"--log-jsonl": None})
    os.makedirs(os.path.dirname(log), exist_ok=True)
    _, proc = run_pretrain(nproc, argv, os.path.dirname(log), os.path.basename(log)[:-len(".jsonl")])
    return proc.stdout


@pytest.mark.slow
def test_both_flag_sets_train_on_cpu_with_tp2(script):
    """The script's three commands as it prints them (DRY_RUN=1: torchrun --nproc_per_node 2,
    checked by commands()), each trained on 2 ranks of the test pool (pretrain_gpt.main with
    that argv: torchrun's own launching is tested by test_restart.py and test_straggler.py),
    on the data the script itself prepares."""
    tmp_path, cmds = script
    prepare_data(tmp_path)
    stdout = "".join(run_command(flags) for flags in cmds)

    # GPT-3 175B: the step schedule 0:2 256:4 768:6 in tokens of 64 (samples 0, 4, 12) over consumed
    # samples, 18 iterations (--train-iters), fp16 skipping while the scale falls
    ranks, train, evals = records(tmp_path / "gpt3" / "metrics.jsonl")
    batches = [2, 2, 4, 4] + [6] * 14
    assert [r["global_batch_size"] for r in train] == batches
    assert [r["consumed_samples"] for r in train] == list(np.cumsum(batches))
    stepped = [r for r in train if not r["skipped_iterations"]]
    assert 2 <= len(stepped) < len(train) and all(math.isfinite(r["lm_loss"]) for r in train)
    assert [r["lr"] for r in stepped][1:] == sorted([r["lr"] for r in stepped][1:], reverse=True)  # cosine
    assert {r["split"] for r in evals} == {"valid", "test"} and len(ranks) == 2
    assert os.path.isfile(tmp_path / "gpt3" / "checkpoints" / "iter_0000018" / "metadata.json")

    # Llama-3 8B: what each of its flags should leave behind
    ranks, train, evals = records(tmp_path / "llama" / "metrics.jsonl")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(r["global_batch_size"] == 8 for r in train)
    assert all(r["grad_bytes"] == 2 * r["num_params"] for r in ranks)  # --grad-reduce-in-bf16
    assert all(r["decoupled_lr"] > r["lr"] for r in train[1:])  # --decoupled-lr 5e-4 over --lr 1.5e-4
    assert train[1]["decoupled_lr"] == pytest.approx(5e-4)  # warmed up after 8 samples
    meta = json.load(open(tmp_path / "llama" / "checkpoints" / "iter_0000004" / "metadata.json"))
    config = meta["config"]  # the RunConfig record: the architecture and how it ran, by section
    assert (meta["model_config"]["apply_layernorm_1p"], config["kernels"]["cross_entropy_loss_fusion"],
            config["parallel"]["sequence_parallel"]) == (True, True, True)
    traces = [f for f in os.listdir(tmp_path / "llama" / "tensorboard") if f.endswith(".pt.trace.json")]
    assert len(traces) == 1 and traces[0].startswith("rank0.")  # --profile on rank 0 only, as Megatron-LM
    assert "throughput per GPU (TFLOP/s/GPU)" in stdout  # --log-throughput
    assert "--empty-unused-memory-level 1: a no-op on CPU" in stdout
    assert {r["split"] for r in evals} == {"valid"}  # --split '99,1,0': no test split
    assert "E4M3 forward, E5M2 gradients, delayed scaling (amax history 1024, max, margin 0)" in stdout  # FP8

    # Llama-3 8B's mock-data branch: trains on mock data; the flags that act on nothing there get a notice
    ranks, train, evals = records(tmp_path / "llama-mock" / "metrics.jsonl")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(math.isfinite(r["lm_loss"]) for r in train)
    assert os.path.isfile(tmp_path / "llama-mock" / "checkpoints" / "iter_0000004" / "metadata.json")
    for flag in ("--tiktoken-pattern", "--split", "--data-cache-path", "--no-mmap-bin-files"):
        assert f"> note: {flag} has no effect with" in stdout, flag


MOCK = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-style", "cosine",
        "--min-lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0.1"]


@pytest.mark.slow
def test_rampup_resume_is_exact(tmp_path):
    ramp = MOCK + ["--train-samples", "46", "--rampup-batch-size", "2", "2", "12", "--global-batch-size", "8",
                   "--lr-warmup-samples", "6"]  # batches 2 2 4 6 8 8 8 8: 46 samples
    straight, _ = run_pretrain(1, ramp, tmp_path, "straight")
    first, _ = run_pretrain(1, ramp + ["--save", str(tmp_path / "ck"), "--exit-interval", "3"], tmp_path, "first")
    second, _ = run_pretrain(1, ramp + ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck")], tmp_path,
                             "second")
    keys = ("iteration", "consumed_samples", "global_batch_size", "lm_loss", "lr", "grad_norm")
    rows = [tuple(r[k] for k in keys) for r in straight if "iteration" in r]
    assert [r[2] for r in rows] == [2, 2, 4, 6, 8, 8, 8, 8]
    resumed = [tuple(r[k] for k in keys) for r in first + second if "iteration" in r]
    assert resumed == rows


@pytest.mark.slow
def test_per_token_loss_changes_training_when_tokens_are_masked(tmp_path):
    from megalite.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "docs_text_document")
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(300):  # runs of one-token documents between long ones: micro-batches mask unequally
        b.add_document(np.append(rng.integers(0, 100, 40 if rng.random() < 0.3 else 1), 100))
    b.finalize(prefix + ".idx")
    flags = [f for f in MOCK if f not in ("--mock-data",)]
    flags[flags.index("--vocab-size") + 1] = "100"
    flags[flags.index("--micro-batch-size") + 1] = "1"
    flags[flags.index("--lr") + 1] = "20"
    # SGD: the update is the gradient itself (Adam's first step would be its sign, nearly the same)
    flags += ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--eod-mask-loss", "--train-iters", "3",
              "--global-batch-size", "4", "--split", "100,0,0", "--hidden-dropout", "0", "--optimizer", "sgd",
              "--sgd-momentum", "0", "--min-lr", "20", "--clip-grad", "0"]
    default, _ = run_pretrain(1, flags, tmp_path, "default")
    per_token, _ = run_pretrain(1, flags + ["--calculate-per-token-loss"], tmp_path, "per_token")
    a, b = train_losses(default), train_losses(per_token)
    assert a[0] == b[0]  # same weights, and the reported loss is the token mean either way
    # different gradients (micro-batch means vs the token mean), so different weights after the step
    assert abs(a[1] - b[1]) > 0.01 * abs(a[1] - a[0])


@pytest.mark.slow
def test_step_schedule_down_with_overlapped_reduction(tmp_path):
    """--overlap-grad-reduce starts a bucket after the iteration's last micro-batch: the count
    must follow the schedule (DataParallel.set_num_microbatches), here 4 then 2 micro-batches."""
    recs, _ = run_pretrain(1, MOCK + ["--step-batch-size-schedule", "0:8 128:4", "--train-samples", "20",
                                      "--overlap-grad-reduce", "--log-params-norm", "--log-memory-to-tensorboard",
                                      "--deterministic-mode"], tmp_path)
    train = [r for r in recs if "iteration" in r]
    assert [r["global_batch_size"] for r in train] == [8, 4, 4, 4]
    assert [r["consumed_samples"] for r in train] == [8, 12, 16, 20]
    norms = [r["params_norm"] for r in train]  # --log-params-norm: moves as the weights train
    assert all(n > 0 for n in norms) and len(set(norms)) == 4 and all(r["max_rss_bytes"] > 0 for r in train)


def megatron_step_batch(consumed, schedule):
    """Megatron-LM's step schedule: the batch of the last threshold (in samples) at or below the
    samples consumed."""
    return [b for t, b in schedule if t <= consumed][-1]


def megatron_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps):
    """Megatron-LM's OptimizerParamScheduler.get_lr, cosine, with the steps in samples: iteration-based
    runs count lr_warmup_iters x global_batch_size and lr_decay_iters x global_batch_size samples."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * num_steps / warmup_steps
    if num_steps > decay_steps:
        return min_lr
    ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def test_step_schedule_with_train_iters_follows_megatron_and_resumes_exactly(tmp_path):
    """--step-batch-size-schedule with --train-iters, as Megatron-LM runs it today: --train-iters
    iterations, each with the batch of the samples consumed so far; the learning-rate flags in
    iterations of the final batch (8); a run stopped mid-schedule resumes to the same records."""
    sched = MOCK + ["--step-batch-size-schedule", "0:2 64:4 160:8", "--train-iters", "8", "--lr-warmup-iters", "1",
                    "--lr-decay-iters", "6"]  # thresholds in tokens: samples 0, 4, 10 (seq 16)
    straight, _ = run_pretrain(1, sched, tmp_path, "straight")
    rows = [r for r in straight if "iteration" in r]
    schedule, consumed, expect = [(0, 2), (4, 4), (10, 8)], 0, []
    for _ in range(8):
        batch = megatron_step_batch(consumed, schedule)
        expect.append((batch, consumed + batch, megatron_lr(consumed, 1e-3, 1e-4, 1 * 8, 6 * 8)))
        consumed += batch
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in rows] == [e[:2] for e in expect]
    assert [r["global_batch_size"] for r in rows] == [2, 2, 4, 4, 8, 8, 8, 8]
    assert [r["lr"] for r in rows] == pytest.approx([e[2] for e in expect], rel=1e-12)
    # stopped at iteration 3 (inside the batch-4 step), resumed
    first, _ = run_pretrain(1, sched + ["--save", str(tmp_path / "ck"), "--exit-interval", "3"], tmp_path, "first")
    second, _ = run_pretrain(1, sched + ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck")], tmp_path,
                             "second")
    keys = ("iteration", "consumed_samples", "global_batch_size", "lm_loss", "lr", "grad_norm")
    resumed = [tuple(r[k] for k in keys) for r in first + second if "iteration" in r]
    assert resumed == [tuple(r[k] for k in keys) for r in rows]


def test_log_num_zeros_in_grad_counts_each_element_once_on_every_layout(tmp_path):
    """--log-num-zeros-in-grad: the zeros of the reduced gradients, each element once. The padded
    vocabulary rows (1024 - 1000, masked out of the loss) have exactly zero gradients, so the count
    is at least 24 x 64; TP 2, and ZeRO-2 over DP 2 (each rank counting its slices), give the one
    process's count iteration by iteration, within the rounding of a few elements."""
    flags = mock(1000) + tiny(train_iters=3, log_interval=1, eval_iters=0, hidden_dropout=0, attention_dropout=0) + [
        "--log-num-zeros-in-grad"]
    counts = {}
    for name, nproc, extra in (("one", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
                               ("zero2-dp2", 2, ["--data-parallel-sharding-strategy", "optim_grads"])):
        recs, proc = run_pretrain(nproc, flags + extra, tmp_path, name)
        counts[name] = [r["num_zeros_in_grad"] for r in recs if "iteration" in r]
        assert "num zeros:" in proc.stdout
    assert len(counts["one"]) == 3 and all(c >= 24 * 64 for c in counts["one"]), counts
    # the same count (an element or two may round to an exact zero under one summation order and
    # not another; counting a shard twice would add hundreds)
    for name in ("tp2", "zero2-dp2"):
        assert all(abs(a - b) <= 4 for a, b in zip(counts[name], counts["one"])), counts
    recs, _ = run_pretrain(1, flags[:-1], tmp_path, "off")
    assert not any("num_zeros_in_grad" in r for r in recs)  # only with the flag
