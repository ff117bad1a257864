"""examples/qwen3/: the Qwen3 and Qwen3-MoE launch scripts carry their families' flags (QK-norm,
GQA with a head size of its own, SwiGLU, RMSNorm eps 1e-6, RoPE base 1e6, no biases, untied; top-k
routing renormalised over the chosen experts, aux loss 1e-3, no shared expert), validate and plan
as pretrain_gpt.py's, and train: each script's command line (a few iterations on the bundled
corpus's text) runs on 2 ranks (TP2 + SP; EP2) and its loss falls."""
import math
import os
import subprocess
import sys

import pytest

from dist_helpers import ROOT, run_pretrain, train_losses

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402
from test_examples import dry_run, split_command  # noqa: E402

QWEN3 = os.path.join(ROOT, "examples", "qwen3", "qwen3_cpu.sh")
QWEN3_MOE = os.path.join(ROOT, "examples", "qwen3", "qwen3_moe_cpu.sh")
ATTENTION = ("--qk-layernorm", "--group-query-attention", "--num-query-groups 2", "--kv-channels 32",
             "--position-embedding-type rope", "--rotary-base 1000000", "--normalization RMSNorm",
             "--norm-epsilon 1e-6", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights")
MOE = ("--num-experts 8", "--moe-router-topk 2", "--moe-ffn-hidden-size 24", "--moe-aux-loss-coeff 1e-3",
       "--moe-router-load-balancing-type aux_loss", "--moe-router-dtype fp32", "--expert-model-parallel-size 2")


def command(script, env=None):
    ((cmd,), _) = dry_run(script, env)
    return split_command(cmd)


@pytest.mark.parametrize("script,expected", [(QWEN3, ATTENTION), (QWEN3_MOE, ATTENTION + MOE)],
                         ids=["qwen3", "qwen3-moe"])
def test_scripts_carry_the_family_flags_and_plan(script, expected):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    launcher, flags = command(script)
    assert launcher[-2:] == ["--nproc_per_node", "2"]
    text = " ".join(flags)
    for flag in expected:
        assert flag in text, flag
    assert "--moe-router-pre-softmax" not in text and "--moe-shared-expert-intermediate-size" not in text
    p = plan.make_plan(flags + ["--world-size", "2"])  # validates as pretrain_gpt.py would
    if script == QWEN3:
        assert p["layout"]["tp"] == 2 and p["layout"]["sequence_parallel"]
    else:
        assert (p["moe"]["num_experts"], p["moe"]["topk"], p["moe"]["ep"]) == (8, 2, 2)
    # norm_topk_prob: false in a Qwen3-MoE config is --moe-router-pre-softmax
    assert "--moe-router-pre-softmax" in command(QWEN3_MOE, {"NORM_TOPK_PROB": "0"})[1]


@pytest.mark.parametrize("script", [QWEN3, QWEN3_MOE], ids=["qwen3", "qwen3-moe"])
def test_script_command_trains(corpus, tmp_path, script):
    data, tokenizer = corpus[corpus.index("--data-path") + 1], corpus[corpus.index("--tokenizer-model") + 1]
    env = {"DATA_PATH": data, "TOKENIZER_MODEL": tokenizer, "TRAIN_ITERS": "4", "LOG_INTERVAL": "1",
           "EVAL_ITERS": "0", "SEQ_LENGTH": "64", "MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8",
           "OUTPUT_DIR": str(tmp_path)}
    _, flags = command(script, env)
    records, proc = run_pretrain(2, flags, tmp_path)
    losses = train_losses(records)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
