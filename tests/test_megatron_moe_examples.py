"""Megatron-LM's MoE launch scripts run on megalite: examples/gptoss/02_train.sh's flag set, as
examples/gptoss/gpt_oss_cpu.sh passes it (only sizes and paths changed; --use-flash-attn, CUDA-only,
dropped; its FP8 through torchao), trains on 2 CPU ranks (PP 2, as the script sets PP to the world size); its
kernel-only choices get one notice each; the script as written is refused with the reason.
"""
import importlib.util
import math
import os
import shlex
import subprocess

import pytest

from dist_helpers import ROOT, run_pretrain, train_losses
from test_megatron_examples import PATHS, PY, SIZES, argv_of, flags_of
from megalite.arguments import ArgumentError, parse_args, validate_args

SCRIPT = os.path.join(ROOT, "examples", "gptoss", "gpt_oss_cpu.sh")

# examples/gptoss/02_train.sh as Megatron-LM's main branch of 2026-08 writes it (paths as placeholders):
# its mock-data branch (the default), then what its real-data branch passes instead
GPT_OSS_02 = {
    "--no-masked-softmax-fusion": "", "--transformer-impl": "transformer_engine", "--disable-bias-linear": "",
    "--untie-embeddings-and-output-weights": "", "--no-rope-fusion": "", "--normalization": "RMSNorm",
    "--num-layers": "12", "--hidden-size": "512", "--ffn-hidden-size": "2048", "--num-attention-heads": "64",
    "--group-query-attention": "", "--num-query-groups": "8", "--seq-length": "8192",
    "--max-position-embeddings": "8192", "--use-mcore-models": "", "--rotary-percent": "1.0", "--rope-type": "rope",
    "--position-embedding-type": "rope", "--rotary-base": "10000", "--no-bias-gelu-fusion": "",
    "--export-force-local-attention": "", "--no-bias-dropout-fusion": "", "--quick-geglu": "",
    "--glu-linear-offset": "1.0", "--softmax-type": "learnable", "--window-attn-skip-freq": "2",
    "--activation-func-clamp-value": "7.0", "--window-size": "128,0", "--enable-gpt-oss": "",
    "--num-experts": "4", "--moe-router-topk": "2", "--moe-router-load-balancing-type": "aux_loss",
    "--moe-aux-loss-coeff": "1e-3", "--moe-grouped-gemm": "", "--moe-token-dispatcher-type": "alltoall",
    "--overlap-param-gather": "", "--overlap-grad-reduce": "", "--moe-ffn-hidden-size": "2048",
    "--moe-router-dtype": "fp32", "--moe-z-loss-coeff": "1e-3", "--moe-permute-fusion": "",
    "--mock-data": "", "--tokenizer-type": "NullTokenizer", "--vocab-size": "128256", "--data-cache-path": "cache",
    "--tiktoken-pattern": "v2", "--split": "'99,1,0'", "--no-create-attention-mask-in-dataloader": "",
    "--no-mmap-bin-files": "", "--num-workers": "1",
    "--micro-batch-size": "1", "--global-batch-size": "128", "--lr": "1.0e-5", "--train-samples": "1953125000",
    "--lr-decay-samples": "1949218748", "--lr-decay-style": "cosine", "--min-lr": "1.0e-6", "--weight-decay": "0.1",
    "--lr-warmup-fraction": "0.05", "--clip-grad": "1.0", "--bf16": "", "--use-flash-attn": "",
    "--attention-softmax-in-fp32": "", "--accumulate-allreduce-grads-in-fp32": "",
    "--disable-bf16-reduced-precision-matmul": "", "--recompute-activations": "",
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "8", "--expert-model-parallel-size": "1",
    "--sequence-parallel": "", "--context-parallel-size": "1", "--use-distributed-optimizer": "",
    "--fp8-format": "hybrid", "--fp8-param-gather": "", "--fp8-amax-compute-algo": "max",
    "--fp8-amax-history-len": "1024",
    "--log-interval": "1", "--save-interval": "10000", "--eval-interval": "50000000", "--eval-iters": "0",
    "--save": "ckpt", "--tensorboard-dir": "ckpt/tensorboard", "--moe-per-layer-logging": "", "--no-load-optim": "",
    "--no-load-rng": "", "--log-throughput": "",
}
MOCK_ONLY = {"--mock-data", "--tiktoken-pattern"}
REAL_DATA = {"--data-path": "DATA", "--tokenizer-type": "HuggingFaceTokenizer", "--tokenizer-model": "tok"}
DEVICE_ONLY = {"--use-flash-attn"}
# sizes besides test_megatron_examples' (the window is a length in tokens, the experts' width a size)
MOE_SIZES = SIZES | {"--window-size", "--moe-ffn-hidden-size", "--expert-model-parallel-size"}
KERNEL_NOTICES = ("--transformer-impl transformer_engine: megalite's own layers run instead",
                  "--moe-permute-fusion: a Megatron-LM kernel choice", "--no-masked-softmax-fusion: a Megatron-LM",
                  "--no-bias-gelu-fusion: a Megatron-LM", "--no-bias-dropout-fusion: a Megatron-LM",
                  "--export-force-local-attention: a Megatron-LM")


