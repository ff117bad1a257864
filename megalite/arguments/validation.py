"""Validation: a RunConfig in, a completed RunConfig out (derived fields filled), or one
`ArgumentError` naming the flags. It runs before torch.distributed is initialised, so a layout
that cannot work stops every rank with the same message instead of hanging in a collective.

0. --use-checkpoint-args: the architecture and tokenizer flags from the checkpoint under --load
   (arguments/checkpoint_args.py), first, so that every check below sees them;
1. each flag's own range, declared with its field (config/fields.py `check`); required flags;
2. combinations across configs: the rank grid, batch and pipeline divisibility (here and
   arguments/batch.py), model shape, recompute, CP, precision (arguments/model.py), the data source
   (arguments/data.py), the learning-rate schedule, checkpointing, trackers, operations, and the
   Megatron-LM flags megalite refuses;
3. files (arguments/paths.py, only with `check_files`): datasets, tokenizer files, the checkpoint
   to load, and outputs that must not overwrite anything; then the learning-rate schedule against
   the checkpoint's (arguments/schedule_args.py).

torch is imported only at the very end of a successful validation, so a bad flag is refused in a
fraction of a second."""
from __future__ import annotations

import copy
import os
from dataclasses import fields

from ..config.fields import flagged_fields
from ..config.megatron import KERNEL_NOTICES, PENDING, SCHEDULE_NOTICES
from ..config.run import SECTIONS, RunConfig
from ..config.sharding import get_strategy
from .attention_variant import check_attention_variant
from .batch import check_batch_schedule, check_lr_schedule
from .checkpoint_args import apply_checkpoint_args
from .data import check_data
from .errors import fail, flag
from .fsdp import check_fsdp
from .pipeline_split import apply_pipeline_split
from .resilience import check_inprocess_backend, check_resilience
from .context_parallel import check_cp_comm_type
from .fp8 import check_fp8
from .model import check_attention_backend, check_context_parallel, check_model_shape, check_precision, \
    check_recompute
from .moe import check_moe
from .muon import check_muon
from .optimizer import check_optimizer_precision, check_qk_clip
from .paths import check_paths
from .schedule_args import check_schedule_flags, settle_schedule
from .upcycling import check_upcycling


def validate(config: RunConfig, world_size: int | None = None, check_files: bool = True) -> RunConfig:
    """Check `config` for `world_size` ranks (default $WORLD_SIZE) and return it completed; the
    argument is left as it was. No collective; file checks (stat and small reads) only with
    `check_files`."""
    c = copy.deepcopy(config)
    c.notices = list(c.notices)
    c.parallel.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    apply_checkpoint_args(c)  # reads metadata.json, with or without check_files: the model needs it
    _check_ranges(c)
    _check_refused(c)
    _check_layout(c)
    check_model_shape(c)
    check_moe(c)
    check_attention_variant(c)
    check_fsdp(c)
    check_context_parallel(c)
    check_cp_comm_type(c)
    check_recompute(c)
    check_data(c)
    check_lr_schedule(c)
    check_precision(c)
    check_muon(c)
    check_optimizer_precision(c)
    check_fp8(c)
    check_qk_clip(c)
    check_resilience(c)
    _check_operations(c)
    _check_outputs(c)
    check_upcycling(c, check_files)
    if check_files:
        check_paths(c)
        settle_schedule(c)  # a resume's learning-rate schedule against its checkpoint's (metadata.json)
    _check_with_torch(c, check_files)
    _fill_copies(c)
    return c


def _check_ranges(c: RunConfig) -> None:
    for section, cls in SECTIONS.items():
        for f, fl in flagged_fields(cls):
            if fl.required and f"{section}.{f.name}" not in c.explicit:
                fail(f"{fl.name} is required")
    for section, cls in SECTIONS.items():
        values = getattr(c, section)
        for f, fl in flagged_fields(cls):
            v = getattr(values, f.name)
            if fl.check is not None and v is not None and not fl.check[0](v):  # NaN fails every comparison
                fail(f"{fl.name} must be {fl.check[1]}, got {v}")


