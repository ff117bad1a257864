"""--dry-run: one rank of a layout built and stepped on the meta device, its bytes counted.

With --fake-process-group (Megatron-LM's flag; torch's "fake" backend) this process is rank
$RANK of a world of $WORLD_SIZE: every process group of the rank grid exists and every
collective completes at once without communicating, so the rank-local model chunks, gradient
buffers, optimizer state and ZeRO buffers of any rank of a thousand-GPU layout are built exactly
as on the cluster (same code, same shapes), on the meta device, which allocates nothing. One
iteration then runs there: every micro-batch of the pipeline schedule (forward and backward,
activation recompute included), the gradient reduction and the optimizer step.

Bytes by category (`DryRunReport`):
  param_bytes, grad_bytes, optimizer_bytes  what lives through the step, read from the very
      objects a run builds (DataParallel's buffers, the optimizer's state): the numbers a real
      run logs in its `memory_footprint` record;
  activation_bytes  what the forward passes leave alive for backward (each storage once,
      parameters excluded: saved tensors, recompute's kept inputs, stage outputs), at its peak over
      the schedule: the micro-batches in flight;
  zero_working_set_bytes  ZeRO-2/3 gradient staging buckets and ZeRO-3 gathered units, each at
      its peak, as DataParallel counts them: the plan's working set;
  step_peak_bytes   every storage created during the iteration and still alive, at its peak:
      activations plus ZeRO-2/3 gradient staging and gathered parameters, logits and
      temporaries (an upper bound on the working set: meta kernels may keep intermediates that a
      fused GPU kernel would not).
Activation bytes follow the kernels the meta device dispatches to: attention is PyTorch's
math path there (so without selective recompute the s x s probabilities are counted, as an
unfused kernel keeps them).
"""
from __future__ import annotations

import dataclasses
import time
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .config import RunConfig
from .data.batch import build_batch, slice_batch
from .distributed import DataParallel
from .distributed.expert_data_parallel import build_data_parallel
from .initialize import build_model, initialize_distributed, resolve_vocab
from .model import ExecutionConfig
from .model.fp8 import attach_fp8
from .optimizer import build_optimizer
from .pipeline_parallel import get_schedule
from .pipeline_parallel.p2p import PipeComm
from .runtime.metrics import JsonlWriter
from .tensor_parallel.wgrad import WgradStore, attach as wgrad_attach

META = torch.device("meta")


