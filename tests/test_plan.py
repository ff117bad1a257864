"""tools/plan.py: exact parameter counts, Megatron's bytes per parameter, Korthikanti et al.'s
activation formula, the pipeline bubble; and its numbers against real runs' memory_footprint.
Mixture of Experts: expert parameters per rank against the model megalite builds, ZeRO over the
expert-DP group, FLOPs of the active parameters and the dispatch traffic, by hand."""
import dataclasses
import json
import math
import os
import sys

import pytest

from dist_helpers import ROOT, run_pretrain

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402

from megalite.planning.memory import stage_params, total_params  # noqa: E402

SMALL = ["--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2"]
# every option that changes the parameter set
VARIANT = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96"]
GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--micro-batch-size", "1", "--global-batch-size", "1536", "--bf16", "--tensor-model-parallel-size", "8",
             "--pipeline-model-parallel-size", "16", "--sequence-parallel", "--recompute-activations",
             "--use-distributed-optimizer", "--world-size", "1024"]


# -- exact parameter counts against the model megalite builds ---------------------------------------
@pytest.mark.parametrize("options", [[], VARIANT, ["--untie-embeddings-and-output-weights"],
                                     ["--make-vocab-size-divisible-by", "7"], VARIANT + ["--add-qkv-bias"],
                                     ["--qk-layernorm"], VARIANT + ["--qk-layernorm", "--softmax-type", "learnable"]],
                         ids=["gpt2", "variant", "untied", "odd-padding", "qkv-bias", "qk-layernorm",
                              "qk-rmsnorm-sinks"])
@pytest.mark.parametrize("pp,vpp_layers", [(1, None), (2, None), (2, 1)], ids=["pp1", "pp2", "pp2-vpp"])
def test_stage_params_match_built_model(options, pp, vpp_layers):
    from plan_helpers import built_stage_params
    argv = SMALL + options + ["--pipeline-model-parallel-size", str(pp), "--world-size", str(pp)]
    if vpp_layers:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers), "--global-batch-size", "4"]
    c, _ = plan.parse(argv)
    built, once = built_stage_params(c)
    assert [stage_params(c, r) for r in range(pp)] == built
    # the whole model, once: the last stage's copy of a tied embedding is not counted
    copy = 0 if pp == 1 or c.model.untie_embeddings_and_output_weights else c.model.padded_vocab_size * c.model.hidden_size
    assert total_params(c) == sum(built) - copy == once


