"""The training loop, top-down: pretrain -> train -> train_step -> pipeline schedule (model
forward/backward per micro-batch) -> DataParallel.finish_grad_sync -> optimizer.step.

`pretrain` takes a RunConfig (validated from the flags at the entry point); `initialize.setup`
builds each piece from its own config and hands the loop a `Run`: the pieces one iteration
touches. Checkpoints see only the TrainState inside it.
"""
from __future__ import annotations

import functools
import gc
import math
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .checkpoint.native import TrainState
from .config import RunConfig
from .errors import UserError
from .initialize import Run, batch_iterators, setup
from .model.dsa import start_iteration as dsa_start_iteration
from .model.moe import balance as moe_balance
from .optimizer.clip_grads import max_abs
from .runtime.consistency import check_replicas
from .runtime.metrics import Timer, perplexity
from .runtime.rerun import Hooks
from .runtime.weight_hash import check_weight_hashes
from .tensor_parallel.param_info import param_info
from .train_report import log_timers, report


# -- one iteration ----------------------------------------------------------------------------------
class NonFiniteError(UserError):
    """--check-for-nan-in-loss-and-grad: the loss or the gradients hold a NaN or an Inf."""


@dataclass(frozen=True)
class GlobalLoss:
    """What one all-reduce tells every rank about the global batch (`global_loss`)."""
    loss_sum: float  # the sum of token losses
    num_tokens: float  # the number of loss tokens
    bad_loss: list  # per global rank, 1.0 where its own loss sum is not finite (with `grads`; else empty)
    grad_max: list  # per global rank, the largest |g| of its reduced gradients (with `grads`; else empty)
    rank_losses: list  # per global rank, its own mean loss, 0 where it has none (with `per_rank`; else empty)
    mtp_losses: list | None  # per MTP depth, its mean loss (None without MTP, and in evaluation)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_tokens

    @property
    def largest_loss_rank(self) -> int:
        return max(range(len(self.rank_losses)), key=self.rank_losses.__getitem__)

    @property
    def largest_grad_rank(self) -> int:
        return max(range(len(self.grad_max)), key=self.grad_max.__getitem__)


def global_loss(run: Run, stats, grads: list | None = None, per_rank: bool = False) -> GlobalLoss:
    """The loss over the global batch: only the last stage's TP rank 0 of each DP replica
    contributes (each CP rank of it its own chunks' tokens), so every token counts once. Summed on
    the device; one host read per call.

    With `grads` (--check-for-nan-in-loss-and-grad) the same all-reduce also carries, per global
    rank, whether its own loss sum is finite and the largest magnitude in its reduced gradients
    (each rank writes its own slot, the rest are zeros): every rank learns which ranks hold a
    NaN/Inf without another collective; with `per_rank` (the spike guard) each rank's own mean
    loss; with MTP in training, each depth's mean MTP loss."""
    ps = run.state.ps
    world = ps.world_size if grads is not None else 0
    ranks = ps.world_size if per_rank else 0
    t = torch.zeros(2 + 2 * world + ranks, dtype=torch.float64, device=run.state.device)
    if ps.is_loss_stage and ps.tp_rank == 0 and stats:
        # [m, 2] (loss sum, tokens) of the micro-batches, one stack and one sum however many
        mine = torch.stack([x for s in stats for x in s[:2]]).view(-1, 2).double().sum(0)
        t[:2] += mine
        if grads is not None:
            t[2 + ps.rank] = (~torch.isfinite(mine[0])).double()
        if per_rank:
            t[2 + 2 * world + ps.rank] = mine[0] / mine[1].clamp(min=1)
    if grads:  # max |g| (NaN wins, as torch.max propagates it)
        t[2 + world + ps.rank] = max_abs(grads)
    t = torch.cat([t, _mtp_sums(run, stats)])
    comm.all_reduce(t, comm.world_group())
    values = t.tolist()
    n = 2 + 2 * world + ranks
    # MTP: each depth's mean over the global batch's tokens (None without MTP, or in evaluation)
    mtp = [s / k for s, k in zip(values[n::2], values[n + 1::2])] if any(values[n + 1::2]) else None
    return GlobalLoss(values[0], values[1], values[2:2 + world], values[2 + world:2 + 2 * world],
                      values[2 + 2 * world:n], mtp)


