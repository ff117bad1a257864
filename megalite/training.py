"""The training loop, top-down: pretrain -> train -> train_step -> pipeline schedule (model
forward/backward per micro-batch) -> DataParallel.finish_grad_sync -> optimizer.step.

`pretrain` takes a RunConfig (built from the flags at the entry point), builds each piece from
its own config, and hands the loop a `Run`: the pieces one iteration touches. Checkpoints see
only the TrainState inside it.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm, parallel_state
from .checkpoint.load import load_checkpoint
from .checkpoint.save import CheckpointSaver
from .checkpoint.state import TrainState
from .config import ParallelConfig, RunConfig
from .data.batch import micro_batches
from .distributed import DataParallel, get_strategy
from .errors import UserError
from .runtime.metrics import (JsonlWriter, Timer, console_line, memory_record, memory_string, num_floating_point_operations,
                      peak_tflops, perplexity)
from .model import GPTConfig, GPTModel, pad_vocab_size
from .runtime.monitor import CommMonitor
from .num_microbatches_calculator import NumMicroBatchesCalculator, build_num_microbatches_calculator
from .model.init import initial_value
from .optimizer import build_lr_scheduler, build_optimizer
from .pipeline_parallel import default_schedule_name, get_schedule
from .pipeline_parallel.p2p import PipeComm
from .runtime.profiling import Profiler
from .runtime.straggler import StragglerDetector
from .tensor_parallel import seed_everything
from .tensor_parallel.param_info import param_info
from .runtime.tracking import Tracker


@dataclass
class Run:
    """What the loop holds for one rank."""
    cfg: RunConfig
    state: TrainState
    model: list
    dp: DataParallel
    datasets: list  # train, valid, test (None where empty)
    eod: int | None
    train_batches: list  # one micro-batch iterator per model chunk
    forward_backward: object
    pipe_comm: PipeComm
    jsonl: JsonlWriter
    tracker: Tracker
    saver: CheckpointSaver | None
    batch: NumMicroBatchesCalculator  # the global batch for each iteration, from consumed_samples
    profiler: Profiler
    peak: float | None
    monitor: CommMonitor
    straggler: StragglerDetector | None = None  # --log-straggler
    signal_received: list = field(default_factory=lambda: [False])

    def log(self, msg: str) -> None:
        self.state.log(msg)


# -- set up -----------------------------------------------------------------------------------------
def initialize_distributed(cfg: ParallelConfig) -> tuple[parallel_state.ParallelState, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    use_cuda = cfg.distributed_backend == "nccl"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        comm.init_distributed(cfg.distributed_backend, cfg.distributed_timeout_minutes,
                              device_id=device if use_cuda else None)
    ps = parallel_state.initialize(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                   cfg.virtual_pipeline_model_parallel_size, cfg.rank_order,
                                   timeout_minutes=cfg.distributed_timeout_minutes, cp=cfg.context_parallel_size)
    return ps, device


def resolve_vocab(cfg: RunConfig) -> tuple[GPTConfig, int | None]:
    """The model config with the vocabulary size filled in (from the tokenizer unless
    --vocab-size is given) and padded as Megatron-LM does; and the end-of-document id."""
    data, tp = cfg.data, cfg.parallel.tensor_model_parallel_size
    vocab_size, eod = data.vocab_size, None
    if not (data.mock_data and data.tokenizer_type is None):
        from .data.tokenizers import build_tokenizer, model_vocab_size
        tokenizer = build_tokenizer(data)
        vocab_size = model_vocab_size(data, tokenizer)  # NullTokenizer: --vocab-size + 1 (its eod)
        eod = tokenizer.eod
    padded = pad_vocab_size(vocab_size, data.make_vocab_size_divisible_by, tp)
    cfg.flags.update(vocab_size=vocab_size, padded_vocab_size=padded)
    return dataclasses.replace(cfg.model, vocab_size=vocab_size, padded_vocab_size=padded), eod


def build_model(config: GPTConfig, ps, seed: int, device: torch.device, on_meta: bool = False):
    """This rank's model chunks (one per virtual pipeline stage), initialised layout-invariantly,
    and the TP RNG tracker their dropout uses. `on_meta` (ZeRO-3): parameters without storage,
    which DataParallel materialises straight into this rank's slices."""
    rng_tracker = seed_everything(seed, ps.tp_rank, ps.pp_rank, device)
    chunks = []
    layers = parallel_state.stage_layers(config.num_layers, ps.pp_size, ps.vpp, ps.pp_rank)
    for c, (offset, n) in enumerate(layers):
        chunk = GPTModel(config, ps.tp_group, rng_tracker, pre_process=ps.is_first_stage and c == 0,
                         post_process=ps.is_last_stage and c == ps.vpp - 1, layer_offset=offset, num_layers=n,
                         device="meta" if on_meta else device, cp_group=ps.cp_group)
        if not on_meta:
            chunk.initialize(seed)
        chunks.append(chunk)
    return chunks, rng_tracker


