"""The training loop's log interval: the console line, its JSONL record and the trackers' values
(loss, LR, grad norm, throughput and MFU, MoE router statistics, MTP losses, QK-clip's largest
logit, parameter norm, memory), the straggler and pipeline-timeline reports, and the per-phase
timers. Every function here that reduces over ranks is called on every rank at the same
iterations."""
from __future__ import annotations

import datetime

import torch

from . import comm
from .initialize import Run
from .model.dsa import iteration_indexer_loss
from .model.moe import balance as moe_balance
from .pipeline_parallel.timeline import report as report_timeline
from .runtime.metrics import console_line, memory_record, memory_string, num_floating_point_operations
from .runtime.timers import INTERVAL_TIMERS, timers_text
from .tensor_parallel.param_info import param_info


def moe_metrics(run: Run, global_batch: int) -> dict:
    """The last iteration's router losses (means over its micro-batches and MoE layers) and, per
    MoE layer, the fewest and most tokens an expert received: read from the routers' statistics,
    which stay until the next step starts; one collective on every rank, at log iterations only."""
    c = run.state.model_config
    microbatches = global_batch // run.cfg.training.micro_batch_size  # over every DP rank
    # MTP's MoE layers are numbered after the decoder's (model/mtp.py)
    layers = c.num_layers + (c.mtp_num_layers or 0)
    return moe_balance.iteration_metrics(run.model, layers, c.num_experts, microbatches,
                                         (c.moe_aux_loss_coeff, c.moe_z_loss_coeff), run.state.device)


def params_norm(run: Run) -> float:
    """--log-params-norm: the L2 norm of the whole model's parameters, each counted once (from
    the first replica's whole parameters, or under ZeRO-3 from every DP rank's slices)."""
    ps, dp = run.state.ps, run.dp
    t = torch.zeros(1, dtype=torch.float64, device=run.state.device)
    dp.finish_param_sync()  # every rank: pending ZeRO-1/2 gathers would leave stale values
    for p, _, _, stored in dp.param_pieces():
        first_replica = ps.replica_rank(param_info(p).expert_parallel) == 0
        if (dp.strategy.shards_params or first_replica) and param_info(p).is_owner(ps.tp_rank):
            t += stored.detach().double().pow(2).sum()
    comm.all_reduce(t, comm.world_group())
    return float(t.sqrt())


def report(run: Run, out: dict, window: dict, elapsed_s: float) -> None:
    t, state = run.cfg.training, run.state
    sec_per_iter = elapsed_s / window["iters"]
    # FLOPs are linear in the batch: the window's samples give the mean over a changing batch
    flops = num_floating_point_operations(state.model_config, window["samples"]) / window["iters"]
    tflops = flops / (sec_per_iter * state.ps.world_size) / 1e12
    record = {
        "iteration": state.iteration, "consumed_samples": state.consumed_samples,
        "global_batch_size": out["global_batch_size"],
        "lm_loss": window["lm_loss"] / window["loss_iters"] if window["loss_iters"] else out["lm_loss"],
        "lr": out["lr"], "grad_norm": out["grad_norm"], "loss_scale": out.get("loss_scale", 1.0),
        "elapsed_ms": 1000.0 * sec_per_iter,
        "tokens_per_sec": window["samples"] * run.cfg.data.seq_length / elapsed_s,
        "tflops_per_gpu": tflops, "mfu": (tflops / run.peak) if run.peak else None,
        "skipped_iterations": window["skipped"],  # steps skipped (fp16 overflow, a spike) since the last report
    }
    if out.get("decoupled_lr") is not None:
        record["decoupled_lr"] = out["decoupled_lr"]
    for k, v in window["mtp"].items():  # Megatron-LM's "mtp_1 loss", ...: the unweighted mean cross entropy
        record[f"mtp_{k + 1}_loss"] = v / window["loss_iters"]
    if state.model_config.num_experts:  # MoE: the logged iteration's
        moe = moe_metrics(run, out["global_batch_size"])
        record.update({k: moe[k] for k in ("load_balancing_loss", "z_loss") if k in moe})
        per_layer = {f"layer_{r['layer']}_{k}": v for r in moe["moe_layers"] for k, v in r.items()
                     if k != "layer" and v is not None}
        record["expert_tokens_min"] = min(r["tokens_min"] for r in moe["moe_layers"])
        record["expert_tokens_max"] = max(r["tokens_max"] for r in moe["moe_layers"])
        run.jsonl.write({"event": "moe", "iteration": state.iteration, "layers": moe["moe_layers"]})
        run.tracker.log(per_layer, state.iteration, "moe")
    if state.model_config.dsa and state.model_config.dsa_indexer_loss_coeff:  # Megatron-LM's "indexer loss"
        record["dsa_indexer_loss"] = iteration_indexer_loss(
            run.model, out["global_batch_size"] // t.micro_batch_size, state.ps.tp_size, state.ps.dp_size,
            state.device, state.ps.cp_size)
    if "max_attention_logit" in out:  # --qk-clip: the logged iteration's, before its clip
        record["max_attention_logit"] = out["max_attention_logit"]
    if "num_zeros_in_grad" in out:  # --log-num-zeros-in-grad: the logged iteration's
        record["num_zeros_in_grad"] = out["num_zeros_in_grad"]
    if t.log_params_norm:
        record["params_norm"] = params_norm(run)
    if t.log_memory_to_tensorboard:
        record.update(memory_record(state.device))
    run.jsonl.write(record)
    run.tracker.log(record, state.iteration, "train")
    eta = (t.train_iters - state.iteration) * sec_per_iter
    line = console_line(record, t.train_iters, memory_string(state.device), eta, throughput=t.log_throughput)
    if run.straggler is not None:  # a collective: every rank reports at the same iterations
        text, straggler_record = run.straggler.report(state.iteration)
        run.jsonl.write(straggler_record)
        line += f" {text} |"
    run.log(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}]" + line)
    if run.timeline is not None:  # a collective: every rank reports at the same iterations
        report_timeline(run.timeline, state.ps, state.iteration, run.jsonl.write, run.log)
    log_timers(run, INTERVAL_TIMERS, window["iters"], {"iteration-time": record["elapsed_ms"]})


def log_timers(run: Run, names, normalizer: float, level0: dict | None = None) -> None:
    """The per-phase timers `names` (ms per iteration over `normalizer` iterations): the block
    under the log line and, with --log-timers-to-tensorboard, a 'timers' JSONL record and
    timers/<name> (the max over ranks) in the trackers, with `level0` (the iteration time).
    A collective on every rank when a named timer is on (--timing-log-level)."""
    times = run.timers.collect(names, normalizer)
    if times:
        run.log(timers_text(times))
    values = {**(level0 or {}), **{name: hi for name, (_, hi) in times.items()}}
    if run.cfg.training.log_timers_to_tensorboard and values:
        run.jsonl.write({"event": "timers", "iteration": run.state.iteration, **(level0 or {}),
                         **{name: {"min": lo, "max": hi} for name, (lo, hi) in times.items()}})
        run.tracker.log(values, run.state.iteration, "timers")