def _mtp_sums(run: Run, stats) -> torch.Tensor:
    """[2·D]: this rank's (MTP loss sum, tokens) per depth over its micro-batches (training
    stats carry them; the last stage's TP rank 0 counts), for global_loss's all-reduce."""
    depth = run.state.model_config.mtp_num_layers or 0
    t = torch.zeros(2 * depth, dtype=torch.float64, device=run.state.device)
    ps = run.state.ps
    if depth and ps.is_loss_stage and ps.tp_rank == 0:
        for s in stats:
            if len(s) > 2:
                t += s[2].reshape(-1).to(t.device)
    return t


def check_finite(run: Run, g: GlobalLoss, grad_scale: float) -> None:
    """Stop before the optimizer step when the loss, or (without loss scaling, whose skip path
    owns overflows) the gradients the step would apply, hold a NaN or an Inf."""
    iteration = run.state.iteration + 1
    losses = [r for r, flag in enumerate(g.bad_loss) if flag]
    # the step multiplies the gradients by grad_scale in fp32: an overflow there counts too
    grads = [] if run.state.optimizer.scaler is not None else \
        [r for r, m in enumerate(g.grad_max) if not math.isfinite(m) or m * grad_scale > torch.finfo(torch.float32).max]
    if not (losses or grads):
        return
    what = []
    if losses:
        what.append(f"the loss is {g.loss_sum} (non-finite on rank(s) {losses}, the last pipeline stage)")
    if grads:
        what.append(f"the gradients hold NaN/Inf on rank(s) {grads} (after the data-parallel reduction, which spreads "
                    "them to every rank of that data-parallel group)")
    raise NonFiniteError(
        f"iteration {iteration}: {' and '.join(what)}; stopped before the optimizer step, so the weights and the "
        f"latest checkpoint are finite. Lower --lr or set --clip-grad, or resume from an earlier checkpoint "
        f"(--no-check-for-nan-in-loss-and-grad turns this check off)")


def empty_unused_memory(run: Run, level: int) -> None:
    """--empty-unused-memory-level: return cached CUDA blocks at Megatron-LM's points (level 1
    after forward-backward, level 2 also after the optimizer step); nothing to do on CPU."""
    if run.cfg.training.empty_unused_memory_level >= level and run.state.device.type == "cuda":
        torch.cuda.empty_cache()


class SpikeError(UserError):
    """--check-for-spiky-loss / --check-for-large-grads: too many spikes in a row."""


def after_guard(run: Run, guard, loss: float, update: dict) -> None:
    """Log a skipped update, count it (stop after --spike-patience in a row), or feed an applied
    one's loss and gradient norm to the guard's baseline."""
    iteration = run.state.iteration + 1
    run.last_step_spiked = bool(update.get("spike"))
    if not update.get("spike"):
        if not update["skipped"]:
            guard.accept(loss, update["grad_norm"])
        return
    if run.pending_save is not None:
        run.log(f"> checkpoint of iteration {run.pending_save[0]} not written: the loss after it spiked")
        run.pending_save = None
    run.log(f"> iteration {iteration}: update skipped, {update['spike']}")
    run.jsonl.write({"event": "spike", "iteration": iteration, "reason": update["spike"], "lm_loss": loss,
                     "grad_norm": update["grad_norm"]})
    if guard.reject():
        latest = (f"The latest checkpoint (iteration {run.last_saved}) holds weights that trained on: resume from it"
                  if run.last_saved > 0 else "No checkpoint of weights that trained on was written: start again")
        raise SpikeError(
            f"iteration {iteration}: {guard.consecutive} iterations in a row skipped for spikes (the last: "
            f"{update['spike']}); stopped without saving. {latest} with a lower --lr or a tighter --clip-grad")


def save_pending(run: Run) -> None:
    """Write the checkpoint due after the previous iteration, now that this iteration's loss
    shows its weights still train: the model, optimizer and counters are still that iteration's
    (this one has not updated them), the RNG states are put back to the saved ones for the write."""
    from .checkpoint.native import rng_state, set_rng_state
    iteration, (tensors, values) = run.pending_save
    run.pending_save = None
    current = rng_state(run.state)
    set_rng_state(run.state, tensors, values)
    try:
        save_checkpoint(run)
    finally:
        set_rng_state(run.state, *current)


