"""Setting a run up: the process groups, the model chunks of this rank (initialised
layout-invariantly), DataParallel and the optimizer, the checkpoint to resume, datasets and
iterators, and the start-up report. `setup` returns the `Run` that the loop (training.py) steps."""
from __future__ import annotations

import contextlib
import functools
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm, parallel_state
from .checkpoint.megatron import MegatronSaver
from .checkpoint.load import load_checkpoint
from .checkpoint.native import CheckpointSaver, TrainState
from .checkpoint.non_persistent import NonPersistent
from .checkpoint.paths import read_tracker
from .checkpoint.upcycling.load import load_upcycled
from .context_parallel.attention import set_hierarchy
from .config import ParallelConfig, RunConfig
from .data.batch import micro_batches
from .distributed import DataParallel, get_strategy
from .distributed.expert_data_parallel import build_data_parallel
from .fp8.context import FP8Context
from .model import ExecutionConfig, GPTConfig, GPTModel, pad_vocab_size
from .model.fp8 import attach_fp8
from .model.init import initial_value
from .num_microbatches_calculator import NumMicroBatchesCalculator, build_num_microbatches_calculator
from .optimizer import build_lr_scheduler, build_optimizer
from .optimizer.qk_clip import QKClip
from .pipeline_parallel import get_schedule
from .pipeline_parallel.p2p import PipeComm
from .pipeline_parallel.schedules import v_shape
from .pipeline_parallel.timeline import Timeline
from .runtime.cpu import lean_malloc, steady_malloc
from .runtime.metrics import JsonlWriter, peak_tflops
from .runtime.monitor import CommMonitor
from .runtime.profiling import Profiler
from .runtime.rerun import RerunMachine
from .runtime.spikes import SpikeGuard
from .runtime.straggler import StragglerDetector
from .runtime.timers import Timers
from .runtime.tracking import Tracker
from .tensor_parallel import seed_everything
from .tensor_parallel.cross_entropy import fused_loss_kernels
from .tensor_parallel.param_info import param_info
from .tensor_parallel.wgrad import WgradStore, attach as wgrad_attach


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
    timers: Timers  # --timing-log-level: the per-phase timers (no-ops at level 0)
    straggler: StragglerDetector | None = None  # --log-straggler
    wgrad_store: WgradStore | None = None  # zb_h1 / zbv (--delay-wgrad-compute): the deferred weight gradients
    timeline: Timeline | None = None  # --log-pipeline-timeline
    qk_clip: QKClip | None = None  # --qk-clip
    fp8: FP8Context | None = None  # --fp8-format: the recipe, delayed scaling's history (megalite/fp8/)
    signal_received: list = field(default_factory=lambda: [False])
    spike_guard: SpikeGuard | None = None  # --check-for-spiky-loss / --check-for-large-grads
    rerun: RerunMachine | None = None  # --rerun-mode validate_results / report_stats
    non_persistent: NonPersistent | None = None  # --non-persistent-ckpt-type
    # with the guard: the checkpoint due after an iteration, written once the next loss is no spike
    pending_save: tuple | None = None  # (iteration, RNG states at its end)
    last_saved: int = -1  # the iteration of the latest checkpoint written by this run
    last_step_spiked: bool = False
    # what the run opened (process groups, the monitor, hooks, files, threads), closed in reverse
    # order by `close`, whether the run ended normally or not
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def log(self, msg: str) -> None:
        self.state.log(msg)

    def close(self) -> None:
        self.closing.close()


