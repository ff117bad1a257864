"""The training loop, top-down: pretrain -> train -> train_step -> pipeline schedule (model
forward/backward per micro-batch) -> DataParallel.finish_grad_sync -> optimizer.step.

`pretrain` takes a RunConfig (built from the flags at the entry point), builds each piece from
its own config, and hands the loop a `Run`: the pieces one iteration touches. Checkpoints see
only the TrainState inside it.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm, parallel_state
from .checkpointing import CheckpointSaver, TrainState, load_checkpoint
from .config import ParallelConfig, RunConfig
from .data.batch import micro_batches
from .distributed import DataParallel
from .metrics import (JsonlWriter, Timer, console_line, memory_string, num_floating_point_operations, peak_tflops,
                      perplexity)
from .model import GPTConfig, GPTModel, pad_vocab_size
from .model.init import initial_value
from .optimizer import build_lr_scheduler, build_optimizer
from .pipeline_parallel import get_forward_backward_func
from .pipeline_parallel.p2p import PipeComm
from .tensor_parallel import seed_everything
from .tensor_parallel.param_info import param_info
from .tracking import Tracker


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
    flops_per_iteration: float
    peak: float | None
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
        dist.init_process_group(backend=cfg.distributed_backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if use_cuda else None)
    ps = parallel_state.initialize(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                   cfg.virtual_pipeline_model_parallel_size, cfg.rank_order)
    return ps, device


def resolve_vocab(cfg: RunConfig) -> tuple[GPTConfig, int | None]:
    """The model config with the vocabulary size filled in (from the tokenizer unless
    --vocab-size is given) and padded as Megatron-LM does; and the end-of-document id."""
    data, tp = cfg.data, cfg.parallel.tensor_model_parallel_size
    vocab_size, eod = data.vocab_size, None
    if not (data.mock_data and data.tokenizer_type is None):
        from .data.tokenizers import build_tokenizer
        tokenizer = build_tokenizer(data)
        if vocab_size is None:
            vocab_size = tokenizer.vocab_size
        elif vocab_size < tokenizer.vocab_size:
            raise ValueError(f"--vocab-size ({vocab_size}) is smaller than the tokenizer's vocabulary "
                             f"({tokenizer.vocab_size})")
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
                         device="meta" if on_meta else device)
        if not on_meta:
            chunk.initialize(seed)
        chunks.append(chunk)
    return chunks, rng_tracker


def build_datasets(cfg: RunConfig) -> list:
    """(train, valid, test) sized for --train-iters and --eval-iters global batches."""
    t, data = cfg.training, cfg.data
    num_samples = (t.train_iters * t.global_batch_size, t.eval_iters * t.global_batch_size,
                   t.eval_iters * t.global_batch_size)
    if data.mock_data:
        from .data.mock import MockGPTDataset
        return [MockGPTDataset(n, data.seq_length, data.vocab_size, data.seed + i) if n else None
                for i, n in enumerate(num_samples)]
    from .data.builder import build_train_valid_test_datasets
    return list(build_train_valid_test_datasets(data, num_samples))


def batch_iterators(cfg: RunConfig, dataset, consumed: int, ps, device, eod) -> list:
    """One micro-batch iterator per model chunk: every chunk consumes the iteration's
    micro-batches in order, at its own pace in the schedule."""
    return [micro_batches(dataset, consumed, cfg.data, ps, device, eod) for _ in range(ps.vpp)]


def setup(cfg: RunConfig) -> Run:
    ps, device = initialize_distributed(cfg.parallel)
    model_config, eod = resolve_vocab(cfg)
    zero3 = cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    model, rng_tracker = build_model(model_config, ps, cfg.training.seed, device, on_meta=zero3)
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
        state.iteration = load_checkpoint(state, ck.load, finetune=ck.finetune, load_optim=not ck.no_load_optim,
                                          load_rng=not ck.no_load_rng)
    datasets = build_datasets(cfg)
    s = cfg.data.seq_length // (ps.tp_size if model_config.sequence_parallel else 1)
    logging_rank = ps.rank == ps.logging_rank
    run = Run(cfg=cfg, state=state, model=model, dp=dp, datasets=datasets, eod=eod,
              train_batches=batch_iterators(cfg, datasets[0], state.consumed_samples, ps, device, eod),
              forward_backward=get_forward_backward_func(ps.pp_size, ps.vpp),
              pipe_comm=PipeComm(ps, (s, cfg.data.micro_batch_size, model_config.hidden_size),
                                 model_config.params_dtype, device),
              jsonl=JsonlWriter(cfg.training.log_jsonl if logging_rank else None),
              tracker=Tracker(cfg.tracking, enabled=logging_rank),  # W&B / TensorBoard
              saver=CheckpointSaver(ck.save, ck.async_save) if ck.save else None,
              flops_per_iteration=num_floating_point_operations(model_config, cfg.training.global_batch_size),
              peak=peak_tflops(cfg.training.peak_tflops, model_config.params_dtype))
    run.tracker.log_config(cfg.flags)
    log_startup(run)
    return run


def log_startup(run: Run) -> None:
    ps, c, t = run.state.ps, run.state.model_config, run.cfg.training
    attention = "flash-attn" if c.use_flash_attn else "torch scaled_dot_product_attention"
    run.log(f"> megalite: {ps.describe()}, {t.num_microbatches} micro-batches of {t.micro_batch_size} "
            f"per iteration (global batch {t.global_batch_size})")
    run.log(f"> model: {count_parameters(run.state) / 1e6:.2f}M parameters, {c.num_layers} layers, "
            f"hidden {c.hidden_size}, {c.num_attention_heads} heads, vocab {c.vocab_size} (padded "
            f"{c.padded_vocab_size}), seq {c.seq_length}, {str(c.params_dtype).replace('torch.', '')}, attention: "
            f"{attention}, device: {run.state.device.type}, backend: "
            f"{run.cfg.parallel.distributed_backend if dist.is_initialized() else 'none'}")
    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank,
            "num_params": sum(p.numel() for _, p in run.state.named_params),
            "param_bytes": run.dp.param_bytes,  # ZeRO-1/2: the flat buffer with padding; ZeRO-3: this rank's slices
            "grad_bytes": run.dp.grad_bytes,
            "optimizer_bytes": run.state.optimizer.state_bytes()}  # fp32 masters + Adam m, v (this rank's shard)
    run.jsonl.write({"event": "memory_footprint", "ranks": comm.all_gather_object(mine, comm.world_group())})


def count_parameters(state: TrainState) -> int:
    """Parameters of the whole model, each counted once: replicated copies (TP, tied embedding
    on the last stage, DP replicas) are skipped."""
    ps = state.ps
    local = sum(p.numel() for _, p in state.named_params if param_info(p).is_owner(ps.tp_rank))
    return int(sum(comm.all_gather_object(local if ps.dp_rank == 0 else 0, comm.world_group())))


# -- one iteration ----------------------------------------------------------------------------------
def global_loss(run: Run, stats) -> tuple[float, float]:
    """(sum of token losses, number of loss tokens) over the global batch: only the last
    stage's TP rank 0 of each DP replica contributes, so every sample counts once. Summed on
    the device; one host read per call."""
    ps = run.state.ps
    t = torch.zeros(2, dtype=torch.float64, device=run.state.device)
    if ps.is_last_stage and ps.tp_rank == 0 and stats:
        t += torch.stack([torch.stack([s.double(), n.double()]) for s, n in stats]).sum(0)
    comm.all_reduce(t, comm.world_group())
    loss_sum, num_tokens = t.tolist()
    return loss_sum, num_tokens


def train_step(run: Run) -> dict:
    t, state, optimizer = run.cfg.training, run.state, run.state.optimizer
    for m in run.model:
        m.train()
    run.dp.zero_grad()
    nominal_tokens = t.global_batch_size * run.cfg.data.seq_length
    stats = run.forward_backward(batches=run.train_batches, model=run.model, num_microbatches=t.num_microbatches,
                                 comm=run.pipe_comm, backward_scale=optimizer.loss_scale / nominal_tokens)
    run.dp.finish_grad_sync()
    loss_sum, num_tokens = global_loss(run, stats)
    if num_tokens == 0:
        raise RuntimeError(f"iteration {state.iteration + 1}: the global batch has no token with loss "
                           "(every token masked by --eod-mask-loss?)")
    lr = state.scheduler.get_lr()
    # undo the loss scale; masked tokens: renormalise from the nominal to the true token count
    update = optimizer.step(lr, grad_scale=nominal_tokens / num_tokens / optimizer.loss_scale,
                            iteration=state.iteration + 1)
    if not update["skipped"]:  # a step skipped for fp16 overflow does not advance the schedule
        state.scheduler.step()
    return {"lm_loss": loss_sum / num_tokens, "lr": lr, **update}


@torch.no_grad()
def evaluate(run: Run, split: str) -> dict | None:
    t, state = run.cfg.training, run.state
    dataset = run.datasets[1 if split == "valid" else 2]
    if dataset is None or t.eval_iters == 0:
        return None
    for m in run.model:
        m.eval()
    batches = batch_iterators(run.cfg, dataset, 0, state.ps, state.device, run.eod)
    totals = [0.0, 0.0]
    for _ in range(t.eval_iters):
        stats = run.forward_backward(batches=batches, model=run.model, num_microbatches=t.num_microbatches,
                                     comm=run.pipe_comm, backward_scale=0.0, forward_only=True)
        loss_sum, num_tokens = global_loss(run, stats)
        totals[0] += loss_sum
        totals[1] += num_tokens
    loss = totals[0] / max(totals[1], 1.0)
    record = {"iteration": state.iteration, "split": split, "lm_loss": loss, "ppl": perplexity(loss)}
    run.jsonl.write(record)
    run.tracker.log(record, state.iteration, split)
    line = f" {split} loss at iteration {state.iteration} | lm loss: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
    run.log("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
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
        run.saver.save(run.state, run.state.iteration)
        last_saved[0] = run.state.iteration


def train(run: Run) -> None:
    t, state = run.cfg.training, run.state
    timer = Timer(state.device)
    timer.reset()
    window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0, "skipped": 0}
    start_time, last_saved = time.time(), [state.iteration]
    if t.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: run.signal_received.__setitem__(0, True))
    reason = None
    while state.iteration < t.train_iters and reason is None:
        out = train_step(run)
        state.iteration += 1
        state.consumed_samples += t.global_batch_size
        window["iters"] += 1
        if out["skipped"]:  # a step skipped for fp16 overflow does not enter the average
            window["skipped"] += 1
        else:
            window["lm_loss"] += out["lm_loss"]
            window["loss_iters"] += 1
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters:
            report(run, out, window, timer.elapsed())
            window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0, "skipped": 0}
            timer.reset()
        if state.iteration % t.eval_interval == 0 and state.iteration != t.train_iters:
            evaluate(run, "valid")
        if run.saver is not None:
            run.saver.finalize(blocking=False)
            if run.cfg.checkpoint.save_interval and state.iteration % run.cfg.checkpoint.save_interval == 0:
                save_checkpoint(run, last_saved)
        reason = exit_reason(run, start_time)
    run.dp.finish_param_sync()  # --overlap-param-gather: the last step's gathers, otherwise left in flight
    if reason is None:
        evaluate(run, "valid")
        evaluate(run, "test")
    save_checkpoint(run, last_saved)
    if run.saver is not None:
        run.saver.finalize(blocking=True)
    if reason is not None:
        run.log(f"> exiting at iteration {state.iteration}: {reason}")
    run.jsonl.close()
    run.tracker.close()


def report(run: Run, out: dict, window: dict, elapsed_s: float) -> None:
    t, state = run.cfg.training, run.state
    sec_per_iter = elapsed_s / window["iters"]
    tflops = run.flops_per_iteration / (sec_per_iter * state.ps.world_size) / 1e12
    record = {
        "iteration": state.iteration, "consumed_samples": state.consumed_samples,
        "lm_loss": window["lm_loss"] / window["loss_iters"] if window["loss_iters"] else out["lm_loss"],
        "lr": out["lr"], "grad_norm": out["grad_norm"], "loss_scale": out.get("loss_scale", 1.0),
        "elapsed_ms": 1000.0 * sec_per_iter, "tokens_per_sec": t.global_batch_size * run.cfg.data.seq_length / sec_per_iter,
        "tflops_per_gpu": tflops, "mfu": (tflops / run.peak) if run.peak else None,
        "skipped_iterations": window["skipped"],  # steps skipped for fp16 overflow since the last report
    }
    run.jsonl.write(record)
    run.tracker.log(record, state.iteration, "train")
    eta = (t.train_iters - state.iteration) * sec_per_iter
    run.log(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}]" + console_line(
        record, t.train_iters, memory_string(state.device), eta))


def pretrain(cfg: RunConfig) -> TrainState:
    run = setup(cfg)
    train(run)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return run.state