# -- against the memory_footprint record of real runs ----------------------------------------------
RUN = ["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"]
CASES = {  # fp32 is covered by pp2-tied
    "tp2-bf16": (2, ["--tensor-model-parallel-size", "2", "--bf16"] + VARIANT),
    "pp2-tied": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]),
    "zero1-dp2-bf16": (2, ["--use-distributed-optimizer", "--bf16"]),
    # Mixture of Experts, every expert on every rank (EP 1): 4 experts of 48 in every layer
    "moe-dp2-zero1-bf16": (2, ["--swiglu", "--bf16", "--num-experts", "4", "--moe-router-topk", "2",
                               "--disable-bias-linear", "--moe-ffn-hidden-size", "48", "--use-distributed-optimizer"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_memory_footprint_of_a_run(case, tmp_path):
    nproc, options = CASES[case]
    records, _ = run_pretrain(nproc, SMALL + RUN + options, tmp_path)
    (footprint,) = [r for r in records if r.get("event") == "memory_footprint"]
    assert len(footprint["ranks"]) == nproc
    p = plan.make_plan(SMALL + options + ["--world-size", str(nproc)])
    zero1 = "--use-distributed-optimizer" in options
    for rank in footprint["ranks"]:
        stage = p["stages"][rank["pp"]]
        assert rank["num_params"] == stage["num_params"], (case, rank)
        assert rank["num_expert_params"] == stage["num_expert_params"], (case, rank)
        assert rank["param_bytes"] == stage["param_bytes"], (case, rank)
        if not zero1:
            assert rank["grad_bytes"] == stage["grad_bytes"], (case, rank)
            assert rank["optimizer_bytes"] == stage["optimizer_bytes"], (case, rank)
        else:  # buckets are padded to a multiple of DP: a few elements more than the plan's 4 and 12/DP
            dp = p["layout"]["dp"]
            assert 0 <= rank["grad_bytes"] - stage["grad_bytes"] < 4 * dp * 8, (case, rank)
            assert abs(rank["optimizer_bytes"] - stage["optimizer_bytes"]) < 12 * dp * 8, (case, rank)
            assert rank["optimizer_bytes"] < 0.6 * stage["optimizer_bytes_without_zero1"]
    if nproc > 1 and "--pipeline-model-parallel-size" not in options:
        # the total is independent of TP (vocab padding is the same here), and equals one process's count
        one = plan.make_plan(SMALL + [o for o in options if o != "--use-distributed-optimizer"]
                             + ["--tensor-model-parallel-size", "1"])
        assert p["num_params_total"] == one["num_params_total"]


# -- formulas -------------------------------------------------------------------------------------
def bubble(p, m, v=1):
    """Idle fraction of a (interleaved) 1F1B iteration: p - 1 slots of t/v out of m·t + (p-1)·t/v
    (Narayanan et al. 2021, Sec. 2.2), t the time of one micro-batch on one stage."""
    return (p - 1) / v / (m + (p - 1) / v)


def test_bubble_fraction():
    base = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--world-size", "4"]
    m = 16 // 2  # global batch / micro-batch (DP 1)
    assert plan.make_plan(base + ["--global-batch-size", "16"])["bubble_fraction"] == pytest.approx(bubble(4, m))
    inter = plan.make_plan(base + ["--global-batch-size", "16", "--num-layers-per-virtual-pipeline-stage", "1"])
    assert inter["layout"]["vpp"] == 8 // (4 * 1)
    assert inter["bubble_fraction"] == pytest.approx(bubble(4, m, v=2))
    assert plan.make_plan(SMALL)["bubble_fraction"] == 0.0


def test_zero_bubble_bubble_and_held_micro_batches():
    """zb_h1 and zbv: the bubble of their order on unit costs (ZB-H1's (p-1)(F+B-W) / (3m + p - 1),
    a third of 1F1B's), the micro-batches each rank holds between F and W (ZB-H1: 1F1B's p - r
    between F and B, and up to r + 1 more waiting for W: p + 1), and zbv's loss on rank 0."""
    base = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--world-size", "2",
                    "--global-batch-size", "8", "--untie-embeddings-and-output-weights"]  # m = 4
    f1b = plan.make_plan(base)
    h1 = plan.make_plan(base + ["--pipeline-schedule", "zb_h1"])
    zbv = plan.make_plan(base + ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "2"])
    assert f1b["bubble_fraction"] == pytest.approx(bubble(2, 4))  # 1/5
    assert h1["bubble_fraction"] == pytest.approx(1 / 13) and h1["pipeline_schedule"] == "zb_h1"
    assert zbv["bubble_fraction"] < h1["bubble_fraction"]
    assert [st["in_flight_micro_batches"] for st in f1b["stages"]] == [2, 1]
    assert [st["in_flight_micro_batches"] for st in h1["stages"]] == [3, 3]
    # zbv: rank 0 holds the embedding and the output layer (untied: vocab x h more parameters there)
    assert zbv["stages"][0]["num_params"] > zbv["stages"][1]["num_params"]
    assert zbv["stages"][0]["activation_bytes"] > zbv["stages"][1]["activation_bytes"]