def build_datasets(cfg: RunConfig, model_vocab_size: int | None = None) -> list:
    """(train, valid, test) sized for --train-samples (or --train-iters global batches) and
    --eval-iters global batches. Token ids are checked against `model_vocab_size` (NullTokenizer's
    --vocab-size N leaves out its eod id N)."""
    t, data = cfg.training, cfg.data
    train = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    num_samples = (train, t.eval_iters * t.global_batch_size, t.eval_iters * t.global_batch_size)
    if data.mock_data:
        from .data.mock import MockGPTDataset
        return [MockGPTDataset(n, data.seq_length, data.vocab_size, data.seed + i) if n else None
                for i, n in enumerate(num_samples)]
    from .data.builder import build_train_valid_test_datasets
    if model_vocab_size is not None:
        data = dataclasses.replace(data, vocab_size=model_vocab_size)
    return list(build_train_valid_test_datasets(data, num_samples))


def batch_iterators(cfg: RunConfig, dataset, consumed: int, ps, device, eod, straggler=None) -> list:
    """One micro-batch iterator per model chunk: every chunk consumes the iteration's
    micro-batches in order, at its own pace in the schedule. With a straggler detector, the
    time spent in them is timed as data wait."""
    its = [micro_batches(dataset, consumed, cfg.data, ps, device, eod) for _ in range(ps.vpp)]
    return [straggler.data_iterator(it) for it in its] if straggler is not None else its


