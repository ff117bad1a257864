"""MoE flags that cannot work fail at start-up, before any collective, naming the flags."""
import pytest

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.config.moe import moe_layer_pattern
from megalite.parallel_state import RankGrid
from tiny import mock, tiny

OK = mock(100) + tiny(seq_length=16, global_batch_size=None, train_iters=1, num_layers=4)
MOE = ["--num-experts", "4", "--disable-bias-linear"]


@pytest.mark.parametrize("extra,world,pattern", [
    (["--moe-router-topk", "2"], 1, r"--moe-router-topk needs --num-experts"),
    (["--expert-model-parallel-size", "2"], 2, r"--expert-model-parallel-size needs --num-experts"),
    (MOE + ["--moe-pad-expert-input-to-capacity"], 1,
     r"--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (MOE + ["--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--bf16"], 1,
     r"--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16"),
    (MOE + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], 1, r"--fp8-recipe mxfp8 is not supported"),
    (MOE + ["--moe-router-topk", "5"], 1, r"--moe-router-topk \(5\) exceeds --num-experts \(4\)"),
    (MOE + ["--expert-model-parallel-size", "3"], 3, r"--num-experts \(4\) is not divisible by "
                                                     r"--expert-model-parallel-size \(3\)"),
    (MOE + ["--expert-model-parallel-size", "4"], 2, r"--expert-model-parallel-size \(4\) must divide DP x CP"),
    (MOE + ["--expert-model-parallel-size", "2", "--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2"], 4,
     r"--use-tp-pp-dp-mapping with PP > 1 needs --expert-tensor-parallel-size x --expert-model-parallel-size"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, r"needs --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-tensor-parallel-size", "2"], 4, r"--expert-tensor-parallel-size 2 with biased experts"),
    (MOE + ["--moe-router-enable-expert-bias"], 1, r"--moe-router-enable-expert-bias needs "
                                                  r"--moe-router-score-function sigmoid"),
    (MOE + ["--moe-shared-expert-gate"], 1, r"--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (MOE + ["--moe-layer-freq", "[1,0]"], 1, r"--moe-layer-freq must be .*2 entries for 4 layers"),
    (MOE + ["--moe-layer-freq", "__import__('os')"], 1, r"--moe-layer-freq must be an integer or a Python list"),
    (MOE + ["--moe-expert-capacity-factor", "0"], 1, r"--moe-expert-capacity-factor must be a number > 0"),
    (MOE + ["--moe-router-num-groups", "2"], 1, r"--moe-router-num-groups needs --moe-router-group-topk"),
    (MOE + ["--moe-router-group-topk", "1"], 1, r"--moe-router-group-topk needs --moe-router-num-groups"),
    (MOE + ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     r"--moe-router-num-groups \(3\) does not divide --num-experts \(4\)"),
    (MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], 1,
     r"--moe-router-group-topk \(3\) exceeds --moe-router-num-groups \(2\)"),
    (MOE + ["--moe-router-num-groups", "4", "--moe-router-group-topk", "3"], 1,
     r"--moe-router-group-topk \(3\) exceeds --moe-router-topk \(2\)"),
    (MOE + ["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"], 1,
     r"--moe-router-topk / --moe-router-group-topk \(2 / 1\) exceeds the 1 experts of a group"),
    (MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk", "3"], 1,
     r"--moe-router-topk / --moe-router-group-topk \(3 / 1\) exceeds the 2 experts"),
    (MOE + ["--moe-router-topk-scaling-factor", "0"], 1, r"--moe-router-topk-scaling-factor must be a number > 0"),
    (MOE + ["--expert-tensor-parallel-size", "0"], 1, r"--expert-tensor-parallel-size must be an integer >= 1"),
    (MOE + ["--expert-tensor-parallel-size", "3"], 3, r"--ffn-hidden-size \(256\) is not divisible by "
                                                     r"--expert-tensor-parallel-size \(3\)"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
            "--expert-model-parallel-size", "4"], 2,
     r"--expert-tensor-parallel-size \(1\) x --expert-model-parallel-size \(4\) must divide TP x DP x CP"),
])
def test_bad_moe_flags(extra, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(OK + extra), world)