def test_activation_formula_korthikanti_table2():
    s, b, h, a, L, t = 2048, 1, 4096, 32, 4, 8
    model = ["--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(a), "--seq-length", str(s),
             "--micro-batch-size", str(b), "--bf16", "--vocab-size", "1024", "--make-vocab-size-divisible-by", "1"]

    def layer_bytes(*extra, tp=t):
        """Per-layer bytes: the one stage's activations less the embedding's output and, as the
        stage is also the last, the output layer's (its [s, b, h] input and the final norm's, and
        one [s, b, V/tp] logits-sized tensor, all in bf16)."""
        p = plan.make_plan(model + ["--tensor-model-parallel-size", str(tp), "--world-size", str(tp), *extra])
        emb = s * b * h / (tp if "--sequence-parallel" in extra else 1)
        output = 4 * s * b * h / tp * (1 + 1024 / (2 * h))
        return (p["stages"][0]["activation_bytes"] - output - emb) / L

    sbh = s * b * h
    assert layer_bytes(tp=1) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_bytes() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_bytes("--sequence-parallel") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_bytes("--recompute-activations") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_bytes("--sequence-parallel", "--recompute-activations") == pytest.approx(sbh * 34 / t)
    # full recompute, every layer: only each layer's input (2sbh/t with SP) per micro-batch, plus
    # one layer rebuilt at a time during backward
    full = layer_bytes("--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1")
    assert full == pytest.approx(2 * sbh / t + sbh / t * (34 + 5 * a * s / h) / L)


def test_first_stage_holds_p_micro_batches():
    base = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--world-size", "4", "--bf16"]
    p = 4

    def one_f_one_b(m):
        """Megatron-LM's 1F1B schedule: stage r runs p - r - 1 warm-up forwards and one more
        before its first backward, or all m forwards when there are fewer."""
        return [min(p - r, m) for r in range(p)]

    for m in (16, 2):  # steady state, and fewer micro-batches than stages
        got = plan.make_plan(base + ["--global-batch-size", str(2 * m)])["stages"]
        assert [st["in_flight_micro_batches"] for st in got] == one_f_one_b(m)
    # interleaved, v = 2 chunks of half a stage: Megatron-LM's warm-up of (p - r - 1)·2 + (v - 1)·p
    # chunk forwards, plus one, each holding 1/v of a stage micro-batch's activations
    inter = plan.make_plan(base + ["--global-batch-size", "32", "--num-layers-per-virtual-pipeline-stage", "1"])
    v = 2
    assert inter["stages"][0]["in_flight_micro_batches"] == pytest.approx(((p - 1) * 2 + (v - 1) * p + 1) / v)


