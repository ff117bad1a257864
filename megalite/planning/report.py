"""The plan of a layout: per-stage memory by sharding strategy, the pipeline bubble, FLOPs; and its
text report (tools/plan.py prints it). The arithmetic is in planning/memory.py."""
from __future__ import annotations

from ..config.run import RunConfig
from ..runtime.metrics import num_floating_point_operations
from ..config.sharding import STRATEGIES
from .memory import (in_flight_chunks, layer_activation_bytes, muon_momentum_bytes, optimizer_bytes_per_param, optimizer_state_bytes,
                     recompute_setting, stage_activation_bytes,
                     stage_param_split, strategy_bytes, total_params)
from .schedule import bubble, schedule_name
from .moe import active_params, expert_tp, local_expert_params, moe_pattern, stage_dispatch_bytes

GIB = 2**30


def _stage_plan(c: RunConfig, r: int, strategy: str) -> dict:
    """Pipeline stage r's parameters and bytes (under `strategy` and under each strategy)."""
    dense, experts = stage_param_split(c, r)
    n = dense + experts
    by = {name: strategy_bytes(c, r, s) for name, s in STRATEGIES.items()}
    activations = stage_activation_bytes(c, r)
    for b in by.values():
        b["total"] = b["params"] + b["grads"] + b["optimizer"] + b["working_set"] + activations
    mem = by[strategy]
    opt_full, opt_zero1 = by["no_shard"]["optimizer"], by["optim"]["optimizer"] + by["optim"]["optimizer_host"]
    return {
        "pp_rank": r, "num_params": n, "num_expert_params": experts, "dispatch_bytes": stage_dispatch_bytes(c, r),
        "param_bytes": mem["params"], "grad_bytes": mem["grads"],
        "optimizer_bytes": mem["optimizer"], "optimizer_host_bytes": mem["optimizer_host"],
        "optimizer_bytes_without_zero1": opt_full, "optimizer_bytes_with_zero1": opt_zero1,
        "working_set_bytes": mem["working_set"], "gathered_param_bytes": mem["gathered_params"],
        "staging_grad_bytes": mem["staging_grads"], "padding_bytes_max": mem["padding_max"],
        "activation_bytes": activations, "total_bytes": mem["total"],
        # without the layers full recompute rebuilds in backward: what a dry run measures
        "held_activation_bytes": stage_activation_bytes(c, r, rebuilt=False),
        "total_bytes_without_zero1": by["no_shard"]["total"],
        "total_bytes_with_zero1": by["optim"]["total"] - by["optim"]["optimizer"] + opt_zero1,
        "total_bytes_by_strategy": {s: b["total"] for s, b in by.items()},
        "by_strategy": by,
        "in_flight_micro_batches": in_flight_chunks(c, r) / c.parallel.virtual_pipeline_model_parallel_size,
    }