# -- set up -----------------------------------------------------------------------------------------
def initialize_distributed(cfg: ParallelConfig, fake_rank: int | None = None, moe: bool = False,
                           closing: contextlib.ExitStack | None = None) -> tuple[parallel_state.ParallelState,
                                                                                 torch.device]:
    """The process groups of this rank and its device (`moe`: with an MoE model's groups).
    --fake-process-group: rank `fake_rank` (default $RANK) of cfg.world_size in the fake backend.
    `closing`: gets the groups' teardown (the default group too, if this call created it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    use_cuda = cfg.distributed_backend == "nccl"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    created = not dist.is_initialized() and (cfg.fake_process_group or world > 1)
    if closing is not None and created:
        closing.callback(lambda: dist.is_initialized() and dist.destroy_process_group())
    if cfg.fake_process_group and not dist.is_initialized():
        comm.init_fake_process_group(int(os.environ.get("RANK", "0")) if fake_rank is None else fake_rank,
                                     cfg.world_size)
    elif world > 1 and not dist.is_initialized():
        comm.init_distributed(cfg.distributed_backend, cfg.distributed_timeout_minutes,
                              device_id=device if use_cuda else None)
    ps = parallel_state.initialize(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                   cfg.virtual_pipeline_model_parallel_size, cfg.rank_order,
                                   timeout_minutes=cfg.distributed_timeout_minutes, cp=cfg.context_parallel_size,
                                   ep=cfg.expert_model_parallel_size, moe=moe,
                                   etp=cfg.expert_tensor_parallel_size,
                                   hierarchical_cp=cfg.hierarchical_context_parallel_sizes,
                                   instances=cfg.num_distributed_optimizer_instances)
    # zbv: chunk 1 of rank r is virtual stage 2p-1-r, the loss on pipeline rank 0
    ps.v_shape = cfg.pipeline_schedule is not None and v_shape(cfg.pipeline_schedule)
    if closing is not None and not created:
        closing.callback(ps.destroy)
    return ps, device


def resolve_vocab(cfg: RunConfig) -> tuple[GPTConfig, int | None]:
    """The model config with the vocabulary size filled in (from the tokenizer unless
    --vocab-size is given) and padded as Megatron-LM does; and the end-of-document id."""
    tok, tp = cfg.tokenizer, cfg.parallel.tensor_model_parallel_size
    vocab_size, eod = tok.vocab_size, None
    if not (cfg.data.mock_data and tok.tokenizer_type is None):
        from .data.tokenizers import build_tokenizer, model_vocab_size
        tokenizer = build_tokenizer(tok)
        vocab_size = model_vocab_size(tok, tokenizer)  # NullTokenizer: --vocab-size + 1 (its eod)
        eod = tokenizer.eod
    padded = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    return dataclasses.replace(cfg.model, vocab_size=vocab_size, padded_vocab_size=padded), eod


def build_model(config: GPTConfig, ps, seed: int, device: torch.device, on_meta: bool = False,
                execution: ExecutionConfig | None = None, layout: str | None = None):
    """This rank's model chunks (one per virtual pipeline stage), initialised layout-invariantly,
    and the TP RNG tracker their dropout uses. `on_meta` (ZeRO-3): parameters without storage,
    which DataParallel materialises straight into this rank's slices. `layout`:
    --pipeline-model-parallel-layout (None: the even split)."""
    rng_tracker = seed_everything(seed, ps.tp_rank, ps.pp_rank, device)
    chunks = []
    layers = parallel_state.stage_layers(config.num_layers, ps.pp_size, ps.vpp, ps.pp_rank, layout, ps.v_shape)
    for c, (offset, n) in enumerate(layers):
        chunk = GPTModel(config, ps.tp_group, rng_tracker, pre_process=ps.is_first_stage and c == 0,
                         post_process=ps.is_loss_stage and c == ps.vpp - 1, layer_offset=offset, num_layers=n,
                         device="meta" if on_meta else device, cp_group=ps.cp_group, execution=execution,
                         ep_group=ps.ep_group, token_group=ps.tp_cp_group, etp_group=ps.etp_group)
        if ps.hcp_groups:  # --cp-comm-type a2a+p2p's levels
            set_hierarchy(chunk, ps.hcp_groups)
        if not on_meta:
            chunk.initialize(seed)
        chunks.append(chunk)
    return chunks, rng_tracker


def _wgrad_store(cfg: RunConfig, model: list, closing) -> WgradStore | None:
    """--delay-wgrad-compute (zb_h1, zbv): the store the model's deferred weight gradients wait in.
    Attached after DataParallel, which decides ZeRO-3's tied output gather (wgrad.attach)."""
    if not cfg.parallel.delay_wgrad_compute:
        return None
    store = WgradStore()
    wgrad_attach(model, store)
    closing.callback(wgrad_attach, model, None)
    return store