def test_megatron_lms_lenient_moe_flags():
    """What Megatron-LM accepts and ignores: --expert-tensor-parallel-size on a dense model,
    --moe-router-pre-softmax beside sigmoid scores (a notice each)."""
    c = validate_args(parse_args(OK + ["--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel"]), 2)
    assert c.parallel.expert_tensor_parallel_size == 2 and any("--expert-tensor-parallel-size 1 has no effect" in n
                                                                for n in c.notices)
    c = validate_args(parse_args(OK + MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"]), 1)
    assert not c.model.moe_router_pre_softmax and any("--moe-router-pre-softmax has no effect" in n for n in c.notices)


def test_expert_grid_in_megatron_lms_tp_pp_dp_order():
    """--use-tp-pp-dp-mapping: Megatron-LM's expert RankGenerator order tp-ep-pp-dp; with PP > 1 it
    needs ETP x EP = TP x CP, so both grids keep the same pipeline groups."""
    grid = RankGrid(8, tp=2, pp=2, order="tp-cp-pp-dp", cp=1, ep=2, etp=1)
    assert grid.expert_grid_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted({tuple(sorted(g)) for g in grid.expert_grid_groups("pp")}) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    with pytest.raises(ValueError, match="ETP x EP must equal TP x CP"):
        RankGrid(8, tp=2, pp=2, order="tp-cp-pp-dp", ep=2, etp=2)


def test_biased_moe_is_megatron_lms_default():
    """Without --disable-bias-linear experts, router and shared expert take biases (Megatron-LM's)."""
    c = validate_args(parse_args(OK + ["--num-experts", "4"]), 1)
    assert c.model.add_bias_linear and c.model.num_experts == 4


@pytest.mark.parametrize("extra,notices", [
    (["--moe-permute-fusion", "--moe-router-fusion", "--transformer-impl", "transformer_engine",
      "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
      "--export-force-local-attention"],
     ["--moe-permute-fusion: a Megatron-LM kernel choice; megalite permutes tokens with PyTorch",
      "--moe-router-fusion: a Megatron-LM kernel choice; megalite's PyTorch router",
      "--transformer-impl transformer_engine: megalite's own layers run instead",
      "--no-masked-softmax-fusion: a Megatron-LM kernel choice", "--no-bias-gelu-fusion: a Megatron-LM kernel",
      "--no-bias-dropout-fusion: a Megatron-LM kernel", "--export-force-local-attention: a Megatron-LM kernel"]),
    (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"],
     ["--moe-token-dispatcher-type flex (hybridep kernels): megalite's alltoall dispatcher runs instead"]),
    (["--moe-flex-dispatcher-backend", "deepep"], ["--moe-flex-dispatcher-backend deepep has no effect without"]),
])
def test_kernel_only_choices_get_one_notice_each(extra, notices):
    c = validate_args(parse_args(OK + MOE + extra), 1)
    for start in notices:
        assert len([n for n in c.notices if n.startswith(start)]) == 1, (start, c.notices)
    assert len(c.notices) == len(notices), c.notices
    if "flex" in extra:
        assert c.parallel.moe_token_dispatcher_type == "alltoall"


def test_expert_data_parallel_size_is_derived():
    c = validate_args(parse_args(OK + MOE + ["--expert-model-parallel-size", "2", "--global-batch-size", "16"]), 8)
    assert (c.parallel.data_parallel_size, c.parallel.expert_data_parallel_size) == (8, 4)


def test_expert_tensor_parallel_size_defaults_to_tp_and_sizes_the_expert_grid():
    """Megatron-LM: ETP unset means TP; expert-DP = world / (ETP x EP x PP)."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "16"]
    c = validate_args(parse_args(OK + MOE + tp2), 8)
    assert (c.parallel.expert_tensor_parallel_size, c.parallel.expert_data_parallel_size) == (2, 4)
    c = validate_args(parse_args(OK + MOE + tp2 + ["--expert-tensor-parallel-size", "1",
                                                   "--expert-model-parallel-size", "4"]), 8)
    assert (c.parallel.expert_tensor_parallel_size, c.parallel.expert_data_parallel_size) == (1, 2)
    assert validate_args(parse_args(OK), 2).parallel.expert_tensor_parallel_size == 1


def test_moe_layer_freq_forms():
    assert moe_layer_pattern("2", 4) == [True, False, True, False]
    assert moe_layer_pattern("'([0]+[1]*1)*2'", 4) == [False, True, False, True]


def test_expert_groups_take_consecutive_dp_cp_ranks():
    """Megatron-LM's expert grid (TP-EP-DP-PP, expert TP = TP): k = cp + CP·dp within each (tp, pp);
    EP groups are EP consecutive k, expert-DP groups the k that are EP apart."""
    grid = RankGrid(16, tp=2, pp=2, cp=1, ep=2)  # DP 4
    ep_groups, edp_groups = grid.expert_groups()
    assert [0, 2] in ep_groups and [4, 6] in ep_groups and [1, 3] in ep_groups and [8, 10] in ep_groups
    assert [0, 4] in edp_groups and [2, 6] in edp_groups and [9, 13] in edp_groups
    assert len(ep_groups) == 8 and len(edp_groups) == 8
    cp_grid = RankGrid(8, tp=1, pp=1, cp=2, ep=4)  # DP 4 x CP 2: k = cp + 2·dp = the rank
    assert cp_grid.expert_groups() == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_use_checkpoint_args_takes_the_moe_architecture(tmp_path):
    from test_checkpoint_args import RUN, config, write_checkpoint
    ck = str(tmp_path / "ck")
    moe = ["--num-experts", "8", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "2",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate", "--moe-router-num-groups", "4",
           "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64"]
    write_checkpoint(ck, mock(100) + tiny(num_layers=4, global_batch_size=None, train_iters=1) + MOE[2:] + moe)
    c = config(["--use-checkpoint-args", "--load", ck, "--mock-data", "--disable-bias-linear"] + RUN)
    m = c.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (8, 1, 24, "2")
    assert m.moe_router_enable_expert_bias and m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size == 16
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor,
            m.moe_router_dtype) == (4, 1, 2.5, "fp64")


def test_checkpoint_of_another_moe_shape_is_refused():
    from megalite.checkpoint.native.state import check_moe_config
    from megalite.errors import CheckpointError
    base = {"num_layers": 4, "ffn_hidden_size": 64, "num_experts": 4, "moe_layer_freq": "1"}
    check_moe_config(base, dict(base, moe_layer_freq="'[1]*4'", moe_ffn_hidden_size=64), "ck")  # the same layers
    check_moe_config(base, dict(base, moe_router_dtype="fp32", moe_router_topk_scaling_factor=1.0), "ck")  # unset
    for change, flag in (({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "--moe-router-num-groups"),
                         ({"moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor"),
                         ({"moe_router_dtype": "fp64"}, "--moe-router-dtype"),
                         ({"num_experts": 8}, "--num-experts"), ({"moe_layer_freq": "2"}, "--moe-layer-freq"),
                         ({"num_experts": None}, "--num-experts"), ({"moe_ffn_hidden_size": 32}, "--moe-ffn-hidden-size")):
        with pytest.raises(CheckpointError, match=f"{flag} is .* in the checkpoint"):
            check_moe_config(base, dict(base, **change), "ck")