def setup(cfg: RunConfig) -> Run:
    if cfg.training.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    ps, device = initialize_distributed(cfg.parallel)
    t = cfg.training
    # every blocking collective from here on is seen by the monitor (timeouts name where the run
    # stood; --log-straggler times the waits)
    monitor = CommMonitor(ps, device, cfg.parallel.distributed_timeout_minutes, time_waits=t.log_straggler)
    comm.set_monitor(monitor)  # pretrain() stops it and uninstalls it, whatever happens
    monitor.start_watchdog()
    model_config, eod = resolve_vocab(cfg)
    zero3 = get_strategy(cfg.ddp.data_parallel_sharding_strategy).shards_params
    model, rng_tracker = build_model(model_config, ps, cfg.training.seed, device, on_meta=zero3)
    if cfg.training.compile:  # --compile: each transformer layer, in place (model/compile.py)
        from .model.compile import compile_layers
        n = compile_layers(model)
        if ps.rank == ps.logging_rank:
            print(f"> compile: torch.compile of {n} transformer layers (Inductor)", flush=True)
    named_params = [(n, p) for m in model for n, p in m.global_named_parameters()]
    names = {p: n for n, p in named_params}
    dp = DataParallel(model, [p for _, p in named_params], ps, cfg.ddp, cfg.training.num_microbatches, device=device,
                      init_fn=lambda p: initial_value(p, names[p], cfg.training.seed, ps.tp_group))
    optimizer = build_optimizer(named_params, cfg.optimizer, dp, ps)
    state = TrainState(ps, model_config, named_params, optimizer, build_lr_scheduler(cfg.optimizer), rng_tracker,
                       device, cfg.flags)
    state.log(f"> optimizer: {optimizer.describe()}")
    ck = cfg.checkpoint
    if ck.load:
        monitor.where = "in the checkpoint load"
        state.iteration = load_checkpoint(state, ck.load, finetune=ck.finetune, load_optim=not ck.no_load_optim,
                                          load_rng=not ck.no_load_rng)
        monitor.where = "at start-up"
    datasets = build_datasets(cfg, model_config.vocab_size)
    # activations between stages: this rank's s/c tokens (CP), split over TP under sequence parallelism
    s = cfg.data.seq_length // ps.cp_size // (ps.tp_size if model_config.sequence_parallel else 1)
    logging_rank = ps.rank == ps.logging_rank
    straggler = StragglerDetector(ps, device, monitor) if t.log_straggler else None
    run = Run(cfg=cfg, state=state, model=model, dp=dp, datasets=datasets, eod=eod,
              train_batches=batch_iterators(cfg, datasets[0], state.consumed_samples, ps, device, eod, straggler),
              forward_backward=get_schedule(default_schedule_name(ps.pp_size, ps.vpp)),
              pipe_comm=PipeComm(ps, (s, cfg.data.micro_batch_size, model_config.hidden_size),
                                 model_config.params_dtype, device),
              jsonl=JsonlWriter(cfg.training.log_jsonl if logging_rank else None),
              tracker=Tracker(cfg.tracking, enabled=logging_rank),  # W&B / TensorBoard
              saver=CheckpointSaver(ck.save, ck.async_save, check_finite=t.check_for_nan_in_loss_and_grad)
              if ck.save else None,
              batch=build_num_microbatches_calculator(cfg.training, ps.dp_size),
              profiler=Profiler(cfg.training, ps.rank, device),
              peak=peak_tflops(cfg.training.peak_tflops, model_config.params_dtype), monitor=monitor,
              straggler=straggler)
    run.tracker.log_config(cfg.flags)
    log_startup(run)
    if state.load_stats is not None:
        log_checkpoint_load(run)
    return run


def log_startup(run: Run) -> None:
    ps, c, t = run.state.ps, run.state.model_config, run.cfg.training
    from .runtime.cpu import slow_bf16_warning  # --bf16 on a CPU without native bf16: say it once
    if (warning := slow_bf16_warning(run.state.device, c.params_dtype)) is not None:
        run.log(warning)
    if c.use_flash_attn:
        attention = "flash-attn"
    elif c.attention_backend == "local":
        attention = "megalite's local softmax(QK^T)V"
    else:
        kernels = "" if c.attention_backend == "auto" else f" ({c.attention_backend} kernels)"
        attention = "torch scaled_dot_product_attention" + kernels
    for notice in run.cfg.notices:
        run.log(f"> note: {notice}")
    run.log(f"> megalite: {ps.describe()}, {t.num_microbatches} micro-batches of {t.micro_batch_size} "
            f"per iteration (global batch {t.global_batch_size})")
    if run.batch.steps is not None or run.batch.rampup is not None:
        run.log(f"> batch schedule: {run.batch.describe()}; {t.train_iters} iterations")
    run.log(f"> model: {count_parameters(run.state) / 1e6:.2f}M parameters, {c.num_layers} layers, "
            f"hidden {c.hidden_size}, {c.num_attention_heads} heads, vocab {c.vocab_size} (padded "
            f"{c.padded_vocab_size}), seq {c.seq_length}, {str(c.params_dtype).replace('torch.', '')}, attention: "
            f"{attention}, device: {run.state.device.type}, backend: "
            f"{run.cfg.parallel.distributed_backend if dist.is_initialized() else 'none'}")
    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank, "cp": ps.cp_rank,
            "num_params": sum(p.numel() for _, p in run.state.named_params),
            "param_bytes": run.dp.param_bytes,  # ZeRO-1/2: the flat buffer with padding; ZeRO-3: this rank's slices
            "grad_bytes": run.dp.grad_bytes,
            "optimizer_bytes": run.state.optimizer.state_bytes()}  # fp32 masters + Adam m, v (this rank's shard)
    run.jsonl.write({"event": "memory_footprint", "ranks": comm.all_gather_object(mine, comm.world_group())})
    if run.straggler is not None and run.state.device.type == "cuda" and run.straggler.gpu_unavailable:
        run.log(f"> --log-straggler: GPU power, temperature and clock not reported ({run.straggler.gpu_unavailable}; "
                "pip install nvidia-ml-py)")