def build_datasets(cfg: RunConfig, model_vocab_size: int | None = None) -> list:
    """(train, valid, test) sized for --train-samples (or --train-iters global batches) and
    --eval-iters global batches. Token ids are checked against `model_vocab_size` (NullTokenizer's
    --vocab-size N leaves out its eod id N)."""
    t, data = cfg.training, cfg.data
    train = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    eval_batch = t.eval_global_batch_size or t.global_batch_size
    num_samples = (train, t.eval_iters * eval_batch, t.eval_iters * eval_batch)
    if data.mock_data:
        from .data.mock import MockGPTDataset
        return [MockGPTDataset(n, data.seq_length, data.vocab_size, data.seed + i) if n else None
                for i, n in enumerate(num_samples)]
    from .data.builder import build_train_valid_test_datasets
    if model_vocab_size is not None:
        data = dataclasses.replace(data, vocab_size=model_vocab_size)
    datasets = list(build_train_valid_test_datasets(data, num_samples))
    if data.fim_data:  # fill-in-the-middle samples (data/fim.py)
        from .data.fim import FIMDataset
        datasets = [FIMDataset(d, data, cfg.tokenizer, i) if d is not None else None for i, d in enumerate(datasets)]
    return datasets


def batch_iterators(cfg: RunConfig, dataset, consumed: int, ps, device, eod, straggler=None, timers=None) -> list:
    """One micro-batch iterator per model chunk: every chunk consumes the iteration's
    micro-batches in order, at its own pace in the schedule. With a straggler detector, the
    time spent in them is timed as data wait; with `timers`, as batch-generator (level 2)."""
    its = [micro_batches(dataset, consumed, cfg.data, ps, device, eod) for _ in range(ps.vpp)]
    its = [straggler.data_iterator(it) for it in its] if straggler is not None else its
    return [timers.wrap("batch-generator", it) for it in its] if timers is not None else its


def setup(cfg: RunConfig, memory=None) -> Run:
    """The run of `cfg`; whatever it opens is closed by `Run.close` (here, if setting up fails).
    `memory`: the in-process restart loop's HostSnapshots (--non-persistent-ckpt-type in_memory)."""
    closing = contextlib.ExitStack()
    try:
        return _setup(cfg, closing, memory)
    except BaseException:
        closing.close()
        raise


def _bf16_matmul_in_fp32(closing: contextlib.ExitStack) -> None:
    """--disable-bf16-reduced-precision-matmul: CUDA's bf16 GEMMs reduce their split-K partial sums
    in fp32 (Megatron-LM's flag), for this run only."""
    matmul = torch.backends.cuda.matmul
    closing.callback(setattr, matmul, "allow_bf16_reduced_precision_reduction",
                     matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = False


def _process_switches(cfg: RunConfig, closing: contextlib.ExitStack) -> None:
    """Process-wide torch switches the run sets, each put back when it closes."""
    if cfg.training.deterministic_mode:
        closing.callback(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled())
        torch.use_deterministic_algorithms(True)
    if cfg.kernels.disable_bf16_reduced_precision_matmul:
        _bf16_matmul_in_fp32(closing)
    level = cfg.training.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL", "").strip().isdigit():
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])  # Megatron-LM's environment variable
    if level is not None:  # --logging-level: Python's root logger, as Megatron-LM's setup_logging
        import logging
        root = logging.getLogger()
        closing.callback(root.setLevel, root.level)
        root.setLevel(level)