def make_plan(c: RunConfig, gpu_memory_gb: float = 80.0) -> dict:
    """The plan (tools/plan.py's --json object) of a validated RunConfig whose model has its
    vocabulary sizes filled in; `c.kernels.use_flash_attn` plans for the flash-attn kernels."""
    p, t, dp = c.parallel.pipeline_model_parallel_size, c.parallel.tensor_model_parallel_size, c.parallel.data_parallel_size
    cp = c.parallel.context_parallel_size
    strategy = c.ddp.data_parallel_sharding_strategy
    zero1 = STRATEGIES[strategy].shards_optimizer
    stages = [_stage_plan(c, r, strategy) for r in range(p)]
    worst = max(stages, key=lambda st: st["total_bytes"])
    v, m = c.parallel.virtual_pipeline_model_parallel_size, c.training.num_microbatches
    granularity, method, k = recompute_setting(c)
    memory_gb = {key: worst[f"{field}_bytes"] / GIB for key, field in
                 (("params", "param"), ("grads", "grad"), ("optimizer", "optimizer"),
                  ("working_set", "working_set"), ("activations", "activation"), ("total", "total"))}
    by_strategy_gb = {s: {k: val / GIB for k, val in worst["by_strategy"][s].items() if k != "buckets"}
                      for s in STRATEGIES}
    return {
        "layout": {"world_size": c.parallel.world_size, "tp": t, "pp": p, "dp": dp, "cp": cp, "vpp": v,
                   "micro_batch_size": c.training.micro_batch_size, "global_batch_size": c.training.global_batch_size,
                   "num_microbatches": m, "seq_length": c.model.seq_length,
                   "precision": "bf16" if c.optimizer.bf16 else ("fp16" if c.optimizer.fp16 else "fp32"),
                   "distributed_optimizer": zero1, "data_parallel_sharding_strategy": strategy,
                   "optimizer_cpu_offload": bool(c.optimizer.optimizer_cpu_offload),
                   # masters + moments per parameter, in their dtypes (--use-precision-aware-optimizer)
                   "optimizer_bytes_per_param": optimizer_bytes_per_param(c.optimizer),
                   "muon_matrix_bytes_per_param": (optimizer_bytes_per_param(c.optimizer) - optimizer_state_bytes(
                       c.optimizer) + muon_momentum_bytes(c.optimizer)) if c.optimizer.optimizer == "muon" else None,
                   "sequence_parallel": bool(c.parallel.sequence_parallel) and t > 1,
                   "recompute": granularity or "none", "recompute_method": method,
                   "recompute_num_layers": k if granularity == "full" else None,
                   "flash_attn": bool(c.kernels.use_flash_attn)},
        "model": {"num_layers": c.model.num_layers, "hidden_size": c.model.hidden_size,
                  "num_attention_heads": c.model.num_attention_heads, "num_query_groups": c.model.num_query_groups,
                  "ffn_hidden_size": c.model.ffn_hidden_size, "vocab_size": c.model.vocab_size,
                  "padded_vocab_size": c.model.padded_vocab_size},
        "num_params_total": total_params(c),
        "num_params_active": active_params(c, total_params(c)),
        "moe": moe_plan(c, stages),
        "num_params_per_gpu": max(st["num_params"] for st in stages),
        "memory_gb": memory_gb,
        "memory_gb_optimizer_without_zero1": worst["optimizer_bytes_without_zero1"] / GIB,
        "memory_gb_optimizer_with_zero1": worst["optimizer_bytes_with_zero1"] / GIB,
        "memory_gb_total_without_zero1": worst["total_bytes_without_zero1"] / GIB,
        "memory_gb_total_with_zero1": worst["total_bytes_with_zero1"] / GIB,
        "memory_gb_optimizer_host": worst["optimizer_host_bytes"] / GIB,
        "memory_gb_padding_max": worst["padding_bytes_max"] / GIB,
        "memory_gb_by_strategy": by_strategy_gb,
        "worst_pp_rank": worst["pp_rank"],
        # one dense layer's activations per micro-batch under each --cp-comm-type (CP > 1)
        "layer_activation_gb_by_cp_comm_type": layer_bytes_by_cp_comm_type(c),
        "stages": stages,
        "bubble_fraction": bubble(c)[0], "bubble_formula": bubble(c)[1], "pipeline_schedule": schedule_name(c),
        "flops_per_iteration": num_floating_point_operations(c.model, c.training.global_batch_size),
        "tokens_per_iteration": c.training.global_batch_size * c.model.seq_length,
        "gpu_memory_gb": gpu_memory_gb,
        "fits": memory_gb["total"] <= gpu_memory_gb,
    }


def moe_plan(c: RunConfig, stages: list[dict]) -> dict | None:
    """The Mixture-of-Experts part of the plan (None for a dense model): the experts' placement,
    the expert parameters of the GPU that holds the most, and its token traffic per iteration."""
    m, p = c.model, c.parallel
    if not m.num_experts:
        return None
    most = max(stages, key=lambda st: st["num_expert_params"])
    return {"num_experts": m.num_experts, "topk": m.moe_router_topk, "ffn_hidden_size": m.expert_ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "num_moe_layers": sum(moe_pattern(c)), "ep": p.expert_model_parallel_size,
            "etp": expert_tp(c), "expert_dp": p.tensor_model_parallel_size * p.data_parallel_size
            * p.context_parallel_size // (expert_tp(c) * p.expert_model_parallel_size),
            "experts_per_gpu": m.num_experts // p.expert_model_parallel_size,
            "expert_params_per_layer_per_gpu": local_expert_params(c),
            "expert_params_per_gpu": most["num_expert_params"], "expert_params_pp_rank": most["pp_rank"],
            "dispatcher": p.moe_token_dispatcher_type, "capacity_factor": m.moe_expert_capacity_factor,
            "dispatch_bytes_per_iteration": max(st["dispatch_bytes"] for st in stages)}