def test_bytes_per_parameter_and_zero1():
    base = SMALL + ["--world-size", "4"]
    fp32 = plan.make_plan(base)["stages"][0]
    n = fp32["num_params"]
    assert (fp32["param_bytes"], fp32["grad_bytes"], fp32["optimizer_bytes"]) == (4 * n, 4 * n, 8 * n)
    bf16 = plan.make_plan(base + ["--bf16"])["stages"][0]
    assert (bf16["param_bytes"], bf16["grad_bytes"], bf16["optimizer_bytes"]) == (2 * n, 4 * n, 12 * n)
    zero = plan.make_plan(base + ["--bf16", "--use-distributed-optimizer"])
    assert zero["stages"][0]["optimizer_bytes"] == 12 * n / 4
    assert zero["memory_gb_optimizer_without_zero1"] == pytest.approx(12 * n / 2**30)
    mem = zero["memory_gb"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"])


def test_gpt3_175b_layout(capsys):
    assert plan.main(GPT3_175B + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    for key in ("num_params_total", "num_params_per_gpu", "bubble_fraction", "flops_per_iteration"):
        assert key in p
    assert set(p["memory_gb"]) == {"params", "grads", "optimizer", "working_set", "activations", "total"}
    # counted from the architecture: per layer QKV (3h² + 3h), projection (h² + h), MLP (8h² + 5h),
    # two LayerNorms (4h); the vocabulary padded to a multiple of 128 x TP; learned positions
    L, h, s, t, pp, dp, B = 96, 12288, 2048, 8, 16, 1024 // (8 * 16), 1536
    V = -(-50257 // (128 * t)) * 128 * t
    assert p["num_params_total"] == L * (12 * h * h + 13 * h) + V * h + s * h + 2 * h
    # the first stage: L / pp layers sharded over TP (LayerNorms and row-parallel biases
    # replicated), the vocabulary-parallel embedding and the positions
    layer_shard = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // t + h + h + 4 * h
    assert p["stages"][0]["num_params"] == (L // pp) * layer_shard + V * h // t + s * h
    assert p["num_params_per_gpu"] == p["stages"][0]["num_params"]
    assert p["bubble_fraction"] == pytest.approx(bubble(pp, B // dp))
    # FLOPs, forward + backward = 3 x forward: 2 per multiply-add of every matmul weight (12h² per
    # layer and the V x h output layer) per token, plus QKᵀ and attention x V (2 x 2·s·h per layer)
    tokens = B * s
    assert p["flops_per_iteration"] == pytest.approx(3 * tokens * (2 * (L * 12 * h * h + V * h) + 4 * s * h * L))
    assert p["fits"] and p["memory_gb"]["total"] < 80
    text_rc = plan.main(GPT3_175B)
    assert text_rc == 0 and "pipeline bubble" in capsys.readouterr().out
    # the same model on one node does not fit, and says so in its exit status
    one_node = [a if a not in ("1024", "16") else {"1024": "8", "16": "1"}[a] for a in GPT3_175B]
    assert plan.main(one_node) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_layout_is_a_clear_error(capsys):
    assert plan.main(SMALL + ["--tensor-model-parallel-size", "3", "--world-size", "3"]) == 2
    assert "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)" in capsys.readouterr().err


def test_accepts_every_pretrain_gpt_flag_as_pretrain_gpt_does():
    """A launch script's flags can be handed to plan.py unchanged: every pretrain_gpt.py flag
    parses to the same destination, type, choices and default, and plan.py adds only its own."""
    from megalite.arguments import build_parser
    real = build_parser()._option_string_actions
    ours = plan.build_plan_parser()._option_string_actions
    assert set(ours) - set(real) == {"--world-size", "--gpu-memory-gb", "--json", "--verify"}
    for flag, action in real.items():
        mine = ours.get(flag)
        assert mine is not None, f"plan.py does not accept {flag}"
        assert (mine.dest, mine.nargs, mine.type, mine.choices, mine.const, mine.default) == \
            (action.dest, action.nargs, action.type, action.choices, action.const, action.default), flag
    assert math.isfinite(plan.make_plan(SMALL + ["--fp16", "--overlap-grad-reduce"])["memory_gb"]["total"])


# -- Mixture of Experts -------------------------------------------------------------------------
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE_VARIANTS = {
    "every-layer-gelu": ["--disable-bias-linear"],
    "swiglu-shared-gated-every-2nd": ["--disable-bias-linear", "--swiglu", "--moe-layer-freq", "2",
                                      "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"],
    "pattern-untied": ["--disable-bias-linear", "--moe-layer-freq", "[0,1,1,0]", "--untie-embeddings-and-output-weights"],
    # Megatron-LM's default: biased experts, router and shared expert (gpt-oss's MLP)
    "biased-quick-geglu-shared": ["--quick-geglu", "--moe-shared-expert-intermediate-size", "32"],
}


def built_params(c, tp_rank: int, ep_rank: int, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters of the model chunks megalite builds for one rank (on the meta
    device, with offline TP and EP groups of the layout's sizes)."""
    from megalite.comm import OfflineGroup
    from megalite.model import ExecutionConfig, GPTModel
    from megalite.parallel_state import stage_layers
    p = c.parallel
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    execution = ExecutionConfig.from_configs(c.optimizer, p, c.recompute, c.kernels)
    config = dataclasses.replace(c.model, hidden_dropout=0.0, attention_dropout=0.0)  # no RNG tracker needed
    dense = experts = 0
    for k, (offset, layers) in enumerate(stage_layers(c.model.num_layers, pp, v, pp_rank)):
        chunk = GPTModel(config, OfflineGroup(p.tensor_model_parallel_size, tp_rank), None,
                         pre_process=pp_rank == 0 and k == 0, post_process=pp_rank == pp - 1 and k == v - 1,
                         layer_offset=offset, num_layers=layers, device="meta", execution=execution,
                         ep_group=OfflineGroup(p.expert_model_parallel_size, ep_rank),
                         etp_group=OfflineGroup(p.expert_tensor_parallel_size, tp_rank % p.expert_tensor_parallel_size))
        for name, param in chunk.named_parameters():
            if ".mlp.experts.local_experts." in name:
                experts += param.numel()
            else:
                dense += param.numel()
    return dense, experts


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
@pytest.mark.parametrize("tp,pp,ep,vpp_layers,etp", [(1, 1, 1, None, 1), (1, 2, 2, None, 1), (2, 1, 4, None, 2),
                                                     (2, 2, 2, 1, 2), (2, 1, 4, None, 1)],
                         ids=["tp1-pp1-ep1", "pp2-ep2", "tp2-ep4", "tp2-pp2-vpp-ep2", "tp2-etp1-ep4"])
def test_moe_params_per_rank_match_built_model(variant, tp, pp, ep, vpp_layers, etp):
    from megalite.planning.memory import stage_param_split
    from megalite.planning.moe import moe_pattern
    world = tp * pp * 4  # DP 4: EP taken from it
    argv = SMALL + MOE + MOE_VARIANTS[variant] + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep), "--world-size", str(world),
        "--expert-tensor-parallel-size", str(etp)] + (["--sequence-parallel"] if tp > 1 else [])
    if vpp_layers:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers), "--global-batch-size", "16"]
    c, _ = plan.parse(argv)
    h, f, t = 64, 48, etp  # experts are cut over ETP
    gated, bias = "--swiglu" in argv or "--quick-geglu" in argv, "--disable-bias-linear" not in argv
    # fc1 [f or 2f, h] and fc2 [h, f]; with biases fc1's (split over ETP) and fc2's (whole on every ETP rank)
    split, whole = f * h * (3 if gated else 2) + (f * (2 if gated else 1) if bias else 0), h if bias else 0
    expert = split + whole
    pattern = moe_pattern(c)
    for r in range(pp):
        plan_split = stage_param_split(c, r)
        moe_here = sum(pattern[n] for n in range(c.model.num_layers) if n in stage_layer_numbers(c, r))
        for ep_rank in range(ep):  # every EP rank holds as many (other experts)
            for tp_rank in range(tp):
                assert built_params(c, tp_rank, ep_rank, r) == plan_split, (r, ep_rank, tp_rank)
        assert plan_split[1] == moe_here * (4 // ep) * (split // t + whole)
    # the whole model, each parameter once: one process holding every expert
    one = built_params(plan.parse(SMALL + MOE + MOE_VARIANTS[variant])[0], 0, 0, 0)
    assert total_params(c) == sum(one)
    p = plan.make_plan(argv)
    assert p["num_params_total"] == sum(one)
    assert p["num_params_active"] == sum(one) - sum(pattern) * (4 - 2) * expert  # top-2 of 4 experts
    assert p["moe"]["expert_params_per_gpu"] == max(stage_param_split(c, r)[1] for r in range(pp))


def stage_layer_numbers(c, pp_rank):
    from megalite.planning.moe import chunk_layers
    return [n for chunk in chunk_layers(c, pp_rank) for n in chunk]


def test_moe_zero_shards_experts_over_expert_dp():
    """ZeRO-1 in bf16 over DP 8 with EP 4: dense weights' 12 bytes of optimizer state over 8 ranks,
    experts' over the 2 that hold the same experts; ZeRO-3 shards the parameters alike."""
    from megalite.planning.memory import stage_param_split
    argv = SMALL + MOE + ["--disable-bias-linear", "--expert-model-parallel-size", "4", "--bf16", "--world-size", "8"]
    c, _ = plan.parse(argv)
    dense, experts = stage_param_split(c, 0)
    assert experts == 4 * (4 // 4) * 48 * 64 * 2  # 4 MoE layers, 1 expert each here
    zero1 = plan.make_plan(argv + ["--use-distributed-optimizer"])
    assert zero1["stages"][0]["optimizer_bytes"] == 12 * dense / 8 + 12 * experts / 2
    assert zero1["stages"][0]["grad_bytes"] == 4 * (dense + experts)
    zero3 = plan.make_plan(argv + ["--data-parallel-sharding-strategy", "optim_grads_params"])
    assert zero3["stages"][0]["param_bytes"] == 2 * dense / 8 + 2 * experts / 2
    assert zero3["stages"][0]["grad_bytes"] == 4 * dense / 8 + 4 * experts / 2
    assert zero1["moe"]["expert_dp"] == 2 and zero1["moe"]["experts_per_gpu"] == 1


def test_moe_flops_count_active_parameters_only():
    """FLOPs of an MoE model per iteration, by hand: 3 (forward + backward) x 2 per multiply-add of
    every weight a token is routed through (attention, the top-k experts, the shared expert, the
    router and its gate, the output layer), plus QKᵀ and attention x V; the same as a dense model
    whose MLP is k experts wide, plus the router. MFU (training.py) divides these FLOPs."""
    from megalite.runtime.metrics import num_floating_point_operations
    L, h, s, V, B, E, k, f_e, f_s, f = 4, 64, 32, 1024, 8, 4, 2, 48, 32, 96
    argv = SMALL + MOE + ["--disable-bias-linear", "--swiglu", "--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", str(f_s),
                          "--moe-shared-expert-gate", "--ffn-hidden-size", str(f), "--global-batch-size", str(B)]
    p = plan.make_plan(argv)
    moe_layers, dense_layers = 2, 2  # layers 0 and 2
    per_token = (L * 4 * h * h + dense_layers * 3 * f * h + moe_layers * (k * 3 * f_e * h + 3 * f_s * h + E * h + h)
                 + V * h)
    assert p["flops_per_iteration"] == pytest.approx(3 * B * s * (2 * per_token + 4 * s * h * L))
    c, _ = plan.parse(argv)
    # experts a token does not reach cost nothing: 16 experts instead of 4 add only router FLOPs
    wide, _ = plan.parse([a if a != "4" or argv[i - 1] != "--num-experts" else "16" for i, a in enumerate(argv)])
    assert wide.model.num_experts == 16
    assert num_floating_point_operations(wide.model, B) - num_floating_point_operations(c.model, B) == \
        pytest.approx(6 * B * s * h * (16 - 4) * moe_layers)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_dispatch_bytes_per_iteration(dispatcher, capsys):
    """Hidden states sent per GPU and iteration at balanced routing: per MoE layer and
    micro-batch 4 collectives (dispatch and combine, forward and backward) of T = s·b/CP tokens
    of h bf16 values: alltoall sends the T·k routed copies, (EP-1)/EP of them to other ranks;
    allgather sends the rank's T tokens to, and reduce-scatters T outputs for, EP-1 ranks."""
    L, h, s, b, m, ep, k = 4, 64, 32, 2, 4, 4, 2
    argv = SMALL + MOE + ["--disable-bias-linear", "--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher,
                          "--bf16", "--world-size", "8", "--global-batch-size", str(b * m * 8)]
    p = plan.make_plan(argv)
    T = s * b
    per = T * k * (ep - 1) / ep if dispatcher == "alltoall" else T * (ep - 1)
    assert p["moe"]["dispatch_bytes_per_iteration"] == pytest.approx(4 * L * m * per * h * 2)
    # full recompute repeats each rebuilt layer's forward dispatch and combine
    full = plan.make_plan(argv + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"])
    assert full["moe"]["dispatch_bytes_per_iteration"] == pytest.approx(6 * L * m * per * h * 2)
    assert plan.make_plan(SMALL + MOE + ["--disable-bias-linear", "--world-size", "8"])["moe"]["dispatch_bytes_per_iteration"] == 0
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert f"dispatch {dispatcher} over EP 4: " in out and "EP 4 x expert-DP 2" in out
    assert "parameters active per token" in out and "(active: top-k experts)" in out