def _compile(cfg: RunConfig, model: list, ps, device) -> None:
    """--cross-entropy-loss-fusion: the loss's passes over 16-bit logits compiled on a GPU
    (tensor_parallel/cross_entropy.py); --compile: each transformer layer, in place, and the loss's
    passes (model/compile.py)."""
    if cfg.kernels.cross_entropy_loss_fusion:
        for chunk in model:
            chunk.loss_kernels = fused_loss_kernels(device)
    if not cfg.training.compile:
        return
    from .model.compile import compile_layers
    scope = cfg.training.compile_scope
    n = compile_layers(model, scope=scope)
    if ps.rank == ps.logging_rank:
        what = (f"{n} transformer layers, each a region" if scope == "layer" else
                f"each model chunk's layer stack as one region ({len(model)} chunk(s), {n} transformer layers)")
        print(f"> compile: torch.compile of {what} (Inductor)", flush=True)


def _schedule(p):
    """The pipeline schedule's function; the interleaved one with its micro-batch groups
    (--microbatch-group-size-per-virtual-pipeline-stage)."""
    run = get_schedule(p.pipeline_schedule)
    if p.microbatch_group_size_per_vp_stage and p.pipeline_schedule == "interleaved_1f1b":
        return functools.partial(run, microbatch_group_size=p.microbatch_group_size_per_vp_stage)
    return run


def _saver(cfg: RunConfig):
    """--save's writer: megalite's own format, or Megatron-LM's torch_dist (--ckpt-format torch_dist)."""
    ck = cfg.checkpoint
    if not ck.save:
        return None
    if cfg.megatron.ckpt_format == "torch_dist":
        return MegatronSaver(ck.save, ck.async_save, ck.ckpt_fully_parallel_save, ck.save_retain_interval,
                             ck.verify_integrity)
    return CheckpointSaver(ck.save, ck.async_save, check_finite=cfg.training.check_for_nan_in_loss_and_grad,
                           fully_parallel=ck.ckpt_fully_parallel_save, retain_interval=ck.save_retain_interval)


def _host_malloc(cfg: RunConfig, device) -> str | None:
    """glibc's malloc settings for a CPU run (runtime/cpu.py); what was set, for the start-up line.
    A sharded strategy is chosen for memory: freed host memory goes back at once (it costs page
    faults, ~10% of a small model's step on CPU, so not for every run). A split backward (zb_h1,
    zbv) frees in bursts: the heap keeps what it freed, so that the next burst maps nothing."""
    if get_strategy(cfg.ddp.data_parallel_sharding_strategy).shards_optimizer:
        return lean_malloc(device)
    return steady_malloc(device) if cfg.parallel.delay_wgrad_compute else None