def script_flags(tmp_path, *args) -> dict:
    proc = subprocess.run(["bash", SCRIPT, "--checkpoint-path", str(tmp_path / "ckpt"), *args],
                          env=dict(os.environ, DRY_RUN="1", PYTHON=PY), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = [shlex.split(line) for line in proc.stdout.splitlines() if "pretrain_gpt.py" in line]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    return flags_of(cmd[next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py")) + 1:])


def test_gpt_oss_flag_set_is_megatron_lms_with_sizes_shrunk(tmp_path):
    theirs_real = {**{f: v for f, v in GPT_OSS_02.items() if f not in MOCK_ONLY}, **REAL_DATA}
    for ours, theirs in ((script_flags(tmp_path), GPT_OSS_02),
                         (script_flags(tmp_path, "--tokenizer", "tok", "--data", "DATA"), theirs_real)):
        assert set(ours) == set(theirs) - DEVICE_ONLY
        for flag, value in ours.items():
            if flag not in MOE_SIZES | PATHS:
                assert value == theirs[flag], flag
        assert ours["--pipeline-model-parallel-size"] == "2"  # PP = the world size, as the script sets it
        config = validate_args(parse_args(argv_of(ours)), 2, check_files=False)
        for start in KERNEL_NOTICES:
            assert len([n for n in config.notices if n.startswith(start)]) == 1, start
        m = config.model
        assert (m.position_embedding_type, m.softmax_type, m.quick_geglu, m.attention_window(0),
                m.attention_window(1)) == ("yarn", "learnable", True, 16, None)


@pytest.mark.parametrize("changes,pattern", [
    # (on 4 GPUs: 12 layers do not split over the 8 stages of its 8-GPU default, in Megatron-LM either)
    ({"--pipeline-model-parallel-size": "4"},
     "--window-size needs an explicit mask over the window, which megalite does not pass to --use-flash-attn"),
])
def test_gpt_oss_script_as_written_is_refused_with_the_reason(changes, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(argv_of(GPT_OSS_02, **changes)), 4, check_files=False)


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    """A byte-level BPE (a Hugging Face tokenizer directory) and the corpus preprocessed with it:
    the real-data branch's --tokenizer and --data, made in this process."""
    out = tmp_path_factory.mktemp("gpt-oss-data")
    modules = {}
    for name, path in (("make_tiny_data", "examples/megatron/make_tiny_data.py"),
                       ("preprocess_data", "tools/preprocess_data.py")):
        spec = importlib.util.spec_from_file_location(f"megalite_{name}", os.path.join(ROOT, path))
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    assert modules["make_tiny_data"].main([str(out), "--documents", "300"]) in (0, None)
    modules["preprocess_data"].main(["--input", str(out / "corpus.jsonl"), "--output-prefix", str(out / "hf"),
                                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                     str(out / "hf_tokenizer"), "--append-eod"])
    return str(out / "hf_tokenizer"), str(out / "hf_text_document")


def test_gpt_oss_script_trains_on_two_cpu_ranks(hf_data, tmp_path):
    tokenizer, data = hf_data
    flags = script_flags(tmp_path, "--tokenizer", tokenizer, "--data", data)
    records, proc = run_pretrain(2, argv_of(flags), tmp_path, "gpt-oss")
    train = [r for r in records if "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(r["global_batch_size"] == 8 for r in train)
    losses = train_losses(records)
    assert all(math.isfinite(v) for v in losses) and losses[0] > 4.0  # ln 512 = 6.2 at the start
    assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in train)
    for start in KERNEL_NOTICES:
        assert f"> note: {start}" in proc.stdout, start
    assert "--enable-gpt-oss: --position-embedding-type rope becomes yarn" in proc.stdout
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000004" / "metadata.json")
    from dist_helpers import load_params
    params = load_params(str(tmp_path / "ckpt"))
    assert any(n.endswith("softmax_offset") for n in params)
    assert not any(n.endswith("router.bias") for n in params)  # the script's --disable-bias-linear