def log_checkpoint_load(run: Run) -> None:
    """One `checkpoint_load` JSONL record per rank (gathered to the logging rank, which owns the
    JSONL file) and a summary line: what each rank read to resume."""
    ps, stats = run.state.ps, run.state.load_stats
    mine = {"event": "checkpoint_load", "rank": ps.rank, "bytes_read": stats.bytes_read,
            "files_opened": stats.files_opened, "seconds": round(stats.seconds, 3)}
    records = comm.gather_object(mine, ps.logging_rank, comm.world_group())
    if records is None:
        return
    for r in records:
        run.jsonl.write(r)
    most = max(records, key=lambda r: r["bytes_read"])
    files = max(records, key=lambda r: r["files_opened"])
    run.log(f"> checkpoint load: {sum(r['bytes_read'] for r in records) / 2**20:.2f} MiB read by {len(records)} "
            f"rank(s); at most {most['bytes_read'] / 2**20:.2f} MiB (rank {most['rank']}) and "
            f"{files['files_opened']} files (rank {files['rank']}) on one rank")


def count_parameters(state: TrainState) -> int:
    """Parameters of the whole model, each counted once: replicated copies (TP, tied embedding
    on the last stage, DP and CP replicas) are skipped."""
    ps = state.ps
    local = sum(p.numel() for _, p in state.named_params if param_info(p).is_owner(ps.tp_rank))
    return int(sum(comm.all_gather_object(local if ps.dp_rank == 0 and ps.cp_rank == 0 else 0, comm.world_group())))


# -- one iteration ----------------------------------------------------------------------------------
class NonFiniteError(UserError):
    """--check-for-nan-in-loss-and-grad: the loss or the gradients hold a NaN or an Inf."""


def global_loss(run: Run, stats, grads: list | None = None) -> tuple[float, float, list, list]:
    """(sum of token losses, number of loss tokens) over the global batch: only the last
    stage's TP rank 0 of each DP replica contributes (each CP rank of it its own chunks' tokens),
    so every token counts once. Summed on
    the device; one host read per call.

    With `grads` (--check-for-nan-in-loss-and-grad) the same all-reduce also carries, per global
    rank, whether its own loss sum is finite and the largest magnitude in its reduced gradients
    (each rank writes its own slot, the rest are zeros): every rank learns which ranks hold a
    NaN/Inf without another collective. Returns those two lists too (empty without `grads`)."""
    ps = run.state.ps
    world = ps.world_size if grads is not None else 0
    t = torch.zeros(2 + 2 * world, dtype=torch.float64, device=run.state.device)
    if ps.is_last_stage and ps.tp_rank == 0 and stats:
        mine = torch.stack([torch.stack([s.double(), n.double()]) for s, n in stats]).sum(0)
        t[:2] += mine
        if grads is not None:
            t[2 + ps.rank] = (~torch.isfinite(mine[0])).double()
    if grads:  # max |g| (NaN wins, as torch.max propagates it)
        t[2 + world + ps.rank] = torch.stack(torch._foreach_norm(grads, float("inf"))).max().double()
    comm.all_reduce(t, comm.world_group())
    values = t.tolist()
    return values[0], values[1], values[2:2 + world], values[2 + world:]