def _setup(cfg: RunConfig, closing: contextlib.ExitStack, memory=None) -> Run:
    _process_switches(cfg, closing)
    ps, device = initialize_distributed(cfg.parallel, moe=bool(cfg.model.num_experts), closing=closing)
    malloc = _host_malloc(cfg, device)  # before the model's tensors exist
    t = cfg.training
    # every blocking collective from here on is seen by the monitor (timeouts name where the run
    # stood; --log-straggler times the waits); its watchdog thread is gone before the groups are
    monitor = CommMonitor(ps, device, cfg.parallel.distributed_timeout_minutes, time_waits=t.log_straggler)
    previous = comm.set_monitor(monitor)
    closing.callback(comm.set_monitor, previous)
    closing.callback(monitor.stop)
    monitor.start_watchdog()
    model_config, eod = resolve_vocab(cfg)
    zero3 = get_strategy(cfg.ddp.data_parallel_sharding_strategy).shards_params
    execution = ExecutionConfig.from_configs(cfg.optimizer, cfg.parallel, cfg.recompute, cfg.kernels)
    model, rng_tracker = build_model(model_config, ps, cfg.training.seed, device, on_meta=zero3, execution=execution,
                                     layout=cfg.parallel.pipeline_model_parallel_layout)
    if zero3:  # DataParallel materialises the parameters; the buffers are made here
        for chunk in model:
            chunk.materialize_buffers(device)
    fp8 = attach_fp8(model, cfg.fp8, ps, device)  # --fp8-format: the FP8 linears' sites (model/fp8.py)
    _compile(cfg, model, ps, device)
    named_params = [(n, p) for m in model for n, p in m.global_named_parameters()]
    names = {p: n for n, p in named_params}
    timers = Timers(t.timing_log_level, device)
    # --compile: Inductor traces each layer's backward, so the weight gradients take autograd's
    # way (grad_fusion.py's products mutate the buffer from inside backward)
    dp = build_data_parallel(model, [p for _, p in named_params], ps,
                             dataclasses.replace(cfg.ddp, gradient_accumulation_fusion=False) if t.compile else cfg.ddp,
                             cfg.training.num_microbatches,
                             device=device, init_fn=lambda p: initial_value(p, names[p], cfg.training.seed, ps.tp_group),
                             timers=timers)
    closing.callback(dp.close)
    wgrad_store = _wgrad_store(cfg, model, closing)
    optimizer = build_optimizer(named_params, cfg.optimizer, dp, ps)
    state = TrainState(ps, model_config, named_params, optimizer, build_lr_scheduler(cfg.optimizer), rng_tracker,
                       device, dataclasses.replace(cfg, model=model_config).to_dict(),
                       named_buffers=[nb for m in model for nb in m.global_named_buffers()],
                       spike_guard=SpikeGuard.from_config(t))
    state.log(f"> optimizer: {optimizer.describe()}")
    qk_clip = QKClip.build(model, cfg.optimizer, ps, device, state.log)
    ck = cfg.checkpoint
    non_persistent = NonPersistent.build(cfg, ps, memory)
    if ck.load or (non_persistent is not None and non_persistent.in_memory):  # (in memory: a restart's state)
        monitor.where = "in the checkpoint load"
        state.iteration = _load(state, ck, cfg.training.seed, non_persistent)
        monitor.where = "at start-up"
    datasets = build_datasets(cfg, model_config.vocab_size)
    # activations between stages: this rank's s/c tokens (CP), split over TP under sequence parallelism
    s = cfg.data.seq_length // ps.cp_size // (ps.tp_size if execution.sequence_parallel else 1)
    logging_rank = ps.rank == ps.logging_rank
    straggler = StragglerDetector(ps, device, monitor) if t.log_straggler else None
    run = Run(cfg=cfg, state=state, model=model, dp=dp, datasets=datasets, eod=eod,
              train_batches=batch_iterators(cfg, datasets[0], state.consumed_samples, ps, device, eod, straggler,
                                            timers),
              forward_backward=_schedule(cfg.parallel),
              pipe_comm=PipeComm(ps, (s, cfg.data.micro_batch_size, model_config.hidden_size),
                                 execution.params_dtype, device),
              jsonl=JsonlWriter(cfg.training.log_jsonl if logging_rank else None),
              tracker=Tracker(cfg.tracking, enabled=logging_rank),  # W&B / TensorBoard
              saver=_saver(cfg),
              batch=build_num_microbatches_calculator(cfg.training, ps.dp_size),
              profiler=Profiler(cfg.training, ps.rank, device),
              peak=peak_tflops(cfg.training.peak_tflops, execution.params_dtype), monitor=monitor, timers=timers,
              straggler=straggler, qk_clip=qk_clip, spike_guard=state.spike_guard, last_saved=state.iteration,
              wgrad_store=wgrad_store, timeline=Timeline(device) if t.log_pipeline_timeline else None,
              fp8=fp8, closing=closing)
    run.non_persistent = non_persistent
    run.rerun = RerunMachine.build(cfg.resilience, t, ps, device, state.log, run.jsonl)
    for opened in (run.jsonl, run.tracker, run.saver, run.non_persistent):
        if opened is not None:
            closing.callback(opened.close)
    closing.callback(run.profiler.stop)
    run.tracker.log_config(state.config)
    log_startup(run, malloc)
    if state.load_stats is not None:
        log_checkpoint_load(run)
    if ck.moe_use_upcycling:  # the upcycled model, before any step (Megatron-LM's save at iteration 1)
        run.saver.save(state, state.iteration)
    return run


