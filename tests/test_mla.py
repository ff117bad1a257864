"""Multi-latent attention (--multi-latent-attention, model/mla.py; DeepSeek-V2/V3).

- its flags: Megatron-LM's defaults, each refusal one line naming the flag;
- tools/plan.py's parameter count equals the built model's;
- a tiny MLA model (query compression, YaRN, QK-norm) trains the same on TP2 (heads split,
  down-projections replicated) with and without SP, CP2 with selective recompute, TP2+SP x CP2 (the
  latent gathered over CP; ~12 s), PP2 with full recompute and ZeRO-3 as on one process: loss, gradient norm and eval loss per iteration within
  1e-5, and the final weights (replicated ones from TP rank 0: a TP rank whose gradient differed
  would show);
- the plan and the dry run count MLA; examples/deepseek_v3/deepseek_v3_cpu.sh validates and trains.
(Transformers' DeepseekV3 logits and MLA's latent KV cache: tests/test_hf_deepseek.py.)
"""
import pytest
import torch

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.model import GPTModel
from tiny import mock, tiny

MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm"]


def test_mla_flags_and_megatron_defaults():
    c = validate_args(parse_args(tiny() + mock() + MLA))
    m = c.model
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (None, 32, 128, 64, 128)
    assert m.mla_yarn and m.rope_type is None  # Megatron-LM's MLA default: yarn (plain RoPE at factor 1)
    c = validate_args(parse_args(tiny() + mock() + MLA + ["--rope-type", "yarn", "--rotary-scaling-factor", "4",
                                                          "--yarn-original-max-position-embeddings", "16",
                                                          "--mscale-all-dim", "1", "--q-lora-rank", "8"]))
    model = GPTModel(type(c.model)(**dict(c.model.to_dict(), vocab_size=64, padded_vocab_size=64)))
    attention = model.decoder.layers[0].self_attention
    assert type(attention).__name__ == "MLASelfAttention" and attention.linear_q_up_proj.weight.shape == (4 * 192, 8)
    assert model.rotary.dim == 64 and attention.query_scale == pytest.approx((0.1 * torch.tensor(4.0).log().item() + 1) ** 2)


def test_megatron_lms_mla_defaults():
    """Megatron-LM's: MLA beside its default learned absolute positions (both), YaRN's original
    context 4096 (MLATransformerConfig's) where no flag gives it."""
    c = validate_args(parse_args(tiny() + mock() + ["--multi-latent-attention", "--rotary-scaling-factor", "4"]))
    assert c.model.position_embedding_type == "learned_absolute" and c.model.yarn()["original_max_position_embeddings"] \
        == 4096
    assert any("learned absolute positions are added" in n for n in c.notices)
    model = GPTModel(type(c.model)(**dict(c.model.to_dict(), vocab_size=64, padded_vocab_size=64)))
    assert model.embedding.position_embeddings is not None and model.rotary is not None


@pytest.mark.parametrize("extra,message", [
    (["--q-lora-rank", "8"], "--q-lora-rank sets multi-latent attention's shape; it needs --multi-latent-attention"),
    (["--kv-lora-rank", "8"], "--kv-lora-rank sets multi-latent attention's shape"),
    (["--v-head-dim", "8"], "--v-head-dim sets multi-latent attention's shape"),
    (["--rope-type", "yarn"], "for YaRN on this model use --position-embedding-type yarn"),
    (["--multi-latent-attention", "--position-embedding-type", "yarn"], "--multi-latent-attention takes its YaRN "
                                                                        "from --rope-type yarn"),
    (MLA + ["--tensor-model-parallel-size", "3", "--num-attention-heads", "4"],
     "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"),
    (MLA + ["--group-query-attention", "--num-query-groups", "2"], "--group-query-attention cannot be combined "
                                                                   "with --multi-latent-attention"),
    (MLA + ["--window-size", "8,0"], "--window-size cannot be combined with --multi-latent-attention"),
    (MLA + ["--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim (7) must be even"),
    (MLA + ["--use-rope-scaling"], "--use-rope-scaling cannot be combined with --multi-latent-attention"),
    (MLA + ["--rope-type", "rope", "--mscale", "0.5"], "--mscale sets YaRN, which needs --rope-type yarn with "
                                                      "--multi-latent-attention (got --rope-type rope)"),
])
def test_mla_bad_input_refused_with_one_line(extra, message):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(tiny() + mock() + extra), world_size=3 if "3" in extra else None)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- every layout computes the same function -------------------------------------------------------------
# as tests/test_attention_variants.py: fp32, dropout 0, clipping active each step; query compression,
# YaRN whose original context (16) is a quarter of the sequence (global positions under CP), QK-norm
MLA_MODEL = tiny(num_layers=2, seq_length=64, lr=3e-3, train_iters=6, log_interval=1, eval_interval=3,
                 eval_iters=1) + MLA + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25", "--adam-eps", "1e-4",
    "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
    "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "16", "--mscale", "0.9",
    "--mscale-all-dim", "1.0"]