@dataclasses.dataclass
class DryRunReport:
    rank: int
    tp: int
    pp: int
    dp: int
    cp: int
    num_params: int
    num_expert_params: int  # of num_params: the routed experts' (E/EP per MoE layer)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    zero_working_set_bytes: int
    step_peak_bytes: int
    num_microbatches: int
    build_seconds: float
    step_seconds: float

    def lines(self) -> list[str]:
        def size(n: int, what: str) -> str:
            return f">   {what:<12} {n / 2**20:12.1f} MiB  ({n} bytes)"
        experts = f" ({self.num_expert_params / 1e6:.2f}M of them experts)" if self.num_expert_params else ""
        return [f"> dry run of rank {self.rank} (TP {self.tp}, PP {self.pp}, DP {self.dp}, CP {self.cp}): "
                f"{self.num_params / 1e6:.2f}M parameters{experts}; built in {self.build_seconds:.1f} s, one iteration of "
                f"{self.num_microbatches} micro-batches in {self.step_seconds:.1f} s",
                size(self.param_bytes, "parameters"), size(self.grad_bytes, "gradients"),
                size(self.optimizer_bytes, "optimizer"),
                size(self.activation_bytes, "activations") + " held for backward, at the schedule's peak",
                size(self.zero_working_set_bytes, "ZeRO working") + " set at its peak: ZeRO-2/3 gradient staging "
                "buckets and ZeRO-3 gathered parameters",
                size(self.step_peak_bytes, "step peak") + " all the iteration allocates, at its peak (activations, "
                "ZeRO staging and gathered units, logits, temporaries)"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created while active and still alive, current and peak; and the
    activations: of the storages created during a model chunk's forward (`watch` hooks the
    chunks), those still alive when a forward ends, parameters excluded (ZeRO-3's gathered
    units are created there too). Sampled at the end of every forward, their maximum is what the
    micro-batches in flight hold for backward: tensors autograd saved, the inputs activation
    recompute keeps, the output handed to the next stage. A storage leaves every count when it
    is freed (a weak reference on it)."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = params
        self.live = self.peak = self.forward_live = self.activation_peak = 0
        self._created: dict[int, int] = {}  # storage id -> bytes
        self._forward: dict[int, int] = {}  # the same, for storages created inside a forward
        self._in_forward = 0

    def watch(self, chunks: list[nn.Module]) -> list:
        def enter(module, inputs):
            self._in_forward += 1

        def leave(module, inputs, output):
            self._in_forward -= 1
            params = {p.untyped_storage()._cdata for p in self.params}  # (ZeRO's parameters share storages)
            held = self.forward_live - sum(self._forward.get(key, 0) for key in params)
            self.activation_peak = max(self.activation_peak, held)
        return [h for m in chunks for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]

    def _free(self, key: int) -> None:
        self.live -= self._created.pop(key)
        self.forward_live -= self._forward.pop(key, 0)

    def __torch_dispatch__(self, func, types, inputs=(), kwargs=None):
        out = func(*inputs, **(kwargs or {}))
        if func.is_view:  # allocates nothing (on meta a view may still report a storage of its own)
            return out
        # an in-place op returns its input: a storage from before the step (a buffer, a parameter)
        # is not allocated by it
        given = {t.untyped_storage()._cdata for t in tree_leaves((inputs, kwargs)) if isinstance(t, torch.Tensor)}

        def track(t):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, n = storage._cdata, storage.nbytes()
                if key not in self._created and key not in given:
                    self._created[key] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    if self._in_forward:
                        self._forward[key] = n
                        self.forward_live += n
                    weakref.finalize(storage, self._free, key)
            return t
        tree_map(track, out)
        return out


def zero_working_set(dp: DataParallel) -> int:
    """The most bytes of ZeRO-3 gathered units plus the most of ZeRO-2/3 gradient staging held at
    once during the step, as DataParallel counts them (it allocates them by resizing storages,
    which no tensor operation reports)."""
    domains = getattr(dp, "domains", [dp])  # expert parallelism: the dense and the expert DataParallel
    gathered = sum(getattr(d.param_buffer, "peak_gathered_bytes", 0) for d in domains) \
        if dp.strategy.shards_params else 0
    return gathered + sum(getattr(d.grads, "peak_staging_bytes", 0) for d in domains)


def _micro_batches(cfg: RunConfig, ps, eod: int | None):
    """Micro-batches of the right shapes on the meta device (built on the CPU from zeros, so the
    document masks of --reset-position-ids / --reset-attention-mask take their shapes)."""
    d = cfg.data
    tokens = torch.zeros(d.micro_batch_size, d.seq_length + 1, dtype=torch.int64)
    batch = slice_batch(build_batch(tokens, eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss,
                                    d.create_attention_mask_in_dataloader), ps.cp_size, ps.cp_rank)
    meta = tree_map(lambda t: t.to(META) if isinstance(t, torch.Tensor) else t, batch)
    while True:
        yield dict(meta)