def _check_refused(c: RunConfig) -> None:
    """Megatron-LM flags megalite does not implement, and values of accepted flags it cannot honour."""
    m = c.megatron
    by_name = {f.name: fl for f, fl in flagged_fields(type(m))}
    for name, missing in PENDING.items():
        if getattr(m, name) != getattr(type(m)(), name):
            fail(f"{by_name[name].name} is not supported: {missing}; drop it")
    _check_ckpt_format(c)
    if not m.add_position_embedding and c.model.position_embedding_type != "rope":
        fail(f"--no-position-embedding is deprecated, use --position-embedding-type (Megatron-LM accepts it only "
             f"with rope, not {c.model.position_embedding_type})")
    _kernel_notices(c)


def _check_ckpt_format(c: RunConfig) -> None:
    """--ckpt-format: torch_dist is written (checkpoint/megatron/saver.py); --load reads it whatever the flag."""
    fmt, ck = c.megatron.ckpt_format, c.checkpoint
    if ck.verify_integrity and fmt != "torch_dist":
        fail("--verify-integrity needs --ckpt-format torch_dist (as in Megatron-LM, where the integrity manifest is "
             "a torch_dist feature)")
    if ck.ckpt_fully_parallel_save_deprecated:
        c.notices.append("--ckpt-fully-parallel-save is deprecated in Megatron-LM: fully parallel save is the default "
                         "(--no-ckpt-fully-parallel-save turns it off)")
    if ck.ckpt_fully_parallel_load:
        c.notices.append("--ckpt-fully-parallel-load: megalite's loads always work this way (each data-parallel "
                         "replica reads its share of the checkpoint, the group sums bring it to the others)")
    if ck.dist_ckpt_optim_fully_reshardable and fmt != "torch_dist":
        c.notices.append("--dist-ckpt-optim-fully-reshardable: megalite's own format keeps the optimizer state "
                         "reshardable over TP, PP, EP and DP always")
    if fmt is None or fmt == "torch_dist":
        return
    if fmt == "fsdp_dtensor":  # Megatron FSDP's torch.distributed.checkpoint files: torch_dist is that container
        c.megatron.ckpt_format = "torch_dist"
        c.notices.append("--ckpt-format fsdp_dtensor: megalite writes torch_dist in its place (the same "
                         "torch.distributed.checkpoint container, Megatron-LM's keys; megatron-core loads it, and so "
                         "does --load), its FSDP parameter layout being megalite's ZeRO-3 slices")
        return
    if fmt == "torch":  # per-rank pickles bound to one layout: megalite's own per-rank files in their place
        c.megatron.ckpt_format = None
        c.notices.append("--ckpt-format torch: megalite writes its own format in its place (one file per rank with "
                         "the weights, optimizer state, RNG and schedule, loadable on any layout; Megatron-LM's torch "
                         "files are pickles bound to the saving layout; --load reads either, and tools/checkpoint/"
                         "convert.py --saver megatron makes a torch_dist checkpoint of it)")
        return
    what = {"torch": "one pickled model_optim_rng.pt per model-parallel rank",
            "zarr": "Megatron-LM's zarr distributed checkpoints",
            "torch_dcp": "torch.distributed.checkpoint files", "fsdp_dtensor": "FSDP DTensor checkpoints"}
    fail(f"--ckpt-format {fmt} ({what[fmt]}) is not supported: megalite writes its own format (the default, "
         f"loadable on any layout) or Megatron-LM's torch_dist (--ckpt-format torch_dist); drop the flag or use "
         f"torch_dist")