def check_finite(run: Run, loss_sum: float, bad_loss: list, grad_max: list, grad_scale: float) -> None:
    """Stop before the optimizer step when the loss, or (without loss scaling, whose skip path
    owns overflows) the gradients the step would apply, hold a NaN or an Inf."""
    iteration = run.state.iteration + 1
    losses = [r for r, flag in enumerate(bad_loss) if flag]
    # the step multiplies the gradients by grad_scale in fp32: an overflow there counts too
    grads = [] if run.state.optimizer.scaler is not None else \
        [r for r, m in enumerate(grad_max) if not math.isfinite(m) or m * grad_scale > torch.finfo(torch.float32).max]
    if not (losses or grads):
        return
    what = []
    if losses:
        what.append(f"the loss is {loss_sum} (non-finite on rank(s) {losses}, the last pipeline stage)")
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


def train_step(run: Run) -> dict:
    t, state, optimizer = run.cfg.training, run.state, run.state.optimizer
    for m in run.model:
        m.train()
    # the global batch follows consumed_samples (ramp-up / step schedule; constant otherwise)
    global_batch = run.batch.current_global_batch_size(state.consumed_samples)
    num_microbatches = global_batch // (t.micro_batch_size * state.ps.dp_size)
    run.dp.set_num_microbatches(num_microbatches)
    run.dp.zero_grad()
    nominal_tokens = global_batch * run.cfg.data.seq_length
    if t.calculate_per_token_loss:  # d(sum of token losses)/d(tokens of the global batch)
        backward_scale = optimizer.loss_scale / nominal_tokens
    else:  # Megatron-LM's default: the mean over micro-batches (and DP ranks) of each one's token mean
        backward_scale = optimizer.loss_scale / (num_microbatches * state.ps.dp_size)
    stats = run.forward_backward(batches=run.train_batches, model=run.model, num_microbatches=num_microbatches,
                                 comm=run.pipe_comm, backward_scale=backward_scale,
                                 microbatch_mean=not t.calculate_per_token_loss)
    empty_unused_memory(run, 1)
    run.dp.finish_grad_sync()
    check = t.check_for_nan_in_loss_and_grad
    loss_sum, num_tokens, bad_loss, grad_max = global_loss(run, stats, optimizer.main_grads if check else None)
    if num_tokens == 0:
        raise RuntimeError(f"iteration {state.iteration + 1}: the global batch has no token with loss "
                           "(every token masked by --eod-mask-loss?)")
    scheduler, c = state.scheduler, run.cfg.optimizer
    lr = scheduler.get_lr()
    decoupled_lr = (scheduler.get_lr(max_lr=c.decoupled_lr, min_lr=c.decoupled_min_lr)
                    if c.decoupled_lr is not None else None)
    # undo the loss scale; per-token loss with masked tokens: renormalise from the nominal to the
    # true token count
    renormalise = nominal_tokens / num_tokens if t.calculate_per_token_loss else 1.0
    grad_scale = renormalise / optimizer.loss_scale
    if check:
        check_finite(run, loss_sum, bad_loss, grad_max, grad_scale)
    update = optimizer.step(lr, grad_scale=grad_scale, iteration=state.iteration + 1, decoupled_lr=decoupled_lr)
    if check and not update["skipped"] and not math.isfinite(update["grad_norm"]):
        # finite gradients whose squares overflow fp32: the update itself stayed finite (clipping
        # zeroes it; Adam divides by the overflowed second moment), but training has diverged
        worst = max(range(len(grad_max)), key=grad_max.__getitem__)
        raise NonFiniteError(
            f"iteration {state.iteration + 1}: the global gradient norm is {update['grad_norm']} (largest gradient "
            f"{grad_max[worst]:.3e}, on rank {worst}): training has diverged; stopped before any checkpoint of it. "
            f"Lower --lr or set --clip-grad (--no-check-for-nan-in-loss-and-grad turns this check off)")
    if not update["skipped"]:  # a step skipped for fp16 overflow does not advance the schedule
        scheduler.step(global_batch if scheduler.unit == "samples" else 1)
    empty_unused_memory(run, 2)
    return {"lm_loss": loss_sum / num_tokens, "lr": lr, "decoupled_lr": decoupled_lr,
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
        stats = run.forward_backward(batches=batches, model=run.model, num_microbatches=t.num_microbatches,
                                     comm=run.pipe_comm, backward_scale=0.0, forward_only=True)
        empty_unused_memory(run, 1)
        loss_sum, num_tokens, _, _ = global_loss(run, stats)
        totals[0] += loss_sum
        totals[1] += num_tokens
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


def save_checkpoint(run: Run, last_saved: list) -> None:
    if run.saver is not None and last_saved[0] != run.state.iteration:
        run.monitor.where = f"in the checkpoint save at iteration {run.state.iteration}"
        run.saver.save(run.state, run.state.iteration)
        last_saved[0] = run.state.iteration


def train(run: Run) -> None:
    t, state = run.cfg.training, run.state
    timer = Timer(state.device)
    timer.reset()
    window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0, "skipped": 0, "samples": 0}
    start_time, last_saved, first_iteration = time.time(), [state.iteration], state.iteration
    if t.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: run.signal_received.__setitem__(0, True))
    if t.manual_gc:
        # no automatic collection: a rank that collects stalls all the others at its next
        # collective; collecting at the same iterations everywhere makes the pause common
        gc.disable()
        gc.collect()
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
        run.profiler.after_iteration(state.iteration)
        window["iters"] += 1
        window["samples"] += out["global_batch_size"]
        if out["skipped"]:  # a step skipped for fp16 overflow does not enter the average
            window["skipped"] += 1
        else:
            window["lm_loss"] += out["lm_loss"]
            window["loss_iters"] += 1
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters:
            report(run, out, window, timer.elapsed())
            window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0, "skipped": 0, "samples": 0}
            timer.reset()
        if state.iteration % t.eval_interval == 0 and state.iteration != t.train_iters:
            evaluate(run, "valid")
        if run.saver is not None:
            run.saver.finalize(blocking=False)
            if run.cfg.checkpoint.save_interval and state.iteration % run.cfg.checkpoint.save_interval == 0:
                save_checkpoint(run, last_saved)
        reason = exit_reason(run, start_time)
    run.profiler.stop()
    # --overlap-param-gather: the last step's gathers would otherwise be left in flight (stale
    # parameters for evaluation and the final save; an abort at exit under gloo)
    run.dp.finish_param_sync()
    if reason is None:
        evaluate(run, "valid")
        evaluate(run, "test")
    save_checkpoint(run, last_saved)
    if run.saver is not None:
        run.saver.finalize(blocking=True)
    if reason is not None:
        run.log(f"> exiting at iteration {state.iteration}: {reason}")
    if t.manual_gc:
        gc.enable()  # leave an in-process caller the collector it had
    run.jsonl.close()
    run.tracker.close()


def params_norm(run: Run) -> float:
    """--log-params-norm: the L2 norm of the whole model's parameters, each counted once (from
    DP rank 0's whole parameters, or under ZeRO-3 from every DP rank's slices)."""
    ps, dp = run.state.ps, run.dp
    t = torch.zeros(1, dtype=torch.float64, device=run.state.device)
    dp.finish_param_sync()  # every rank: pending ZeRO-1/2 gathers would leave stale values
    if dp.strategy.shards_params or (ps.dp_rank == 0 and ps.cp_rank == 0):
        for p, _, _, stored in dp.param_pieces():
            if param_info(p).is_owner(ps.tp_rank):
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
        "skipped_iterations": window["skipped"],  # steps skipped for fp16 overflow since the last report
    }
    if out.get("decoupled_lr") is not None:
        record["decoupled_lr"] = out["decoupled_lr"]
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


def pretrain(cfg: RunConfig) -> TrainState:
    try:
        run = setup(cfg)
        train(run)
        run.monitor.where = "at the end of training"
        comm.barrier()
    finally:  # the watchdog thread must be gone before torch.distributed is torn down
        monitor = comm.set_monitor(None)
        if monitor is not None:
            monitor.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    return run.state
