"""The training loop: set up, then train_step / evaluate / log until --train-iters.

One iteration (see DESIGN.md, "Data flow"):
  micro-batches -> schedule (forward/backward per micro-batch) -> fp32 grad buffer
  -> TP all-reduce of sequence-parallel grads -> DP all-reduce -> normalise by the global token
  count -> clip by the global norm -> optimizer step on fp32 masters -> LR schedule -> log.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from . import comm, parallel_state
from .arguments import validate_args
from .checkpointing import CheckpointSaver, load_checkpoint
from .data.batch import build_batch, collate
from .data.samplers import PretrainingSampler
from .metrics import (JsonlWriter, Timer, console_line, memory_string, num_floating_point_operations, peak_tflops,
                      perplexity)
from .model import GPTConfig, GPTModel, pad_vocab_size
from .optimizer import build_lr_scheduler
from .pipeline_parallel import get_forward_backward_func
from .pipeline_parallel.p2p import PipeComm
from .tensor_parallel import seed_everything
from .tracking import Tracker


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each model chunk on pipeline rank `pp_rank`.

    Megatron-LM's interleaved assignment: with v chunks per rank, chunk c of rank r holds the
    layers starting at c·L/v + r·L/(p·v); with v = 1 that is L/p contiguous layers per stage.
    """
    per_chunk = num_layers // (pp * vpp)
    return [(c * num_layers // vpp + pp_rank * per_chunk, per_chunk) for c in range(vpp)]


class Trainer:
    """Everything one rank holds for a run; built by `setup`, driven by `train`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ps: parallel_state.ParallelState | None = None
        self.device = torch.device("cpu")
        self.iteration = 0
        self.consumed_samples = 0

    # -- set up ------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        """Print once, from the logging rank (last stage, TP 0, DP 0)."""
        if self.ps is None or self.ps.rank == self.ps.logging_rank:
            print(msg, flush=True)

    def initialize_distributed(self) -> None:
        args = self.args
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = args.distributed_backend == "nccl"
        if use_cuda:
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend=args.distributed_backend, timeout=datetime.timedelta(minutes=30),
                                    device_id=self.device if use_cuda else None)
        self.ps = parallel_state.initialize(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                            args.virtual_pipeline_model_parallel_size, args.rank_order)
        self.world_group = comm.world_group()

    def build_tokenizer(self):
        args = self.args
        if args.mock_data and args.tokenizer_type is None:
            self.tokenizer = None
            args.eod = None
            return
        from .data.tokenizers import build_tokenizer
        self.tokenizer = build_tokenizer(args)
        if args.vocab_size is None:
            args.vocab_size = self.tokenizer.vocab_size
        elif args.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"--vocab-size ({args.vocab_size}) is smaller than the tokenizer's vocabulary "
                             f"({self.tokenizer.vocab_size})")
        args.eod = self.tokenizer.eod

    def model_config(self) -> GPTConfig:
        a = self.args
        a.padded_vocab_size = pad_vocab_size(a.vocab_size, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)
        return GPTConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            vocab_size=a.vocab_size, padded_vocab_size=a.padded_vocab_size, seq_length=a.seq_length,
            max_position_embeddings=a.max_position_embeddings, ffn_hidden_size=a.ffn_hidden_size,
            num_query_groups=a.num_query_groups, kv_channels=a.kv_channels,
            position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
            rotary_percent=a.rotary_percent, normalization=a.normalization, norm_epsilon=a.norm_epsilon,
            swiglu=a.swiglu, add_bias_linear=not a.disable_bias_linear,
            untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
            hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
            init_method_std=a.init_method_std, use_flash_attn=a.use_flash_attn, params_dtype=a.params_dtype,
            sequence_parallel=a.sequence_parallel, recompute_granularity=a.recompute_granularity,
            recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers)

    def build_model(self) -> None:
        args, ps = self.args, self.ps
        self.rng_tracker = seed_everything(args.seed, ps.tp_rank, ps.pp_rank, self.device)
        self.config = self.model_config()
        self.model = []
        for c, (offset, n) in enumerate(stage_layers(args.num_layers, ps.pp_size, ps.vpp, ps.pp_rank)):
            chunk = GPTModel(self.config, ps.tp_group, self.rng_tracker,
                             pre_process=ps.is_first_stage and c == 0,
                             post_process=ps.is_last_stage and c == ps.vpp - 1,
                             layer_offset=offset, num_layers=n, device=self.device)
            chunk.initialize(args.seed)
            self.model.append(chunk)
        if args.compile:  # --compile: each transformer layer, in place (megalite/model/compile.py)
            from .model.compile import compile_layers
            self.log(f"> compile: torch.compile of {compile_layers(self.model)} transformer layers (Inductor)")
        # the tied embedding on the first stage and its copy on the last must be summed over the
        # embedding group before any DP reduction (see finalize_model_grads)
        self.tied_embedding = None
        if ps.pp_size > 1 and not args.untie_embeddings_and_output_weights:
            if ps.is_first_stage:
                self.tied_embedding = self.model[0].embedding.word_embeddings.weight
            elif ps.is_last_stage:
                self.tied_embedding = self.model[-1].output_layer.weight
            if self.tied_embedding is not None:
                self.tied_embedding.grad_sync_deferred = True
        self.named_params = [(n, p) for m in self.model for n, p in m.global_named_parameters()]
        self.params = [p for _, p in self.named_params]

    def build_optimizer(self) -> None:
        from .optimizer import build_optimizer
        args = self.args
        # the gradient buffer, and with --use-distributed-optimizer the parameter buffer (the
        # parameters become views into it) and the DP-sharded optimizer state
        self.optimizer = build_optimizer(self.named_params, args, self.ps, self.model)
        self.grad_buffer = self.optimizer.grad_buffer
        self.scheduler = build_lr_scheduler(args)
        self.log(f"> optimizer: {self.optimizer.describe()}")

    def load_checkpoint(self) -> None:
        args = self.args
        self.saver = CheckpointSaver(args.save, args.async_save) if args.save else None
        if args.load:
            self.iteration = load_checkpoint(self, args.load, finetune=args.finetune,
                                             load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)

    def save_checkpoint(self) -> None:
        if self.saver is not None and self._last_saved != self.iteration:
            self.saver.save(self, self.iteration)
            self._last_saved = self.iteration

    def _install_signal_handler(self) -> None:
        self._signal_received = False
        if self.args.exit_signal_handler:
            def handler(signum, frame):
                self._signal_received = True
            signal.signal(signal.SIGTERM, handler)

    def _exit_reason(self, start_time: float) -> str | None:
        """Why to stop after this iteration, agreed by every rank (flags are all-reduced)."""
        args = self.args
        flags = [0.0, 0.0]
        if args.exit_signal_handler and self._signal_received:
            flags[0] = 1.0
        if args.exit_duration_in_mins is not None and (time.time() - start_time) / 60 >= args.exit_duration_in_mins:
            flags[1] = 1.0
        if args.exit_signal_handler or args.exit_duration_in_mins is not None:
            t = torch.tensor(flags, device=self.device)
            comm.all_reduce(t, self.world_group, op=dist.ReduceOp.MAX)
            flags = t.tolist()
        if flags[0]:
            return "SIGTERM received"
        if flags[1]:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins} reached"
        if args.exit_interval and self.iteration % args.exit_interval == 0:
            return f"--exit-interval {args.exit_interval} reached"
        return None

    def _make_loader(self, dataset, consumed: int):
        ps = self.ps
        sampler = PretrainingSampler(len(dataset), consumed, self.args.micro_batch_size, ps.dp_rank, ps.dp_size)
        # its own generator: creating an iterator must not draw from the default stream that
        # dropout uses (a resumed run would otherwise see shifted dropout masks)
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                                num_workers=self.args.num_workers,
                                                generator=torch.Generator().manual_seed(self.args.seed)))

    def build_data(self) -> None:
        args = self.args
        gb = args.global_batch_size
        num_samples = (args.train_iters * gb, args.eval_iters * gb, args.eval_iters * gb)
        if args.mock_data:
            from .data.mock import MockGPTDataset
            self.datasets = [MockGPTDataset(n, args.seq_length, args.vocab_size, args.seed + i) if n else None
                             for i, n in enumerate(num_samples)]
        else:
            from .data.builder import build_train_valid_test_datasets
            self.datasets = list(build_train_valid_test_datasets(args, num_samples))
        # TP rank 0 reads; the other TP ranks receive the micro-batch by broadcast
        self.reads_data = self.ps.tp_rank == 0
        self.train_iter = self._make_iterators(self.datasets[0], self.consumed_samples)

    def _make_iterators(self, dataset, consumed: int) -> list:
        """One data iterator per model chunk on TP rank 0 (None on the others): every chunk
        consumes the iteration's micro-batches in order, at its own pace in the schedule."""
        return [self._make_loader(dataset, consumed) if self.reads_data else None for _ in range(self.ps.vpp)]

    def setup(self) -> None:
        args = self.args
        self.initialize_distributed()
        self.build_tokenizer()
        self.build_model()
        self.build_optimizer()
        self.load_checkpoint()
        self.build_data()
        self.forward_backward = get_forward_backward_func(self.ps.pp_size, self.ps.vpp)
        s = args.seq_length // (args.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        self.pipe_comm = PipeComm(self.ps, (s, args.micro_batch_size, args.hidden_size), args.params_dtype,
                                  self.device)
        self.jsonl = JsonlWriter(args.log_jsonl if self.ps.rank == self.ps.logging_rank else None)
        self.tracker = Tracker(args, enabled=self.ps.rank == self.ps.logging_rank)  # W&B / TensorBoard
        self.tracker.log_config(vars(args))
        self.flops_per_iteration = num_floating_point_operations(args, args.global_batch_size)
        self.peak = peak_tflops(args)
        self.log_startup()

    def log_startup(self) -> None:
        args, ps = self.args, self.ps
        total = self.count_parameters()
        from .cpu import slow_bf16_warning  # --bf16 on a CPU without native bf16: say it once
        if (warning := slow_bf16_warning(self.device, args.params_dtype)) is not None:
            self.log(warning)
        attention = "flash-attn" if args.use_flash_attn else "torch scaled_dot_product_attention"
        self.log(f"> megalite: {ps.describe()}, {args.num_microbatches} micro-batches of {args.micro_batch_size} "
                 f"per iteration (global batch {args.global_batch_size})")
        self.log(f"> model: {total / 1e6:.2f}M parameters, {args.num_layers} layers, hidden {args.hidden_size}, "
                 f"{args.num_attention_heads} heads, vocab {args.vocab_size} (padded {args.padded_vocab_size}), "
                 f"seq {args.seq_length}, {str(args.params_dtype).replace('torch.', '')}, attention: {attention}, "
                 f"device: {self.device.type}, backend: {args.distributed_backend if dist.is_initialized() else 'none'}")
        self.write_memory_footprint()

    def count_parameters(self) -> int:
        """Parameters of the whole model, each counted once: replicated copies (TP, tied
        embedding on the last stage, DP replicas) are skipped."""
        from .optimizer import is_counted
        local = sum(p.numel() for p in self.params if is_counted(p, self.ps.tp_rank)) if self.ps.dp_rank == 0 else 0
        return int(sum(comm.all_gather_object(local, self.world_group)))

    def write_memory_footprint(self) -> None:
        ps = self.ps
        mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank,
                "num_params": sum(p.numel() for p in self.params),
                "param_bytes": self.grad_buffer.param_nbytes,  # with ZeRO-1: the flat buffer, padding included
                "grad_bytes": self.grad_buffer.nbytes,
                "optimizer_bytes": self.optimizer.state_bytes()}  # fp32 masters + Adam m, v (this rank's shard)
        ranks = comm.all_gather_object(mine, self.world_group)
        self.jsonl.write({"event": "memory_footprint", "ranks": ranks})

    # -- one iteration -------------------------------------------------------------------------
    def get_batch(self, data_iterator) -> dict:
        args, ps = self.args, self.ps
        shape = (args.micro_batch_size, args.seq_length + 1)
        if self.reads_data:
            tokens = next(data_iterator).to(self.device)
            if tuple(tokens.shape) != shape:
                raise ValueError(f"data loader gave a batch of shape {tuple(tokens.shape)}, expected {shape}")
        else:
            tokens = torch.empty(shape, dtype=torch.int64, device=self.device)
        comm.broadcast(tokens, ps.tp_ranks[0], ps.tp_group)
        return build_batch(tokens, args.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)

    def forward_step(self, data_iterator, model):
        batch = self.get_batch(data_iterator)
        out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"])
        if not model.post_process:
            return out  # activations for the next stage
        loss, mask = out, batch["loss_mask"]
        return (loss.float() * mask).sum(), mask.sum()

    def _global_loss(self, stats) -> tuple[float, float]:
        """(sum of token losses, number of loss tokens) over the global batch: only the last
        stage's TP rank 0 of each DP replica contributes, so every sample counts once."""
        owns = self.ps.is_last_stage and self.ps.tp_rank == 0
        t = torch.zeros(2, dtype=torch.float64, device=self.device)
        if owns and stats:
            t[0] = sum(float(s) for s, _ in stats)
            t[1] = sum(float(n) for _, n in stats)
        comm.all_reduce(t, self.world_group)
        return float(t[0]), float(t[1])

    def finalize_model_grads(self) -> None:
        """Every gradient sum of the iteration:
        1. the tied embedding's two copies (first and last stage), over the embedding group;
           before the DP reduction, since the stages' buffers are laid out differently;
        2. the DP reduction (all-reduce, or reduce-scatter with the distributed optimizer);
        3. weights replicated across TP but fed by sequence-sharded activations (norms, row-parallel
           biases under sequence parallelism), over TP. TP ranks share one buffer layout, so after a
           reduce-scatter each rank's own slice is still summed correctly."""
        if self.tied_embedding is not None:
            comm.all_reduce(self.tied_embedding.main_grad, self.ps.embedding_group)
        self.optimizer.reduce_gradients()
        if self.config.sequence_parallel:
            for p in self.params:
                if getattr(p, "sequence_parallel", False):
                    comm.all_reduce(p.main_grad, self.ps.tp_group)

    def train_step(self) -> dict:
        args = self.args
        for m in self.model:
            m.train()
        self.optimizer.zero_grad()
        nominal_tokens = args.global_batch_size * args.seq_length
        stats = self.forward_backward(
            forward_step=self.forward_step, data_iterator=self.train_iter, model=self.model,
            num_microbatches=args.num_microbatches, comm=self.pipe_comm, backward_scale=self.optimizer.loss_scale / nominal_tokens)
        self.finalize_model_grads()
        loss_sum, num_tokens = self._global_loss(stats)
        if num_tokens == 0:
            raise RuntimeError(f"iteration {self.iteration + 1}: the global batch has no token with loss "
                               "(every token masked by --eod-mask-loss?)")
        lr = self.scheduler.get_lr()
        # undo the loss scale; masked tokens: renormalise from the nominal to the true token count
        update = self.optimizer.step(lr, grad_scale=nominal_tokens / num_tokens / self.optimizer.loss_scale,
                                     iteration=self.iteration + 1)
        if not update["skipped"]:  # a step skipped for fp16 overflow does not advance the schedule
            self.scheduler.step()
        return {"lm_loss": loss_sum / num_tokens, "lr": lr, **update}

    @torch.no_grad()
    def evaluate(self, split: str) -> dict | None:
        args = self.args
        dataset = self.datasets[1 if split == "valid" else 2]
        if dataset is None or args.eval_iters == 0:
            return None
        for m in self.model:
            m.eval()
        data_iter = self._make_iterators(dataset, 0)
        totals = [0.0, 0.0]
        for _ in range(args.eval_iters):
            stats = self.forward_backward(
                forward_step=self.forward_step, data_iterator=data_iter, model=self.model,
                num_microbatches=args.num_microbatches, comm=self.pipe_comm, backward_scale=0.0, forward_only=True)
            loss_sum, num_tokens = self._global_loss(stats)
            totals[0] += loss_sum
            totals[1] += num_tokens
        for m in self.model:
            m.train()
        loss = totals[0] / max(totals[1], 1.0)
        record = {"iteration": self.iteration, "split": split, "lm_loss": loss, "ppl": perplexity(loss)}
        self.jsonl.write(record)
        self.tracker.log(record, self.iteration, split)
        line = f" {split} loss at iteration {self.iteration} | lm loss: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
        self.log("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        return record

    # -- the loop --------------------------------------------------------------------------------
    def train(self) -> None:
        args = self.args
        timer = Timer(self.device)
        timer.reset()
        window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0}
        start_time, self._last_saved = time.time(), self.iteration
        self._install_signal_handler()
        while self.iteration < args.train_iters:
            out = self.train_step()
            self.iteration += 1
            if args.compile and not getattr(self, "_compile_reported", False):  # compiled during this first step
                from .model.compile import compile_report
                self.log(f"> compile: {compile_report()}")
                self._compile_reported = True
            self.consumed_samples += args.global_batch_size
            window["iters"] += 1
            if not out.get("skipped"):  # a step skipped for fp16 overflow does not enter the average
                window["lm_loss"] += out["lm_loss"]
                window["loss_iters"] += 1
            if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                self.report(out, window, timer.elapsed())
                window = {"lm_loss": 0.0, "iters": 0, "loss_iters": 0}
                timer.reset()
            if self.iteration % args.eval_interval == 0 and self.iteration != args.train_iters:
                self.evaluate("valid")
            if self.saver is not None:
                self.saver.finalize(blocking=False)
                if args.save_interval and self.iteration % args.save_interval == 0:
                    self.save_checkpoint()
            reason = self._exit_reason(start_time)
            if reason is not None:
                self.save_checkpoint()
                if self.saver is not None:
                    self.saver.finalize(blocking=True)
                self.log(f"> exiting at iteration {self.iteration}: {reason}")
                self.jsonl.close()
                self.tracker.close()
                return
        self.evaluate("valid")
        self.evaluate("test")
        if self.saver is not None:
            self.save_checkpoint()
            self.saver.finalize(blocking=True)
        self.jsonl.close()
        self.tracker.close()

    def report(self, out: dict, window: dict, elapsed_s: float) -> None:
        args = self.args
        n = window["iters"]
        sec_per_iter = elapsed_s / n
        tflops = self.flops_per_iteration / (sec_per_iter * self.ps.world_size) / 1e12
        record = {
            "iteration": self.iteration, "consumed_samples": self.consumed_samples,
            "lm_loss": window["lm_loss"] / window["loss_iters"] if window["loss_iters"] else out["lm_loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
            "loss_scale": out.get("loss_scale", 1.0), "elapsed_ms": 1000.0 * sec_per_iter,
            "tokens_per_sec": args.global_batch_size * args.seq_length / sec_per_iter,
            "tflops_per_gpu": tflops, "mfu": (tflops / self.peak) if self.peak else None,
        }
        # steps skipped for fp16 overflow since the previous report
        record["skipped_iterations"] = self.optimizer.skipped_iterations - getattr(self, "_skipped_reported", 0)
        self._skipped_reported = self.optimizer.skipped_iterations
        self.jsonl.write(record)
        self.tracker.log(record, self.iteration, "train")
        eta = (args.train_iters - self.iteration) * sec_per_iter
        self.log(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}]" + console_line(
            record, args.train_iters, memory_string(self.device), eta))

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def pretrain(args: argparse.Namespace) -> Trainer:
    trainer = Trainer(args)
    trainer.setup()
    trainer.train()
    trainer.close()
    return trainer


def main(argv=None) -> int:
    from .arguments import ArgumentError, parse_args
    args = parse_args(argv)
    try:
        validate_args(args)
    except ArgumentError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    pretrain(args)
    return 0