def _kernel_notices(c: RunConfig) -> None:
    """Megatron-LM's kernel-only choices: one notice line each saying what runs here instead (the
    same function; FP8, which is not, has its own section: arguments/fp8.py)."""
    m, p = c.megatron, c.parallel
    k = c.kernels
    if k.cross_entropy_fusion_impl == "te":
        c.notices.append("--cross-entropy-fusion-impl te: Transformer Engine's cross entropy is not used here; "
                         "megalite's native one runs (the same loss)"
                         + ("" if k.cross_entropy_loss_fusion else ", and without --cross-entropy-loss-fusion "
                            "the flag has no effect (as in Megatron-LM)"))
        k.cross_entropy_fusion_impl = "native"
    if m.transformer_impl == "transformer_engine":
        c.notices.append("--transformer-impl transformer_engine: megalite's own layers run instead (the same "
                         "function; it does not use NVIDIA Transformer Engine)")
    defaults = type(m)()
    for name, (given, instead) in KERNEL_NOTICES.items():
        if getattr(m, name) != getattr(defaults, name):
            c.notices.append(f"{given}: a Megatron-LM kernel choice; {instead} (the same function)")
    for name, (given, instead) in SCHEDULE_NOTICES.items():
        if getattr(m, name) not in (getattr(defaults, name), None):
            c.notices.append(f"{given}: a Megatron-LM GPU overlap, graph or worker choice; {instead} (the same "
                             f"function)")
    if p.moe_token_dispatcher_type == "flex":
        backend = m.moe_flex_dispatcher_backend or "deepep"
        c.notices.append(f"--moe-token-dispatcher-type flex ({backend} kernels): megalite's alltoall dispatcher "
                         "runs instead (the same function)")
        p.moe_token_dispatcher_type = "alltoall"
    elif m.moe_flex_dispatcher_backend is not None:
        c.notices.append(f"--moe-flex-dispatcher-backend {m.moe_flex_dispatcher_backend} has no effect without "
                         "--moe-token-dispatcher-type flex (Megatron-LM accepts and ignores it there)")
    if m.accumulate_allreduce_grads_in_fp32 and c.ddp.grad_reduce_in_bf16:
        fail("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16: give one")