def iteration_pass(run: Run, num_microbatches: int, backward_scale: float, fault=None) -> tuple:
    """One forward-backward of the iteration from zeroed gradients, and its GlobalLoss; `fault`
    (--error-injection-*) changes this rank's micro-batch stats as an injected fault would."""
    state, optimizer = run.state, run.state.optimizer
    run.dp.zero_grad()
    if state.model_config.num_experts:  # each micro-batch's router losses weigh as its share of the mean
        moe_balance.start_iteration(run.model, optimizer.loss_scale / (num_microbatches * state.ps.dp_size),
                                    state.ps.tp_dp_cp_group)
    if state.model_config.dsa:  # DSA's indexer loss weighs as the router losses (Megatron-LM's auto-scaler)
        dsa_start_iteration(run.model, optimizer.loss_scale / (num_microbatches * state.ps.dp_size))
    stats = list(forward_backward(run, num_microbatches, backward_scale))
    if fault is not None:
        fault(stats)
    check = run.cfg.training.check_for_nan_in_loss_and_grad
    return global_loss(run, stats, optimizer.grad_flats if check else None,
                       per_rank=run.spike_guard is not None or run.rerun is not None), stats


def validated_pass(run: Run, run_pass, num_microbatches: int) -> GlobalLoss:
    """The iteration's result through the re-run state machine: the loop's side of its hooks."""
    from .checkpoint.native import rng_state, set_rng_state
    state, check, guard = run.state, run.cfg.training.check_for_nan_in_loss_and_grad, run.spike_guard
    start = rng_state(state)

    def rewind(ps, ahead: int) -> None:
        run.train_batches = batch_iterators(run.cfg, run.datasets[0], state.consumed_samples + ahead, ps,
                                            state.device, run.eod, run.straggler, run.timers)

    scaled = state.optimizer.scaler is not None  # fp16's overflows belong to the loss scaler (a skipped step)

    def rejects(g: GlobalLoss) -> str | None:
        if check and (any(g.bad_loss) or not math.isfinite(g.loss)):
            return f"the loss is {g.loss}"
        if check and not scaled and not all(map(math.isfinite, g.grad_max)):
            return "the gradients hold NaN/Inf"
        return guard.loss_spike(g.loss) if guard is not None else None

    hooks = Hooks(run_pass, lambda: set_rng_state(state, *start), rewind, rejects)
    return run.rerun.step(hooks, state.iteration + 1, num_microbatches, state.consumed_samples)


def forward_backward(run: Run, num_microbatches: int, backward_scale: float) -> list:
    """The schedule over the iteration's micro-batches, then every gradient reduction: the
    forward-backward timer holds both, as Megatron-LM's (whose schedule ends with the reduction)."""
    if run.timeline is not None:
        run.timeline.take()  # --log-pipeline-timeline: this iteration's passes only
    if run.fp8 is not None:  # the iteration's casts record their amaxes (delayed scaling)
        run.fp8.start_iteration()
    with run.timers("forward-backward"):
        stats = run.forward_backward(batches=run.train_batches, model=run.model, num_microbatches=num_microbatches,
                                     comm=run.pipe_comm, backward_scale=backward_scale,
                                     microbatch_mean=not run.cfg.training.calculate_per_token_loss,
                                     wgrad_store=run.wgrad_store, timeline=run.timeline)
        if run.fp8 is not None:
            run.fp8.finish_iteration()
        empty_unused_memory(run, 1)
        with run.timers("all-grads-sync"):
            run.dp.finish_grad_sync()
    return stats