def _load(state: TrainState, ck, seed: int, non_persistent: NonPersistent | None = None) -> int:
    """The checkpoint under --load into `state`, or a newer non-persistent one (only the newer of
    the two is read); the iteration the run continues from."""
    if non_persistent is not None and not (ck.finetune or ck.moe_use_upcycling):
        newer = non_persistent.newer((read_tracker(ck.load) or 0) if ck.load else 0)
        if newer is not None:
            return non_persistent.load(state, newer, load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng,
                                       strictness=ck.dist_ckpt_strictness)
    if not ck.load:
        return state.iteration
    if ck.moe_use_upcycling:  # a dense checkpoint into this MoE model (checkpoint/upcycling/load.py)
        return load_upcycled(state, ck.load, ck.moe_upcycling_granularity, seed, finetune=ck.finetune,
                             load_rng=not ck.no_load_rng)
    return load_checkpoint(state, ck.load, finetune=ck.finetune, load_optim=not ck.no_load_optim,
                           load_rng=not ck.no_load_rng, strictness=ck.dist_ckpt_strictness,
                           verify_integrity=ck.verify_integrity)


def log_startup(run: Run, malloc: str | None = None) -> None:
    ps, c, t, k = run.state.ps, run.state.model_config, run.cfg.training, run.cfg.kernels
    from .runtime.cpu import slow_bf16_warning  # --bf16 on a CPU without native bf16: say it once
    if (warning := slow_bf16_warning(run.state.device, run.model[0].execution.params_dtype)) is not None:
        run.log(warning)
    lean = [malloc] if malloc else []
    if ps.dp_cp_size > 1 and "ddp.ddp_bucket_size" not in run.cfg.explicit and \
            run.cfg.parallel.distributed_backend == "gloo":
        lean.append(f"--ddp-bucket-size {run.cfg.ddp.ddp_bucket_size} on gloo (not given; NCCL's default is 40000000)")
    if lean:
        run.log(f"> host memory: {'; '.join(lean)}")
    if k.use_flash_attn:
        attention = "flash-attn"
    elif k.attention_backend == "local":
        attention = "megalite's local softmax(QK^T)V"
    else:
        kernels = "" if k.attention_backend == "auto" else f" ({k.attention_backend} kernels)"
        attention = "torch scaled_dot_product_attention" + kernels
    for notice in run.cfg.notices:
        run.log(f"> note: {notice}")
    run.log(f"> megalite: {ps.describe()}, {t.num_microbatches} micro-batches of {t.micro_batch_size} "
            f"per iteration (global batch {t.global_batch_size})")
    if run.batch.steps is not None or run.batch.rampup is not None:
        run.log(f"> batch schedule: {run.batch.describe()}; {t.train_iters} iterations")
    if run.fp8 is not None:
        run.log(f"> {run.fp8.describe()}")
    run.log(f"> model: {count_parameters(run.state) / 1e6:.2f}M parameters, {c.num_layers} layers, "
            f"hidden {c.hidden_size}, {c.num_attention_heads} heads, vocab {c.vocab_size} (padded "
            f"{c.padded_vocab_size}), seq {c.seq_length}, {run.cfg.optimizer.params_dtype}, attention: "
            f"{attention}, device: {run.state.device.type}, backend: "
            f"{run.cfg.parallel.distributed_backend if dist.is_initialized() else 'none'}")
    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank, "cp": ps.cp_rank,
            "num_params": sum(p.numel() for _, p in run.state.named_params),
            "num_expert_params": sum(p.numel() for m in run.model for p in m.expert_parameters()),
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
    local = sum(p.numel() for _, p in state.named_params
                if param_info(p).is_owner(ps.tp_rank) and ps.replica_rank(param_info(p).expert_parallel) == 0)
    return int(sum(comm.all_gather_object(local, comm.world_group())))