MLA_LAYOUTS = {  # TP 2 without SP too: the down-projections' gradients complete without the SP all-reduce
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-selective-recompute": (2, ["--context-parallel-size", "2", "--recompute-activations"]),
    # CP gathers the latent, which SP slices over TP: the up-projection's rows come TP slice by slice
    "tp2-sp-cp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]),
    "pp2-full-recompute": (2, ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "zero3": (2, ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy", "optim_grads_params"]),
}


@pytest.fixture(scope="module")
def mla_reference(corpus, tmp_path_factory):
    from dist_helpers import assert_loss_falls, grad_norms, load_params, run_pretrain, train_losses
    tmp = tmp_path_factory.mktemp("mla")
    records, _ = run_pretrain(1, corpus + MLA_MODEL + ["--save", str(tmp / "ckpt")], tmp, "reference")
    assert_loss_falls(train_losses(records), 0.3)
    assert min(grad_norms(records)) > 0.25  # clipping acts on every iteration
    params = load_params(str(tmp / "ckpt"))
    assert any("linear_q_down_proj" in n for n in params) and any("kv_layernorm" in n for n in params)
    return records, params


@pytest.mark.parametrize("layout", list(MLA_LAYOUTS))
def test_mla_layout_matches_single_process(mla_reference, corpus, tmp_path, layout):
    from dist_helpers import (assert_losses_close, assert_params_close, eval_losses, grad_norms, load_params,
                              run_pretrain, train_losses)
    ref_records, ref_params = mla_reference
    nproc, flags = MLA_LAYOUTS[layout]
    records, _ = run_pretrain(nproc, corpus + MLA_MODEL + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    assert_losses_close(train_losses(ref_records), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-5)
    assert_losses_close(eval_losses(ref_records), eval_losses(records), rtol=1e-5)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)


# -- tools/plan.py --------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [["--q-lora-rank", "24", "--qk-layernorm", "--normalization", "LayerNorm"],
                                     ["--qk-layernorm", "--softmax-type", "learnable", "--disable-bias-linear"]],
                         ids=["q-lora-layernorm", "no-q-lora-sinks"])
@pytest.mark.parametrize("pp", [1, 2])
def test_plan_counts_mla_parameters_of_the_built_model(options, pp):
    import os
    import sys

    from dist_helpers import ROOT
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan
    from plan_helpers import built_stage_params
    from megalite.planning.memory import layer_activation_bytes, stage_params, total_params
    argv = ["--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--multi-latent-attention", "--position-embedding-type",
            "rope", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim",
            "12", *options, "--pipeline-model-parallel-size", str(pp), "--world-size", str(pp)]
    c, _ = plan.parse(argv)
    built, once = built_stage_params(c)
    assert [stage_params(c, r) for r in range(pp)] == built
    assert total_params(c) == once
    # MLA's activations are its own: the latent and head sizes change them
    wider, _ = plan.parse([a if a != "12" else "48" for a in argv])
    assert layer_activation_bytes(wider)[0] > layer_activation_bytes(c)[0]


