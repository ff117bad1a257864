"""The example scripts of the 2026 attention (issue 44) print commands that validate as the models
they name: Qwen3-Next (MoE hybrid, TP 2 + SP), Qwen3.5 (dense), Qwen3.5-MoE and DeepSeek-V3.2
(DSA on DeepSeek-V3's model, EP 2). Cost: ~8 s (DRY_RUN=1 each; the models train in
tests/test_layouts_attention_2026.py)."""
import os
import shlex
import subprocess
import sys

import pytest

from dist_helpers import ROOT
from megalite.arguments import parse_args, validate_args


def _flags(script):
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    env.update(DRY_RUN="1", OMP_NUM_THREADS="1", PYTHON=sys.executable, TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", script)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.strip())
    flags = cmd[next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py")) + 1:]
    return validate_args(parse_args(flags), world_size=2, check_files=False).model


@pytest.mark.parametrize("script,experts", [("qwen3_next/qwen3_next_cpu.sh", 8), ("qwen3_next/qwen3_5_cpu.sh", None),
                                           ("qwen3_next/qwen3_5_moe_cpu.sh", 8)])
def test_gated_delta_net_scripts_validate(script, experts):
    m = _flags(script)
    assert m.gated_delta_net and m.attention_output_gate and m.apply_layernorm_1p and m.qk_layernorm
    assert [m.is_linear_attention_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert m.num_experts == experts
    if experts:
        assert all(m.is_moe_layer(i) for i in range(8)) and m.moe_shared_expert_gate


def test_deepseek_v32_script_validates():
    m = _flags("deepseek_v32/deepseek_v32_cpu.sh")
    assert m.dsa and m.multi_latent_attention and m.q_lora_rank == 48 and m.mtp_num_layers == 1
    assert (m.dsa_indexer_n_heads, m.dsa_indexer_head_dim, m.dsa_indexer_topk, m.dsa_indexer_loss_coeff) == \
        (4, 16, 32, 0.01)
    assert m.moe_router_score_function == "sigmoid" and m.num_experts == 8
