"""The planner, the dry run and the FLOPs count know the 2026 attention (issue 44): a Qwen3-Next-
shaped hybrid's and a DSA model's parameters per pipeline stage are the built model's, the dry run
(the model on the meta device, its saved activations measured) agrees with the plan's bytes, and
MFU's FLOPs count a DeltaNet layer's and DSA's own work; under CP 2 the dry run agrees too, the DeltaNet
keeps half per rank and DSA stays linear in the sequence; a DSA model with an MTP module (its layer MLA +
DSA) on PP 2 agrees too. Cost: ~11 s alone (the CP checks ~4 s of it, DSA + MTP ~1 s)."""
import importlib.util
import os

import pytest

from dist_helpers import ROOT
from plan_helpers import built_stage_params

spec = importlib.util.spec_from_file_location("plan_tool_a2026", os.path.join(ROOT, "tools", "plan.py"))
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)

COMMON = ["--vocab-size", "1000", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--position-embedding-type", "rope", "--swiglu",
          "--disable-bias-linear", "--normalization", "RMSNorm", "--hidden-dropout", "0", "--attention-dropout", "0"]
QWEN3_NEXT = COMMON + ["--num-layers", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
                       "--qk-layernorm", "--attention-output-gate", "--experimental-attention-variant",
                       "gated_delta_net", "--linear-attention-freq", "2", "--linear-key-head-dim", "16",
                       "--linear-value-head-dim", "16", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                       "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
# the dry run's model: DeltaNet layers only, dense, so that the comparison is theirs (the planner's
# softmax and MoE terms are tested in test_plan / test_moe; at this tiny width they are 20% low)
QWEN3_NEXT_DENSE = [a if a != "2" or i != QWEN3_NEXT.index("--linear-attention-freq") + 1 else "[1,1,1,1]"
                    for i, a in enumerate(QWEN3_NEXT[:QWEN3_NEXT.index("--num-experts")])] + ["--ffn-hidden-size", "128"]
DSA = COMMON + ["--num-layers", "2", "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32",
                "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm",
                "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim",
                "16", "--dsa-indexer-topk", "16", "--dsa-indexer-loss-coeff", "0.01"]


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_next_mtp", "dsa"])
@pytest.mark.parametrize("pp", [1, 2])
def test_plan_counts_the_built_model(model, pp):
    from megalite.planning.memory import stage_params, total_params
    # with MTP after a DeltaNet last layer: the MTP layer is gated softmax attention with the MoE MLP
    mtp = [a if a != "2" or i != QWEN3_NEXT.index("--linear-attention-freq") + 1 else "[1,0,1,1]"
           for i, a in enumerate(QWEN3_NEXT)] + ["--mtp-num-layers", "1"]
    argv = {"qwen3_next": QWEN3_NEXT, "qwen3_next_mtp": mtp, "dsa": DSA}[model]
    c, _ = plan.parse(argv + ["--pipeline-model-parallel-size", str(pp), "--world-size", str(pp)])
    built, once = built_stage_params(c)
    assert [stage_params(c, r) for r in range(pp)] == built
    assert total_params(c) == once


@pytest.mark.parametrize("model,world,flags", [
    ("qwen3_next", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("qwen3_next", 1, ["--recompute-activations"]),
    ("qwen3_next", 1, ["--bf16"]),
    ("dsa", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("qwen3_next", 2, ["--context-parallel-size", "2"]),
    ("dsa", 2, ["--context-parallel-size", "2"]),
    ("dsa", 2, ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1"]),
], ids=["deltanet-tp2-sp", "deltanet-selective", "deltanet-bf16", "dsa-tp2-sp", "deltanet-cp2", "dsa-cp2", "dsa-mtp-pp2"])
def test_plan_matches_the_dry_run(model, world, flags):
    """Parameter, gradient and optimizer bytes exactly; activations within 10%."""
    argv = {"qwen3_next": QWEN3_NEXT_DENSE, "dsa": DSA}[model] + flags + ["--world-size", str(world)]
    config, _ = plan.parse(argv)
    for row in plan.verify(config, plan.report.make_plan(config, 80.0)):
        got, want = row["measured"], row["planned"]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert got[key] == want[key], (row["rank"], key)
        assert abs(got["activation_bytes"] - want["activation_bytes"]) <= 0.1 * want["activation_bytes"], row


def test_flops_count_the_variants_own_work():
    from megalite.runtime.metrics import dsa_indexer_flops, gated_delta_net_flops, num_floating_point_operations
    hybrid, _ = plan.parse(QWEN3_NEXT + ["--world-size", "1"])
    m = hybrid.model
    b = 8
    # two DeltaNet layers replace two softmax layers: the difference is theirs
    import dataclasses
    plain = dataclasses.replace(m, experimental_attention_variant=None, attention_output_gate=False)
    s, h, a, d = m.seq_length, m.hidden_size, m.num_attention_heads, m.kv_channels
    softmax_layer = 12.0 * b * s * h * h * (1 + m.num_query_groups / a + s / h) * (a * d / h)
    gate = 6.0 * b * s * h * a * d
    want = num_floating_point_operations(plain, b) - 2 * softmax_layer + 2 * gated_delta_net_flops(m, b) + 2 * gate
    assert num_floating_point_operations(m, b) == pytest.approx(want, rel=1e-12)
    dsa, _ = plan.parse(DSA + ["--world-size", "1"])
    dense = dataclasses.replace(dsa.model, experimental_attention_variant=None)
    # s = 128 keys against top-16: the attention's share shrinks to 16 keys a query, the indexer's is added
    keys = 6.0 * b * s * dsa.model.num_layers * dsa.model.num_attention_heads * (16 + 8 + 16)
    want = num_floating_point_operations(dense, b) - keys * (s - 16) + dsa.model.num_layers * dsa_indexer_flops(dsa.model, b)
    assert num_floating_point_operations(dsa.model, b) == pytest.approx(want, rel=1e-12)
    assert dsa_indexer_flops(dsa.model, b) > 0


def _dry_run_activations(argv, world):
    config, _ = plan.parse(argv + ["--world-size", str(world)])
    return plan.verify(config, plan.report.make_plan(config, 80.0))[0]["measured"]["activation_bytes"]


def test_context_parallel_divides_the_variants_memory():
    """Under CP 2 a DeltaNet layer (head-parallel: the whole sequence of half the heads) keeps half of
    one process's activations per rank, and DSA's stay linear in the sequence (the dry run; an
    [s/c, s] tensor kept would grow 16x from 128 to 512 tokens). Cost: ~8 s."""
    cp2 = ["--context-parallel-size", "2"]
    one, split = _dry_run_activations(QWEN3_NEXT_DENSE, 1), _dry_run_activations(QWEN3_NEXT_DENSE + cp2, 2)
    assert abs(split / one - 0.5) < 0.01, (one, split)
    longer = [a if a != "128" else "512" for a in DSA]
    short, long = _dry_run_activations(DSA + cp2, 2), _dry_run_activations(longer + cp2, 2)
    assert abs(long / short - 4.0) < 0.04, (short, long)