def _check_layout(c: RunConfig) -> list[int]:
    """The rank grid, the batch schedule, pipeline stages and virtual chunks."""
    p, world = c.parallel, c.parallel.world_size
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world % (tp * pp * cp):
        fail(f"world size {world} is not divisible by --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp})" + (f" x --context-parallel-size ({cp})" if cp > 1 else ""))
    p.data_parallel_size = dp = world // (tp * pp * cp)
    p.rank_order = "tp-cp-pp-dp" if p.use_tp_pp_dp_mapping else "tp-cp-dp-pp"
    cp_text = f" x CP {cp}" if cp > 1 else ""
    batch_sizes = check_batch_schedule(c, f"data-parallel size ({dp} = world {world} / (TP {tp} x PP {pp}{cp_text}))")
    apply_pipeline_split(c)
    layers = c.model.num_layers
    p.virtual_pipeline_model_parallel_size = 1
    k = p.num_layers_per_virtual_pipeline_stage
    if p.pipeline_model_parallel_layout is not None:
        p.virtual_pipeline_model_parallel_size = _check_stage_layout(c)
    elif layers % pp:
        fail(f"--num-layers ({layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    else:
        if k is None and p.pipeline_schedule == V_SCHEDULE and pp >= 2:
            k = _v_chunks(c)
        if k is not None:
            if pp < 2:
                fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
            if (layers // pp) % k:
                fail(f"--num-layers ({layers}) / --pipeline-model-parallel-size ({pp}) = {layers // pp} layers per "
                     f"stage is not divisible by --num-layers-per-virtual-pipeline-stage ({k})")
            p.virtual_pipeline_model_parallel_size = layers // (pp * k)
    # (zbv's order, a list scheduler's, runs any number of micro-batches)
    if p.virtual_pipeline_model_parallel_size > 1 and p.pipeline_schedule in (None, "interleaved_1f1b"):
        _check_microbatch_groups(c, batch_sizes)
    elif p.microbatch_group_size_per_vp_stage is not None:
        c.notices.append("--microbatch-group-size-per-virtual-pipeline-stage has no effect without virtual pipeline "
                         "stages (the interleaved schedule; Megatron-LM accepts it there)")
    return batch_sizes


# pipeline_parallel/schedules.py's schedule whose chunks stand in a V (named here: validation's
# layout checks run before torch, which the schedules' module imports)
V_SCHEDULE = "zbv"


def _v_chunks(c: RunConfig) -> int:
    """zbv without --num-layers-per-virtual-pipeline-stage: its two chunks per rank, said in a
    notice; the layers per chunk it implies."""
    p, layers = c.parallel, c.model.num_layers
    chunks = 2 * p.pipeline_model_parallel_size
    if layers % chunks:
        fail(f"--pipeline-schedule {V_SCHEDULE} runs 2 model chunks per pipeline rank: --num-layers ({layers}) must be "
             f"divisible by 2 x --pipeline-model-parallel-size ({chunks})")
    p.num_layers_per_virtual_pipeline_stage = layers // chunks
    c.notices.append(f"--pipeline-schedule {V_SCHEDULE}: 2 model chunks per pipeline rank in a V, "
                     f"{layers // chunks} layer(s) each (--num-layers-per-virtual-pipeline-stage {layers // chunks})")
    return layers // chunks


def _check_microbatch_groups(c: RunConfig, batch_sizes: list[int]) -> None:
    """The interleaved schedule runs micro-batches in groups of g (default PP) through each chunk
    (Megatron-LM's get_schedule_table): PP <= g <= micro-batches, the last group 0 or >= PP."""
    p, t = c.parallel, c.training
    pp, dp = p.pipeline_model_parallel_size, p.data_parallel_size
    g = p.microbatch_group_size_per_vp_stage or pp
    name = "--microbatch-group-size-per-virtual-pipeline-stage" if p.microbatch_group_size_per_vp_stage else \
        "--pipeline-model-parallel-size"
    counts = sorted({b // (t.micro_batch_size * dp) for b in batch_sizes} | {t.eval_num_microbatches})
    for m in counts:
        if not pp <= g <= m or 0 < m % g < pp:
            fail(f"the interleaved schedule runs the micro-batches in groups of {name} ({g}) through each model "
                 f"chunk: it needs PP ({pp}) <= {g} <= the {m} micro-batches of an iteration (global batch / "
                 f"(--micro-batch-size x DP)) and the last group's remainder ({m % g}) 0 or >= PP")


def _check_stage_layout(c: RunConfig) -> int:
    """--pipeline-model-parallel-layout: parsed against PP, --num-layers and --mtp-num-layers; returns
    the virtual stages per rank it implies."""
    from ..config.pipeline_layout import LayoutError, parse_layout
    p = c.parallel
    if p.num_layers_per_virtual_pipeline_stage is not None:
        fail("--pipeline-model-parallel-layout conflicts with --num-layers-per-virtual-pipeline-stage: the layout "
             "already says how many virtual stages each rank has (stages / PP); give one of the two")
    try:
        layout = parse_layout(p.pipeline_model_parallel_layout, p.pipeline_model_parallel_size, c.model.num_layers,
                              c.model.mtp_num_layers)
    except LayoutError as e:
        fail(str(e))
    if layout.vpp > 1 and p.pipeline_model_parallel_size == 1:  # as --num-layers-per-virtual-pipeline-stage
        fail(f"--pipeline-model-parallel-layout {p.pipeline_model_parallel_layout!r} has {len(layout.stages)} stages: "
             f"virtual stages need --pipeline-model-parallel-size >= 2 (with PP 1 give one stage, e.g. 'EttL')")
    return layout.vpp


def _check_pipeline_schedule(c: RunConfig) -> None:
    """--pipeline-schedule: a registered name the layout can run (default: the one it implies)."""
    from ..pipeline_parallel.schedules import check_schedule, default_schedule_name
    p = c.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if p.pipeline_schedule is None:
        p.pipeline_schedule = default_schedule_name(pp, vpp)
    why = check_schedule(p.pipeline_schedule, pp, vpp)  # the message names the flags
    if why:
        fail(why)
    _check_zero_bubble(c)


def _check_zero_bubble(c: RunConfig) -> None:
    """zb_h1 / zbv: the split backward (--delay-wgrad-compute, switched on) and what it cannot run with."""
    from ..pipeline_parallel.schedules import splits_backward, v_shape
    p, name = c.parallel, c.parallel.pipeline_schedule
    if not splits_backward(name):
        if p.delay_wgrad_compute and c.megatron.overlap_moe_expert_parallel_comm:  # an overlap: the same function
            c.notices.append("--delay-wgrad-compute with --overlap-moe-expert-parallel-comm: Megatron-LM defers weight "
                             "gradients to overlap the expert-parallel all-to-alls, which megalite runs in turn: the "
                             "weight gradients are computed in each backward (the same function)")
            p.delay_wgrad_compute = False
        elif p.delay_wgrad_compute:
            fail(f"--delay-wgrad-compute defers weight gradients for a zero-bubble schedule to place: use "
                 f"--pipeline-schedule zb_h1 or zbv (got {name}; Megatron-LM's other use, "
                 f"--overlap-moe-expert-parallel-comm, is not built)")
        return
    p.delay_wgrad_compute = True
    if c.training.compile:
        fail(f"--pipeline-schedule {name} cannot run with --compile: its deferred weight-gradient functions "
             f"(--delay-wgrad-compute) are not traced by torch.compile")
    if v_shape(name):
        m = c.model
        if m.mtp_num_layers:
            fail(f"--pipeline-schedule {name} cannot run --mtp-num-layers (MTP sits with the loss, in rank 0's "
                 f"second chunk, which this layout does not build)")
        if p.pipeline_model_parallel_layout is not None:
            fail(f"--pipeline-schedule {name} places even chunks in a V: drop --pipeline-model-parallel-layout")


def _check_operations(c: RunConfig) -> None:
    """Profiling, determinism, timeouts and garbage collection."""
    t = c.training
    if t.profile:
        if t.profile_step_end <= t.profile_step_start:
            fail(f"--profile-step-end ({t.profile_step_end}) must be greater than --profile-step-start "
                 f"({t.profile_step_start})")
        if t.profile_step_start >= t.train_iters:
            fail(f"--profile-step-start ({t.profile_step_start}) is not below the {t.train_iters} training "
                 f"iterations: nothing would be traced")
        bad = [r for r in t.profile_ranks if not 0 <= r < c.parallel.world_size]
        if bad:
            fail(f"--profile-ranks {bad[0]} is not a rank of this run (world size {c.parallel.world_size})")
        t.profile_dir = c.tracking.tensorboard_dir or "profile"
    else:
        for name in ("profile_step_start", "profile_step_end", "profile_ranks"):
            if f"training.{name}" in c.explicit:
                fail(f"{flag(name)} needs --profile")
        t.profile_dir = None
    if t.deterministic_mode:
        if c.kernels.use_flash_attn:
            fail("--deterministic-mode cannot use --use-flash-attn (its backward is not deterministic)")
        if c.kernels.cross_entropy_loss_fusion:
            fail("--deterministic-mode refuses --cross-entropy-loss-fusion, as Megatron-LM does")
    _check_dry_run(c)
    explicit_softmax = c.kernels.attention_backend == "local" or c.model.softmax_type != "vanilla"  # sinks: local's
    if "kernels.attention_softmax_in_fp32" in c.explicit and (not explicit_softmax or c.kernels.use_flash_attn):
        c.notices.append(f"--attention-softmax-in-fp32 has no effect with --attention-backend "
                         f"{c.kernels.attention_backend}{' and --use-flash-attn' if c.kernels.use_flash_attn else ''}: "
                         f"SDPA's and flash-attn's kernels choose their own softmax precision (Megatron-LM accepts it "
                         f"there too); it acts on --attention-backend local (and with --softmax-type)")
    if not (t.check_for_spiky_loss or t.check_for_large_grads):
        for name in ("spike_factor", "spike_window", "spike_patience"):
            if f"training.{name}" in c.explicit:
                fail(f"{flag(name)} needs --check-for-spiky-loss or --check-for-large-grads")
    if t.test_mode and not c.model.qk_layernorm:
        c.notices.append("--test-mode checks the --qk-layernorm weights' replicas; this model has none (Megatron-LM "
                         "runs no test then either)")
    if t.test_mode and get_strategy(c.ddp.data_parallel_sharding_strategy).shards_params:
        fail("--test-mode compares whole parameters across ranks; under ZeRO-3 (--data-parallel-sharding-strategy "
             "optim_grads_params) each rank holds slices of them")
    if not t.manual_gc and (t.manual_gc_interval or not t.manual_gc_eval):
        fail("--manual-gc-interval / --no-manual-gc-eval need --manual-gc")
    if "training.compile_scope" in c.explicit and not t.compile:
        fail("--compile-scope needs --compile")
    if t.compile and t.compile_scope == "decoder" and c.recompute.recompute_granularity == "full":
        fail("--compile-scope decoder cannot run with --recompute-granularity full: the recomputed layers run "
             "inside an eager checkpoint, outside the compiled region; use --compile-scope layer (compiled "
             "layers inside the checkpoint)")


def _check_dry_run(c: RunConfig) -> None:
    """--dry-run / --fake-process-group: which world, and what a dry run does not do."""
    t, p = c.training, c.parallel
    if p.fake_process_group:
        rank = os.environ.get("RANK", "0")
        if not rank.isdigit() or int(rank) >= p.world_size:
            fail(f"--fake-process-group makes this process rank $RANK of $WORLD_SIZE ({p.world_size}): RANK must be "
                 f"an integer in [0, {p.world_size}), got {rank!r}")
    if not t.dry_run:
        return
    if p.world_size > 1 and not p.fake_process_group:
        fail(f"--dry-run with WORLD_SIZE {p.world_size} needs --fake-process-group: meta tensors hold no values "
             "to communicate (one process stands for one rank of the world)")
    if t.compile:
        fail("--dry-run cannot --compile: Inductor needs real tensors")
    if c.optimizer.optimizer_cpu_offload:
        fail("--dry-run cannot --optimizer-cpu-offload: the offloaded state is real host memory")
    ignored = [(c.checkpoint.save, "--save", "it writes no checkpoint"),
               (c.checkpoint.load, "--load", "it builds the model on the meta device, without values to load"),
               (c.tracking.tensorboard_dir, "--tensorboard-dir", "it logs to stdout and --log-jsonl only"),
               (c.tracking.wandb_project, "--wandb-project", "it logs to stdout and --log-jsonl only"),
               (c.data.data_path, "--data-path", "its micro-batches are meta tensors of the right shapes"),
               (t.timing_log_level, "--timing-log-level", "it times nothing"),
               (t.log_timers_to_tensorboard, "--log-timers-to-tensorboard", "it times nothing")]
    for value, name, why in ignored:
        if value:
            c.notices.append(f"{name} is not used by --dry-run: {why}")


def _check_outputs(c: RunConfig) -> None:
    """Experiment trackers (optional packages, checked before any process starts) and checkpointing."""
    from ..runtime.tracking import missing_packages
    tr, ck = c.tracking, c.checkpoint
    for msg in missing_packages(tr):
        fail(msg)
    for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
        if getattr(tr, name) and not tr.wandb_project:
            fail(f"{flag(name)} needs --wandb-project")
    if ck.save_interval and not ck.save:  # Megatron-LM accepts it and saves nothing
        c.notices.append("--save-interval has no effect without --save: no checkpoint is written (Megatron-LM accepts "
                         "it there too)")
    if ck.async_save and not ck.save:
        fail("--async-save needs --save")
    if ck.finetune and not ck.load:
        fail("--finetune needs --load")
    for name in ("no_load_optim", "no_load_rng"):  # Megatron-LM's gpt-oss script passes them without --load
        if getattr(ck, name) and not ck.load:
            c.notices.append(f"{flag(name)} has no effect without --load (Megatron-LM accepts and ignores it there)")
    check_schedule_flags(c)
    t = c.training
    if t.log_timers_to_tensorboard and not (tr.tensorboard_dir or tr.wandb_project or t.log_jsonl or t.dry_run):
        c.notices.append("--log-timers-to-tensorboard writes to --tensorboard-dir, --wandb-project and --log-jsonl, "
                         "none of which is given: the timers only reach the console (at --timing-log-level 1 or 2)")


# --ddp-bucket-size where it is not given, on gloo: a bucket is also what ZeRO-2/3 stage and
# gather at once, and gloo gains little from NCCL's large buckets; 4M elements (16 MB in fp32)
# took the 729M-parameter ZeRO-3 run from 2.64 to 2.06 GB per rank at the same step time
# (docs/zero.md, "The memory wall"). NCCL keeps Megatron-LM's 40M, and so do plans and dry runs.
GLOO_BUCKET_SIZE = 4_000_000


def _check_with_torch(c: RunConfig, check_files: bool) -> None:
    """Last, the checks that need torch (imported only now: a bad flag above is refused fast)."""
    import torch
    _check_pipeline_schedule(c)  # (the schedules' module imports torch)
    k, p, t = c.kernels, c.parallel, c.training
    if k.use_flash_attn:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            fail("--use-flash-attn needs the flash-attn package (pip install flash-attn); it is not installed")
        if not torch.cuda.is_available() or not c.optimizer.bf16:
            fail("--use-flash-attn needs CUDA and --bf16")
    if p.distributed_backend is None:
        p.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if p.distributed_backend == "nccl" and not torch.cuda.is_available():
        # a backend choice: the same collectives, on the CPU's backend (Megatron-LM's scripts pass nccl)
        c.notices.append("--distributed-backend nccl: no CUDA here, so the collectives run on gloo (the same function)")
        p.distributed_backend = "gloo"
    check_inprocess_backend(c)
    if p.distributed_backend == "nccl" and p.pipeline_schedule in ("zb_h1", "zbv"):
        fail(f"--pipeline-schedule {p.pipeline_schedule} runs on --distributed-backend gloo only: its runtime posts "
             f"sends at once and receives when its order needs them, streams told apart by tag; NCCL ignores tags "
             f"and runs a pair's sends and receives in order on one stream, which that can deadlock")
    if p.distributed_backend == "gloo" and "ddp.ddp_bucket_size" not in c.explicit and not t.dry_run:
        c.ddp.ddp_bucket_size = GLOO_BUCKET_SIZE  # (a dry run stands for the job's machine, NCCL's)
    if check_files:  # a probe on this machine's device; tools/plan.py plans for another one
        check_attention_backend(c)
    if t.deterministic_mode and p.distributed_backend == "nccl":
        if not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            fail("--deterministic-mode on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS)")
        algos = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
        if os.environ.get("NCCL_ALGO") not in algos:
            fail(f"--deterministic-mode needs NCCL_ALGO set to one of {', '.join(algos)} (as Megatron-LM)")
    if c.recompute.fine_grained_activation_offloading and p.distributed_backend != "nccl":
        c.notices.append("--fine-grained-activation-offloading: on the CPU the activations are in host memory "
                         "already; nothing moves (it acts on CUDA)")
    if t.empty_unused_memory_level and p.distributed_backend != "nccl":
        c.notices.append(f"--empty-unused-memory-level {t.empty_unused_memory_level}: a no-op on CPU "
                         f"(it frees cached CUDA memory)")


def _fill_copies(c: RunConfig) -> None:
    """Derived fields that copy a value another config owns (`derived(copy_of=...)`)."""
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            source = f.metadata.get("copy_of")
            if source:
                owner, name = source.split(".")
                setattr(getattr(c, section), f.name, getattr(getattr(c, owner), name))
