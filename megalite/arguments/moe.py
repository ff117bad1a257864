"""Mixture-of-Experts flags: the MoE layers' shape, the router, and expert parallelism."""
from __future__ import annotations

from ..config.moe import moe_layer_pattern
from ..config.run import RunConfig
from .errors import fail


def check_moe(c: RunConfig) -> None:
    m, p = c.model, c.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    dp_cp = p.data_parallel_size * p.context_parallel_size
    if c.kernels.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        fail("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as Megatron-LM: the capacity "
             "is what each expert's input is padded to)")
    if not m.num_experts:
        given = sorted(k for k in c.explicit if k.startswith("model.moe_"))
        if given or ep > 1:
            name = "--expert-model-parallel-size" if ep > 1 else "--" + given[0][len("model."):].replace("_", "-")
            fail(f"{name} needs --num-experts (an MoE model)")
        if p.expert_tensor_parallel_size not in (None, tp):  # Megatron-LM builds the expert grid regardless
            c.notices.append(f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size} has no effect without "
                             f"--num-experts (a dense model has no experts to split; Megatron-LM accepts it there)")
        p.expert_tensor_parallel_size = tp
        p.expert_data_parallel_size = dp_cp
        return
    e, k = m.num_experts, m.moe_router_topk
    if k > e:
        fail(f"--moe-router-topk ({k}) exceeds --num-experts ({e})")
    check_group_routing(e, k, m.moe_router_num_groups, m.moe_router_group_topk)
    try:
        moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as why:
        fail(f"--moe-layer-freq must be {why}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        fail("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron-LM: the bias "
             "shifts sigmoid scores, which are not normalised over experts)")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":  # Megatron-LM ignores it there
        c.notices.append(f"--moe-router-pre-softmax has no effect with --moe-router-score-function "
                         f"{m.moe_router_score_function} (it orders softmax and top-k; Megatron-LM accepts and "
                         f"ignores it there)")
        m.moe_router_pre_softmax = False
    if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_aux_loss_coeff:
        fail(f"--moe-router-load-balancing-type sinkhorn balances by its routing, with no loss: --moe-aux-loss-coeff "
             f"must be 0 (got {m.moe_aux_loss_coeff}; Megatron-LM asserts the same)")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        fail("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if tp > 1 and not p.sequence_parallel:
        fail("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron-LM: "
             "each TP rank routes its own slice of the tokens)")
    if e % ep:
        fail(f"--num-experts ({e}) is not divisible by --expert-model-parallel-size ({ep})")
    check_expert_grid(c)


def check_expert_grid(c: RunConfig) -> None:
    """Megatron-LM's expert grid ETP x EP x expert-DP x PP over the same world as TP x CP x DP x
    PP (parallel_state.py): ETP defaults to TP; ETP x EP divides TP x DP x CP (the ranks of a
    pipeline stage); each expert's ffn divides by ETP, the shared expert's (a dense MLP) by TP."""
    m, p = c.model, c.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size = p.expert_tensor_parallel_size or tp
    dp_cp = p.data_parallel_size * p.context_parallel_size
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if ffn % etp:
        name, by = ("--moe-ffn-hidden-size" if m.moe_ffn_hidden_size else "--ffn-hidden-size",
                    "--tensor-model-parallel-size" if etp == tp else "--expert-tensor-parallel-size")
        fail(f"{name} ({ffn}) is not divisible by {by} ({etp})")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        fail(f"--moe-shared-expert-intermediate-size ({shared}) is not divisible by --tensor-model-parallel-size ({tp})")
    if etp == tp and dp_cp % ep:
        fail(f"--expert-model-parallel-size ({ep}) must divide DP x CP ({p.data_parallel_size} x "
             f"{p.context_parallel_size}): expert-parallel ranks are taken from the data- and context-parallel ones")
    if (tp * dp_cp) % (etp * ep):
        fail(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) must divide TP x DP x CP "
             f"({tp} x {p.data_parallel_size} x {p.context_parallel_size}): the expert grid ETP x EP x expert-DP "
             "takes the ranks of a pipeline stage")
    if m.add_bias_linear and 1 < etp != tp:
        fail(f"--expert-tensor-parallel-size {etp} with biased experts (no --disable-bias-linear) needs ETP 1 or "
             f"ETP = --tensor-model-parallel-size ({tp}): fc2's bias, whole on each ETP rank, has its gradient "
             f"summed over the TP group")
    if (ep > 1 or etp != tp) and p.use_tp_pp_dp_mapping and p.pipeline_model_parallel_size > 1 \
            and etp * ep != tp * p.context_parallel_size:
        fail(f"--use-tp-pp-dp-mapping with PP > 1 needs --expert-tensor-parallel-size x --expert-model-parallel-size "
             f"({etp} x {ep}) = TP x CP ({tp} x {p.context_parallel_size}): the expert grid (TP-EP-PP-DP) must "
             "keep the dense grid's pipeline groups (Megatron-LM asserts the same)")
    p.expert_data_parallel_size = tp * dp_cp // (etp * ep)


def check_group_routing(e: int, k: int, groups: int | None, group_topk: int | None) -> None:
    """Group-limited routing: both flags or neither; the groups divide the experts; each kept
    group is scored by its top k / group_topk experts (so group_topk <= k, and those fit in a
    group), and the kept groups hold at least k experts."""
    if (groups is None) != (group_topk is None):
        given, missing = ("--moe-router-num-groups", "--moe-router-group-topk") if group_topk is None else \
            ("--moe-router-group-topk", "--moe-router-num-groups")
        fail(f"{given} needs {missing} (group-limited routing takes both)")
    if groups is None:
        return
    if e % groups:
        fail(f"--moe-router-num-groups ({groups}) does not divide --num-experts ({e})")
    if group_topk > groups:
        fail(f"--moe-router-group-topk ({group_topk}) exceeds --moe-router-num-groups ({groups})")
    if group_topk > k:
        fail(f"--moe-router-group-topk ({group_topk}) exceeds --moe-router-topk ({k}): each kept group is scored by "
             f"its top (--moe-router-topk / --moe-router-group-topk) experts")
    per_group = e // groups
    if k // group_topk > per_group:
        fail(f"--moe-router-topk / --moe-router-group-topk ({k} / {group_topk}) exceeds the {per_group} experts of a "
             f"group (--num-experts / --moe-router-num-groups)")
    if k > group_topk * per_group:
        fail(f"--moe-router-topk ({k}) exceeds the {group_topk * per_group} experts of the "
             f"--moe-router-group-topk ({group_topk}) groups kept")