def train_step(run: Run) -> dict:
    t, state, optimizer = run.cfg.training, run.state, run.state.optimizer
    for m in run.model:
        m.train()
    # the global batch follows consumed_samples (ramp-up / step schedule; constant otherwise)
    global_batch = run.batch.current_global_batch_size(state.consumed_samples)
    num_microbatches = global_batch // (t.micro_batch_size * state.ps.dp_size)
    run.dp.set_num_microbatches(num_microbatches)
    nominal_tokens = global_batch * run.cfg.data.seq_length
    if t.calculate_per_token_loss:  # d(sum of token losses)/d(tokens of the global batch)
        backward_scale = optimizer.loss_scale / nominal_tokens
    else:  # Megatron-LM's default: the mean over micro-batches (and DP ranks) of each one's token mean
        backward_scale = optimizer.loss_scale / (num_microbatches * state.ps.dp_size)
    if t.test_mode:  # replicas of the query/key norms still equal (runtime/consistency.py)
        check_replicas(run.model, state.ps, state.iteration)
    check, guard = t.check_for_nan_in_loss_and_grad, run.spike_guard
    run_pass = functools.partial(iteration_pass, run, num_microbatches, backward_scale)
    if run.rerun is None:
        g = run_pass()[0]
    else:  # --rerun-mode: a rejected result is run again (runtime/rerun.py)
        g = validated_pass(run, run_pass, num_microbatches)
    if g.num_tokens == 0:
        raise RuntimeError(f"iteration {state.iteration + 1}: the global batch has no token with loss "
                           "(every token masked by --eod-mask-loss?)")
    scheduler, c = state.scheduler, run.cfg.optimizer
    lr = scheduler.get_lr()
    decoupled_lr = (scheduler.get_lr(max_lr=c.decoupled_lr, min_lr=c.decoupled_min_lr)
                    if c.decoupled_lr is not None else None)
    # undo the loss scale; per-token loss with masked tokens: renormalise from the nominal to the
    # true token count
    renormalise = nominal_tokens / g.num_tokens if t.calculate_per_token_loss else 1.0
    grad_scale = renormalise / optimizer.loss_scale
    if check:
        check_finite(run, g, grad_scale)
    loss = g.loss
    spike = guard.loss_spike(loss) if guard is not None else None
    clip = run.qk_clip.prepare() if run.qk_clip is not None else None  # collective: before any skip
    if spike is None and run.pending_save is not None:
        save_pending(run)  # this loss shows that the weights of the pending checkpoint still train
    if spike is not None:  # the update of the previous iteration broke the weights: do not build on them
        update = {"grad_norm": None, "loss_scale": optimizer.loss_scale, "skipped": True,
                  "spike": f"{spike} (largest local loss: rank {g.largest_loss_rank})"}
    else:
        with run.timers("optimizer"):
            update = optimizer.step(lr, grad_scale=grad_scale, iteration=state.iteration + 1,
                                    decoupled_lr=decoupled_lr,
                                    reject_grad_norm=guard.grad_norm_spike if guard is not None else None,
                                    after_update=(lambda pieces: run.qk_clip.apply(pieces, clip)) if clip else None)
        if update.get("spike") and g.grad_max:
            update["spike"] += f" (largest gradient element: rank {g.largest_grad_rank})"
    if guard is not None:
        after_guard(run, guard, loss, update)
    if check and not update["skipped"] and not math.isfinite(update["grad_norm"]):
        # finite gradients whose squares overflow fp32: the update itself stayed finite (clipping
        # zeroes it; Adam divides by the overflowed second moment), but training has diverged
        worst = g.largest_grad_rank
        raise NonFiniteError(
            f"iteration {state.iteration + 1}: the global gradient norm is {update['grad_norm']} (largest gradient "
            f"{g.grad_max[worst]:.3e}, on rank {worst}): training has diverged; stopped before any checkpoint of it. "
            f"Lower --lr or set --clip-grad (--no-check-for-nan-in-loss-and-grad turns this check off)")
    if not update["skipped"]:  # a step skipped for fp16 overflow does not advance the schedule
        scheduler.step(global_batch if scheduler.unit == "samples" else 1)
        if state.model_config.num_experts and state.model_config.moe_router_enable_expert_bias:
            moe_balance.update_expert_bias(run.model, state.ps.tp_dp_cp_group,
                                           state.model_config.moe_router_bias_update_rate)
    empty_unused_memory(run, 2)
    if run.qk_clip is not None:
        update["max_attention_logit"] = run.qk_clip.max_logit
    return {"lm_loss": loss, "lr": lr, "decoupled_lr": decoupled_lr, "mtp_losses": g.mtp_losses,
            "global_batch_size": global_batch, **update}