@pytest.mark.parametrize("world,flags", [
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, ["--context-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"]),
], ids=["tp2-sp", "cp2-zero3"])
def test_plan_matches_the_mla_dry_run(world, flags):
    """The dry run builds MLA on the meta device; its parameter bytes are the plan's, its
    activations within 10% of it."""
    import importlib.util
    import os

    from dist_helpers import ROOT
    spec = importlib.util.spec_from_file_location("plan_tool_mla", os.path.join(ROOT, "tools", "plan.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "1000", "--hidden-dropout", "0",
            "--attention-dropout", "0", *MLA, "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32",
            "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm", "--swiglu", "--disable-bias-linear",
            "--recompute-activations", *flags, "--world-size", str(world)]
    config, _ = tool.parse(argv)
    plan = tool.report.make_plan(config, 80.0)
    for row in tool.verify(config, plan):
        got, want = row["measured"], row["planned"]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert got[key] == want[key], (row["rank"], key)
        assert abs(got["activation_bytes"] - want["activation_bytes"]) <= 0.1 * want["activation_bytes"], row


# -- examples/deepseek_v3/deepseek_v3_cpu.sh -----------------------------------------------------------
def _deepseek_script(env, timeout=60, cwd=None):
    import os
    import subprocess

    from dist_helpers import ROOT
    import sys
    full = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    full.update(OMP_NUM_THREADS="1", TORCHRUN=f"{sys.executable} -m torch.distributed.run", PYTHON=sys.executable)
    return subprocess.run(["bash", os.path.join(ROOT, "examples", "deepseek_v3", "deepseek_v3_cpu.sh")],
                          env=dict(full, **env), capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)


def test_deepseek_v3_script_flags_validate():
    """DRY_RUN=1 prints the command; its flags are a DeepSeek-V3-shaped model that validates."""
    import shlex
    proc = _deepseek_script({"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.strip())
    flags = cmd[next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py")) + 1:]
    c = validate_args(parse_args(flags), world_size=2, check_files=False)
    m = c.model
    assert m.multi_latent_attention and m.q_lora_rank == 48 and m.qk_layernorm
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk) == (4, 1, 2)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert c.parallel.expert_model_parallel_size == 2 and m.moe_shared_expert_intermediate_size == 32
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor) == (1, 0.3)  # DeepSeek-V3's MTP depth and weight
    proc = _deepseek_script({"DRY_RUN": "1", "MTP_NUM_LAYERS": ""})
    assert proc.returncode == 0 and "--mtp" not in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.launches
def test_deepseek_v3_script_trains(corpus, tmp_path):
    """The script's command line (DRY_RUN=1), three iterations on the bundled corpus's text on 2
    ranks of the test pool (EP 2; the script's torchrun launch is the other example scripts' too):
    finite losses, the MTP loss logged beside the LM loss."""
    import math
    import shlex

    from dist_helpers import run_pretrain
    data, tokenizer = corpus[corpus.index("--data-path") + 1], corpus[corpus.index("--tokenizer-model") + 1]
    proc = _deepseek_script(dict(DRY_RUN="1", DATA_PATH=data, TOKENIZER_MODEL=tokenizer, TRAIN_ITERS="3",
                                 LOG_INTERVAL="1", EVAL_ITERS="1", OUTPUT_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.strip())
    flags = cmd[next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py")) + 1:]
    records, _ = run_pretrain(2, flags, tmp_path)
    train = [r for r in records if "lm_loss" in r and "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) and math.isfinite(r["mtp_1_loss"]) for r in train)


def test_mla_flops_count_its_weights():
    """The model FLOPs (MFU's) of an MLA model: 6 per weight per token for its projections, as the
    built model's attention weights, plus the scores and the weighted values."""
    from megalite.config.model import GPTConfig
    from megalite.runtime.metrics import mla_weights_per_token, num_floating_point_operations
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                padded_vocab_size=64, position_embedding_type="rope", multi_latent_attention=True, kv_lora_rank=10,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, add_bias_linear=False)
    for q_lora_rank in (None, 12):
        c = GPTConfig(**base, q_lora_rank=q_lora_rank)
        attention = GPTModel(c).decoder.layers[0].self_attention
        weights = sum(p.numel() for n, p in attention.named_parameters() if p.ndim == 2)
        assert mla_weights_per_token(c) == weights
        wider = GPTConfig(**dict(base, v_head_dim=7), q_lora_rank=q_lora_rank)
        B, s, L, a = 3, 16, 2, 4
        extra = 6 * B * s * L * ((7 - 6) * a * 32 + (7 - 6) * a * 10 + s * a * 1)  # proj, kv up, values
        assert num_floating_point_operations(wider, B) - num_floating_point_operations(c, B) == pytest.approx(extra)