def format_moe(plan: dict) -> list[str]:
    """The report's lines on experts, placement and dispatch traffic (none for a dense model)."""
    moe, lay = plan["moe"], plan["layout"]
    if moe is None:
        return []
    shared = f", a shared expert of {moe['shared_expert_intermediate_size']}" if moe[
        "shared_expert_intermediate_size"] else ""
    capacity = (f"capacity factor {moe['capacity_factor']:g} (tokens over it dropped)" if moe["capacity_factor"]
                else "dropless")
    n = moe["experts_per_gpu"]
    same = moe["etp"] == lay["tp"]
    etp = "" if same else f"ETP {moe['etp']} x "
    grid = "EP from the DP x CP ranks" if same else "the expert grid over TP x DP x CP"
    lines = [f"experts {moe['num_experts']} per MoE layer in {moe['num_moe_layers']} of {plan['model']['num_layers']} "
             f"layers, top-{moe['topk']}, ffn {moe['ffn_hidden_size']}{shared}, {capacity}; "
             f"{plan['num_params_active'] / 1e9:.3f}B of {plan['num_params_total'] / 1e9:.3f}B parameters active per "
             "token",
             f"        {etp}EP {moe['ep']} x expert-DP {moe['expert_dp']} ({grid}): {n} "
             f"expert{'s' if n > 1 else ''} per GPU and MoE layer, {moe['expert_params_per_gpu'] / 1e6:.1f}M expert "
             f"parameters on a GPU (stage {moe['expert_params_pp_rank']}); expert gradients and ZeRO state over "
             f"expert-DP {moe['expert_dp']}, the rest over DP x CP {lay['dp'] * lay['cp']}"]
    if moe["ep"] > 1:
        per = "4 all-to-alls of the T·k routed tokens" if moe["dispatcher"] == "alltoall" else \
            "2 all-gathers and 2 reduce-scatters of the EP group's tokens"
        lines.append(f"dispatch {moe['dispatcher']} over EP {moe['ep']}: "
                     f"{moe['dispatch_bytes_per_iteration'] / GIB:.2f} GiB sent per GPU per iteration at balanced "
                     f"routing ({per} per MoE layer and micro-batch, forward and backward)")
    return lines


def layer_bytes_by_cp_comm_type(c: RunConfig) -> dict:
    """{type: GiB} of one dense layer's activations per micro-batch, for every --cp-comm-type this
    layout could run (a2a+p2p with --hierarchical-context-parallel-sizes only)."""
    if c.parallel.context_parallel_size == 1:
        return {}
    types = ["allgather", "p2p", "a2a"] + (["a2a+p2p"] if c.parallel.hierarchical_context_parallel_sizes else [])
    return {t: layer_activation_bytes(c, False, t)[0] / GIB for t in types}