@torch.no_grad()
def evaluate(run: Run, split: str) -> dict | None:
    t, state = run.cfg.training, run.state
    dataset = run.datasets[1 if split == "valid" else 2]
    if dataset is None or t.eval_iters == 0:
        return None
    run.monitor.where = f"in the {split} evaluation after iteration {state.iteration}"
    manual_gc = t.manual_gc and t.manual_gc_eval  # as Megatron-LM: collect at both ends of an evaluation
    if manual_gc:
        gc.collect()
    for m in run.model:
        m.eval()
    batches = batch_iterators(run.cfg, dataset, 0, state.ps, state.device, run.eod)
    totals = [0.0, 0.0]
    for _ in range(t.eval_iters):
        stats = run.forward_backward(batches=batches, model=run.model, num_microbatches=t.eval_num_microbatches,
                                     comm=run.pipe_comm, backward_scale=0.0, forward_only=True)
        empty_unused_memory(run, 1)
        g = global_loss(run, stats)
        totals[0] += g.loss_sum
        totals[1] += g.num_tokens
    loss = totals[0] / max(totals[1], 1.0)
    record = {"iteration": state.iteration, "split": split, "lm_loss": loss, "ppl": perplexity(loss)}
    run.jsonl.write(record)
    run.tracker.log(record, state.iteration, split)
    line = f" {split} loss at iteration {state.iteration} | lm loss: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
    run.log("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    if manual_gc:
        gc.collect()
    return record


# -- the loop ---------------------------------------------------------------------------------------
def exit_reason(run: Run, start_time: float) -> str | None:
    """Why to stop after this iteration, agreed by every rank (flags are all-reduced)."""
    t = run.cfg.training
    flags = [float(t.exit_signal_handler and run.signal_received[0]),
             float(t.exit_duration_in_mins is not None and (time.time() - start_time) / 60 >= t.exit_duration_in_mins)]
    if t.exit_signal_handler or t.exit_duration_in_mins is not None:
        flags = comm.all_reduce(torch.tensor(flags, device=run.state.device), comm.world_group(),
                                op=dist.ReduceOp.MAX).tolist()
    if flags[0]:
        return "SIGTERM received"
    if flags[1]:
        return f"--exit-duration-in-mins {t.exit_duration_in_mins} reached"
    if t.exit_interval and run.state.iteration % t.exit_interval == 0:
        return f"--exit-interval {t.exit_interval} reached"
    return None


def save_checkpoint(run: Run) -> None:
    if run.saver is not None and run.last_saved != run.state.iteration:
        run.monitor.where = f"in the checkpoint save at iteration {run.state.iteration}"
        with run.timers("save-checkpoint"):
            run.saver.save(run.state, run.state.iteration)
        run.last_saved = run.state.iteration
        # as Megatron-LM: this save's own time, right after it (every rank saves at the same points)
        log_timers(run, ("save-checkpoint",), 1)


def checkpoint_due(run: Run) -> None:
    """A checkpoint at this iteration: now, or with the spike guard once the next loss is known."""
    if run.spike_guard is None:
        save_checkpoint(run)
    elif run.last_saved != run.state.iteration:
        from .checkpoint.native import rng_state
        run.pending_save = (run.state.iteration, rng_state(run.state))


def final_checkpoint(run: Run) -> None:
    """The checkpoint at the end of the run, unless its last update was skipped for a spike (its
    weights are the ones whose loss spiked)."""
    run.pending_save = None  # the same iteration's weights, or older: the final save covers it
    if run.last_step_spiked and run.saver is not None:
        run.log(f"> no checkpoint of iteration {run.state.iteration}: its update was skipped for a spike; the latest "
                f"checkpoint stays iteration {run.last_saved}")
        return
    save_checkpoint(run)


def check_weights(run: Run) -> None:
    """--check-weight-hash-across-dp-replicas-interval: the replicas' weights still equal
    (runtime/weight_hash.py); the parameters' all-gather of a sharded update is waited for first."""
    run.dp.finish_param_sync()
    params = [(n, p, param_info(p).expert_parallel) for n, p in run.state.named_params]
    check_weight_hashes(params, run.state.ps, run.state.iteration, run.state.device)
    run.log(f"> iteration {run.state.iteration}: weight hashes match across data-parallel replicas")


def train(run: Run) -> None:
    t = run.cfg.training
    if t.exit_signal_handler:  # the process's handler is put back when the run closes
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: run.signal_received.__setitem__(0, True))
        run.closing.callback(signal.signal, signal.SIGTERM, previous)
    if t.manual_gc:
        # no automatic collection: a rank that collects stalls all the others at its next
        # collective; collecting at the same iterations everywhere makes the pause common
        if gc.isenabled():
            run.closing.callback(gc.enable)  # an in-process caller gets its collector back
        gc.disable()
        gc.collect()
    if run.cfg.resilience.check_weight_hash_across_dp_replicas_interval:
        check_weights(run)  # as Megatron-LM: once before the first iteration too
    train_loop(run)