def dry_run(cfg: RunConfig, rank: int | None = None) -> DryRunReport:
    """Build this rank (`rank`, default $RANK, of the validated world size under
    --fake-process-group) on the meta device, run one iteration, and count its bytes. The fake
    process group is destroyed at the end, so a caller may dry-run several ranks in turn."""
    import torch.distributed as dist
    try:
        return _dry_run(cfg, rank)
    finally:
        if cfg.parallel.fake_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _dry_run(cfg: RunConfig, rank: int | None) -> DryRunReport:
    start = time.perf_counter()
    ps, _ = initialize_distributed(cfg.parallel, fake_rank=rank, moe=bool(cfg.model.num_experts))
    t = cfg.training
    model_config, eod = resolve_vocab(cfg)
    execution = ExecutionConfig.from_configs(cfg.optimizer, cfg.parallel, cfg.recompute, cfg.kernels)
    model, _ = build_model(model_config, ps, t.seed, torch.device("cpu"), on_meta=True, execution=execution,
                           layout=cfg.parallel.pipeline_model_parallel_layout)
    named = [(n, p) for m in model for n, p in m.global_named_parameters()]
    dp = build_data_parallel(model, [p for _, p in named], ps, cfg.ddp, t.num_microbatches, device=META,
                             init_fn=lambda p: torch.empty(p.shape, dtype=p.dtype, device=META))
    optimizer = build_optimizer(named, cfg.optimizer, dp, ps)
    store = WgradStore() if cfg.parallel.delay_wgrad_compute else None  # zb_h1 / zbv: the split backward
    wgrad_attach(model, store)
    fp8 = attach_fp8(model, cfg.fp8, ps, META)  # --fp8-format: the FP8 linears keep FP8 inputs for backward
    built = time.perf_counter()
    # activations between stages: this rank's s/c tokens (CP), split over TP under sequence parallelism
    s = cfg.data.seq_length // ps.cp_size // (ps.tp_size if execution.sequence_parallel else 1)
    pipe = PipeComm(ps, (s, t.micro_batch_size, model_config.hidden_size), execution.params_dtype, META)
    for m in model:
        m.train()
    meter = LiveBytes(dp.params)
    hooks = meter.watch(model)
    with meter:
        if fp8 is not None:
            fp8.start_iteration()
        dp.set_num_microbatches(t.num_microbatches)
        dp.zero_grad()
        get_schedule(cfg.parallel.pipeline_schedule)(
            batches=[_micro_batches(cfg, ps, eod) for _ in model], model=model, num_microbatches=t.num_microbatches,
            comm=pipe, backward_scale=1.0 / (t.num_microbatches * ps.dp_size), microbatch_mean=True,
            wgrad_store=store)
        if fp8 is not None:
            fp8.finish_iteration()
        dp.finish_grad_sync()
        optimizer.step(cfg.optimizer.lr)
        dp.start_param_sync()
        dp.finish_param_sync()
    for h in hooks:
        h.remove()
    done = time.perf_counter()
    return DryRunReport(rank=ps.rank, tp=ps.tp_rank, pp=ps.pp_rank, dp=ps.dp_rank, cp=ps.cp_rank,
                        num_params=sum(p.numel() for p in dp.params),
                        num_expert_params=sum(p.numel() for m in model for p in m.expert_parameters()),
                        param_bytes=dp.param_bytes,
                        grad_bytes=dp.grad_bytes, optimizer_bytes=optimizer.state_bytes(),
                        activation_bytes=meter.activation_peak, zero_working_set_bytes=zero_working_set(dp),
                        step_peak_bytes=meter.peak,
                        num_microbatches=t.num_microbatches, build_seconds=built - start, step_seconds=done - built)


def main(cfg: RunConfig) -> DryRunReport:
    """pretrain_gpt.py --dry-run: the report on stdout and, with --log-jsonl, as a `memory_footprint`
    record (a real run's record, with "dry_run": true and this one rank)."""
    for notice in cfg.notices:
        print(f"> note: {notice}", flush=True)
    report = dry_run(cfg)
    for line in report.lines():
        print(line, flush=True)
    jsonl = JsonlWriter(cfg.training.log_jsonl)  # a real run's record, for this one rank
    jsonl.write({"event": "memory_footprint", "dry_run": True, "ranks": [dataclasses.asdict(report)]})
    jsonl.close()
    return report