def format_plan(plan: dict) -> str:
    lay, mod = plan["layout"], plan["model"]
    rec = lay["recompute"] + (f" ({lay['recompute_method']}, {lay['recompute_num_layers']} layers)"
                              if lay["recompute"] == "full" else "")
    lines = [
        f"model   {plan['num_params_total'] / 1e9:.3f}B parameters: {mod['num_layers']} layers, hidden "
        f"{mod['hidden_size']}, {mod['num_attention_heads']} heads ({mod['num_query_groups']} query groups), "
        f"ffn {mod['ffn_hidden_size']}, vocab {mod['vocab_size']} (padded {mod['padded_vocab_size']})",
        f"layout  {lay['world_size']} GPUs = TP {lay['tp']}" + (f" x CP {lay['cp']}" if lay["cp"] > 1 else "")
        + f" x PP {lay['pp']} x DP {lay['dp']}"
        + (f", {lay['vpp']} virtual stages per rank" if lay["vpp"] > 1 else "")
        + f"; {lay['precision']}, DP sharding {lay['data_parallel_sharding_strategy']}"
        + (" + optimizer offload" if lay["optimizer_cpu_offload"] else "")
        + f", optimizer state {lay['optimizer_bytes_per_param']} bytes/param"
        + (f" (Muon's matrices {lay['muon_matrix_bytes_per_param']})" if lay["muon_matrix_bytes_per_param"] else "")
        + ", "
        f"sequence parallel {'on' if lay['sequence_parallel'] else 'off'}, recompute {rec}"
        + (", flash-attn" if lay["flash_attn"] else ""),
        *format_moe(plan),
        f"batch   {lay['num_microbatches']} micro-batches of {lay['micro_batch_size']} x {lay['seq_length']} tokens "
        f"per DP rank; global batch {lay['global_batch_size']} ({plan['tokens_per_iteration'] / 1e6:.2f}M tokens)",
        "",
        f"memory per GPU, GiB (pipeline stage with the most: {plan['worst_pp_rank']}; "
        f"{plan['num_params_per_gpu'] / 1e6:.1f}M parameters on it)",
    ]
    mem = plan["memory_gb"]
    zero_note = (f"   (without ZeRO-1: {plan['memory_gb_optimizer_without_zero1']:.2f})"
                 if lay["distributed_optimizer"] else
                 f"   (with ZeRO-1 over DP {lay['dp']}" + (f" x CP {lay['cp']}" if lay["cp"] > 1 else "")
                 + f": {plan['memory_gb_optimizer_with_zero1']:.2f})")
    if lay["optimizer_cpu_offload"]:
        zero_note += f"   + {plan['memory_gb_optimizer_host']:.2f} in host memory (offloaded)"
    for key in ("params", "grads", "optimizer", "working_set", "activations"):
        if key == "working_set" and not mem[key]:
            continue
        lines.append(f"  {key.replace('_', ' '):<12}{mem[key]:9.2f}" + (zero_note if key == "optimizer" else "")
                     + ("   (gathered parameters + gradient staging, ZeRO-2/3)" if key == "working_set" else ""))
    lines.append(f"  {'total':<12}{mem['total']:9.2f}   of {plan['gpu_memory_gb']:.0f}: "
                 + ("fits" if plan["fits"] else "DOES NOT FIT")
                 + " (plus CUDA context, NCCL buffers, fragmentation: a few GiB)")
    if plan["layer_activation_gb_by_cp_comm_type"]:
        lines.append("  activations of one layer per micro-batch by --cp-comm-type: " + ", ".join(
            f"{t} {gb:.3f}" for t, gb in plan["layer_activation_gb_by_cp_comm_type"].items()))
    if plan["memory_gb_padding_max"]:
        lines.append(f"  {'':<12}(plus bucket padding, at most {plan['memory_gb_padding_max'] * 2**20:.1f} KiB)")
    lines.append(f"  by DP sharding strategy over DP {lay['dp']}:  params   grads  optimizer  working set   total")
    for s, b in plan["memory_gb_by_strategy"].items():
        mark = "*" if s == lay["data_parallel_sharding_strategy"] else " "
        name = STRATEGIES[s].describe()
        lines.append(f"   {mark} {name:<30}{b['params']:8.2f}{b['grads']:8.2f}{b['optimizer']:11.2f}"
                     f"{b['working_set']:13.2f}{b['total']:8.2f}"
                     + ("" if b["total"] <= plan["gpu_memory_gb"] else "  no fit"))
    if len(plan["stages"]) > 1:
        lines.append("  by stage:   " + "  ".join(f"{st['pp_rank']}: {st['total_bytes'] / GIB:.1f}"
                                                  for st in plan["stages"]))
    lines += [
        "",
        f"pipeline bubble  {100 * plan['bubble_fraction']:.1f}% of an iteration, {plan['pipeline_schedule']} "
        f"({plan['bubble_formula']})",
        f"FLOPs/iteration  {plan['flops_per_iteration']:.3e}" + (" (active: top-k experts)" if plan["moe"] else "")
        + " "
        f"({plan['flops_per_iteration'] / lay['world_size'] / 1e12:.1f} TFLOP per GPU; "
        f"at 400 TFLOP/s/GPU: {plan['flops_per_iteration'] / lay['world_size'] / 400e12:.2f} s/iteration)",
    ]
    return "\n".join(lines)