def new_window() -> dict:
    """What the log averages over its interval."""
    return {"lm_loss": 0.0, "iters": 0, "loss_iters": 0, "skipped": 0, "samples": 0, "mtp": {}}


def train_loop(run: Run) -> None:
    t, state = run.cfg.training, run.state
    timer = Timer(state.device)
    timer.reset()
    window = new_window()
    start_time, first_iteration = time.time(), state.iteration
    reason = None
    while state.iteration < t.train_iters and reason is None:
        run.monitor.where = f"in iteration {state.iteration + 1}"
        run.monitor.step_start = time.perf_counter()
        if run.straggler is not None:
            run.straggler.start_step()
        run.profiler.before_iteration(state.iteration)
        out = train_step(run)
        if run.straggler is not None:
            run.straggler.end_step()
        run.monitor.step_start = None
        state.iteration += 1
        if t.compile and state.iteration == first_iteration + 1:
            from .model.compile import compile_report  # compiled during this first step
            run.log(f"> compile: {compile_report()}")
        if t.manual_gc and t.manual_gc_interval and state.iteration % t.manual_gc_interval == 0:
            gc.collect()  # the same iterations on every rank
        state.consumed_samples += out["global_batch_size"]
        hash_interval = run.cfg.resilience.check_weight_hash_across_dp_replicas_interval
        if hash_interval and state.iteration % hash_interval == 0:
            check_weights(run)  # before this iteration's checkpoint can be written
        run.profiler.after_iteration(state.iteration)
        window["iters"] += 1
        window["samples"] += out["global_batch_size"]
        if out["skipped"]:  # a step skipped for fp16 overflow does not enter the average
            window["skipped"] += 1
        else:
            window["lm_loss"] += out["lm_loss"]
            window["loss_iters"] += 1
            for k, v in enumerate(out.get("mtp_losses") or ()):  # MTP: per depth, averaged like the LM loss
                window["mtp"][k] = window["mtp"].get(k, 0.0) + v
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters:
            report(run, out, window, timer.elapsed())
            window = new_window()
            timer.reset()
        if state.iteration % t.eval_interval == 0 and state.iteration != t.train_iters:
            evaluate(run, "valid")
        if run.saver is not None:
            run.saver.finalize(blocking=False)
            if run.cfg.checkpoint.save_interval and state.iteration % run.cfg.checkpoint.save_interval == 0:
                checkpoint_due(run)
        if run.non_persistent is not None and run.non_persistent.due(state.iteration) \
                and run.last_saved != state.iteration:  # (a persistent save of this iteration holds it)
            run.non_persistent.save(state, state.iteration)
        reason = exit_reason(run, start_time)
    run.profiler.stop()
    # --overlap-param-gather: the last step's gathers would otherwise be left in flight (stale
    # parameters for evaluation and the final save; an abort at exit under gloo)
    run.dp.finish_param_sync()
    if reason is None:
        evaluate(run, "valid")
        evaluate(run, "test")
    final_checkpoint(run)
    if run.saver is not None:
        run.saver.finalize(blocking=True)
    if reason is not None:
        run.log(f"> exiting at iteration {state.iteration}: {reason}")


def pretrain(cfg: RunConfig, memory=None) -> TrainState:
    """Train as `cfg` says. Everything the run opens (process groups, the collective monitor and
    its thread, hooks, files, signal handlers, the garbage collector's state) is closed or put back
    when it ends, normally or not: one process can train many times (inprocess/worker.py's `memory`)."""
    run = setup(cfg, memory)
    with run.closing:
        train(run)
        run.monitor.where = "at the end of training"
        comm.barrier()
    return run.state
