"""The loop: batch and length, evaluation, logging, profiling, exits and operations; checkpoint
cadence; experiment trackers."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import AT_LEAST_0, AT_LEAST_1, POSITIVE, at_least_0, derived, flag


@dataclass
class TrainingConfig:
    """training"""
    micro_batch_size: int = flag("--micro-batch-size", 1, "samples per micro-batch per DP rank (>= 1; required)",
                                 check=AT_LEAST_1, required=True)
    global_batch_size: int | None = flag(
        "--global-batch-size", None, "samples per iteration (>= 1, a multiple of micro x DP; default micro x DP); "
        "with --rampup-batch-size the batch it ramps up to", type=int, check=AT_LEAST_1)
    rampup_batch_size: list[int] | None = flag(
        "--rampup-batch-size", None, "ramp the global batch from START by INCREMENT up to --global-batch-size, "
        "evenly over the first SAMPLES samples (Megatron-LM's syntax; needs --train-samples, as there)", type=int,
        nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    step_batch_size_schedule: str | None = flag(
        "--step-batch-size-schedule", None, "global batch by tokens consumed, e.g. '0:768 250B:1536' (K/M/B/T "
        "suffixes; thresholds // --seq-length give samples; the first is 0); the last batch is the global batch, "
        "so --global-batch-size is refused beside it; with --train-iters or --train-samples", type=str, metavar="'TOKENS:BATCH ...'")
    # with --train-samples: the whole global batches that fit in them
    train_iters: int | None = flag("--train-iters", None, "iterations to train (>= 1); this or --train-samples is "
                                   "required", type=int, check=AT_LEAST_1)
    train_samples: int | None = flag(
        "--train-samples", None, "samples to train (>= 1): as many whole global batches as fit (the schedule, the "
        "batch ramp-up and --lr-*-samples then count samples)", type=int, check=AT_LEAST_1)
    calculate_per_token_loss: bool = flag(
        "--calculate-per-token-loss", False, "the gradient of the loss summed over the global batch's tokens / "
        "their number (Megatron-LM's per-token loss); default: each micro-batch's token mean, averaged over "
        "micro-batches and DP ranks (Megatron-LM's default); the same unless tokens are masked", action="store_true")
    deterministic_mode: bool = flag(
        "--deterministic-mode", False, "torch.use_deterministic_algorithms(True); refuses flash-attn and the fused "
        "cross entropy, and with NCCL needs CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO set (Megatron-LM's rules)",
        action="store_true")
    empty_unused_memory_level: int = flag(
        "--empty-unused-memory-level", 0, "torch.cuda.empty_cache() where Megatron-LM calls it: 1 after each "
        "forward-backward (training and evaluation), 2 also after the optimizer step; a no-op on CPU",
        choices=[0, 1, 2])
    seed: int = flag("--seed", 1234, "random seed, in [0, 2^31)", check=(lambda v: 0 <= v < 2**31,
                                                                       "an integer in [0, 2^31)"))
    dry_run: bool = flag("--dry-run", False, "build this rank's model, gradients, optimizer state and ZeRO buffers "
                         "on the meta device (no memory, no values), run one iteration (every micro-batch of the "
                         "pipeline schedule and the optimizer step), print the bytes by category and exit (with "
                         "--log-jsonl: a dry_run record); with --fake-process-group, any rank of any world size",
                         action="store_true")
    compile: bool = flag("--compile", False, "torch.compile each transformer layer (Inductor); compiled during the "
                         "first iteration", action="store_true")
    compile_scope: str = flag(
        "--compile-scope", "layer", "with --compile, what one compiled region is: 'layer', each transformer layer "
        "(one graph serves every layer: the shortest compile); 'decoder', each model chunk's whole layer stack "
        "and final norm (one forward and one backward region per chunk: the least host work per step; compile "
        "time grows with the layers)", choices=["layer", "decoder"])
    # logging and evaluation
    log_interval: int = flag("--log-interval", 100, "iterations between log lines (>= 1)", check=AT_LEAST_1)
    log_jsonl: str | None = flag("--log-jsonl", None, "append one JSON object per logged iteration / evaluation to "
                                 "this file", type=str)
    peak_tflops: float | None = flag("--peak-tflops", None, "per-device peak for MFU (> 0; default: known GPUs "
                                     "only)", type=float, check=POSITIVE)
    log_throughput: bool = flag("--log-throughput", False, "add TFLOP/s per device (and MFU where the peak is "
                                "known) to the console line (the JSONL record always has them)", action="store_true")
    log_params_norm: bool = flag("--log-params-norm", False, "add the global norm of the parameters to each log "
                                 "line (an extra all-reduce)", action="store_true")
    log_memory_to_tensorboard: bool = flag(
        "--log-memory-to-tensorboard", False, "add memory (CUDA allocated / peak / reserved bytes; max RSS on CPU) "
        "to each logged record, and so to TensorBoard / W&B", action="store_true")
    # per-phase timers (runtime/timers.py)
    timing_log_level: int = flag(
        "--timing-log-level", 0, "Megatron-LM's timers, each a block '(min, max) time across ranks (ms):' under the "
        "log line (ms per iteration over the interval); 0: the iteration time only (the log line's); 1: also "
        "forward-backward, all-grads-sync, params-all-gather (ZeRO-1/2), optimizer, and save-checkpoint (its own "
        "block after each save); 2: also batch-generator. On CUDA a timed phase synchronises the device at its "
        "start and end (level 2: around every micro-batch); level 0 adds nothing. Megatron-LM's other level-2 "
        "timers (forward-compute, backward-compute, pipeline send/recv) are not kept", choices=[0, 1, 2], type=int)
    log_timers_to_tensorboard: bool = flag(
        "--log-timers-to-tensorboard", False, "write the timers of --timing-log-level (at level 0 the iteration "
        "time) at each log interval, and save-checkpoint after each save, to TensorBoard / W&B as "
        "timers/<name> (the max over ranks, ms per iteration) and as a 'timers' record to --log-jsonl (min and "
        "max); without TensorBoard or W&B, to --log-jsonl only", action="store_true")
    # --profile: torch.profiler over iterations (profile_step_start, profile_step_end] on profile_ranks
    profile: bool = flag(
        "--profile", False, "torch.profiler trace (CPU and CUDA activity, shapes) of the iterations after "
        "--profile-step-start up to --profile-step-end, one file per profiled rank, written to --tensorboard-dir "
        "(TensorBoard's profiler plugin reads it; as Megatron-LM's --use-pytorch-profiler), else ./profile",
        action="store_true")
    profile_step_start: int = flag("--profile-step-start", 10, "with --profile: iterations completed when the trace "
                                   "starts (>= 0)", check=AT_LEAST_0)
    profile_step_end: int = flag("--profile-step-end", 12, "with --profile: iterations completed when it stops "
                                 "(> start)", check=AT_LEAST_1)
    profile_ranks: list[int] = flag("--profile-ranks", None, "with --profile: global ranks to trace (default: 0, as "
                                    "Megatron-LM)", type=int, nargs="+", default_factory=lambda: [0])
    eval_interval: int = flag("--eval-interval", 1000, "iterations between evaluations (>= 1)", check=AT_LEAST_1)
    eval_iters: int = flag("--eval-iters", 100, "global batches per evaluation (>= 0; 0: none)",
                           check=at_least_0("0: no evaluation"))
    eval_global_batch_size: int | None = flag(
        "--eval-global-batch-size", None, "samples per evaluation iteration (>= 1, a multiple of micro x DP; "
        "default --global-batch-size; Megatron-LM's)", type=int, check=AT_LEAST_1)
    exit_signal_handler: bool = flag("--exit-signal-handler", False, "on SIGTERM, save and exit cleanly",
                                     action="store_true")
    exit_interval: int | None = flag("--exit-interval", None, "exit (after saving) when the iteration is a multiple "
                                     "of this (>= 1)", type=int, check=AT_LEAST_1)
    exit_duration_in_mins: float | None = flag("--exit-duration-in-mins", None, "exit (after saving) after this many "
                                               "minutes (> 0)", type=float, check=POSITIVE)
    # operations: NaN checks, stragglers, garbage collection
    check_for_nan_in_loss_and_grad: bool = flag(
        "--check-for-nan-in-loss-and-grad", True, "stop the run, naming the iteration and the rank(s), when the "
        "loss or the gradients hold a NaN or Inf, before the optimizer writes them into the weights; a checkpoint "
        "with non-finite weights is refused. With --fp16 an overflow still just skips the step (loss scaling)",
        action="boolean_optional")
    # loss-spike and large-gradient guard (runtime/spikes.py)
    check_for_spiky_loss: bool = flag(
        "--check-for-spiky-loss", False, "skip the update of an iteration whose loss is at least --spike-factor "
        "times the largest of the last --spike-window accepted ones (Megatron-LM's flag; its factor, 10); checkpoints "
        "are then written only once the next iteration's loss shows their weights still train", action="store_true")
    check_for_large_grads: bool = flag(
        "--check-for-large-grads", False, "the same for the global gradient norm (before clipping): the update of "
        "an iteration whose gradient norm spikes is skipped (Megatron-LM's flag)", action="store_true")
    spike_factor: float = flag("--spike-factor", 10.0, "a loss or gradient norm at least this many times the largest "
                               "of the last --spike-window accepted ones is a spike (> 1)",
                               check=(lambda v: v == v and 1 < v < float("inf"), "a number > 1"))
    spike_window: int = flag("--spike-window", 100, "accepted iterations whose largest loss (gradient norm) is the "
                             "baseline, from the second iteration on with as many as there are yet (saved in "
                             "checkpoints; Megatron-LM: the first 100)", check=AT_LEAST_1)
    spike_patience: int = flag("--spike-patience", 5, "consecutive skipped iterations after which the run stops "
                               "without saving (its latest checkpoint is the last one whose weights trained on)",
                               check=AT_LEAST_1)
    log_straggler: bool = flag(
        "--log-straggler", False, "add each rank's compute time (step time minus time blocked in collectives) and "
        "data-wait time, min and max with their ranks, to every log line, and a 'straggler' JSONL record with every "
        "rank's; on CUDA also GPU power, temperature and clock (needs pynvml)", action="store_true")
    log_pipeline_timeline: bool = flag(
        "--log-pipeline-timeline", False, "at each log interval, a 'pipeline_timeline' record to --log-jsonl with "
        "every rank's F, B and W (BW: a whole backward) start and end per micro-batch of the logged iteration, and "
        "each rank's idle fraction, also printed (one gather per logged iteration); tools/plot_metrics.py draws it",
        action="store_true")
    manual_gc: bool = flag(
        "--manual-gc", False, "disable Python's automatic garbage collector; collect at the same iterations on every "
        "rank (--manual-gc-interval) and around each evaluation, so no rank stalls the others at random",
        action="store_true")
    manual_gc_interval: int = flag("--manual-gc-interval", 0, "with --manual-gc: collect every this many iterations "
                                   "(>= 0; 0: only around evaluations)",
                                   check=at_least_0("0: only around evaluations"))
    logging_level: int | None = flag(
        "--logging-level", None, "the level of Python's root logger (10 DEBUG ... 50 CRITICAL; default: "
        "$MEGATRON_LOGGING_LEVEL, else unchanged), as Megatron-LM sets it: what torch and the libraries log; "
        "megalite's own lines are printed", type=int)
    test_mode: bool = flag(
        "--test-mode", False, "Megatron-LM's real-time consistency test: each iteration the --qk-layernorm weights "
        "are compared across the tensor- and data-parallel ranks, and a discrepancy stops the run naming the ranks",
        action="store_true")
    manual_gc_eval: bool = flag("--no-manual-gc-eval", True, "with --manual-gc: do not collect at the start and end "
                                "of each evaluation", action="store_false")
    num_microbatches: int = derived(1, "global batch / (micro batch x DP), at the final global batch")
    eval_num_microbatches: int = derived(1, "evaluation global batch / (micro batch x DP)")
    profile_dir: str | None = derived(None, "--tensorboard-dir, else ./profile, with --profile")
    seq_length: int = derived(1024, copy_of="model.seq_length")


@dataclass
class CheckpointConfig:
    """checkpointing"""
    save: str | None = flag("--save", None, "directory to save checkpoints to; one that already holds checkpoints "
                            "must also be --load (resume), so that nothing is overwritten", type=str)
    save_interval: int | None = flag("--save-interval", None, "iterations between checkpoints (>= 1; and one at the "
                                     "end)", type=int, check=AT_LEAST_1)
    load: str | None = flag("--load", None, "directory to resume from (its latest checkpoint; none there: start "
                            "from scratch)", type=str)
    async_save: bool = flag("--async-save", False, "write checkpoints in the background", action="store_true")
    finetune: bool = flag("--finetune", False, "load weights only; start at iteration 0", action="store_true")
    no_load_optim: bool = flag("--no-load-optim", False, "do not load optimizer state", action="store_true")
    no_load_rng: bool = flag("--no-load-rng", False, "do not load RNG states", action="store_true")
    # Megatron-LM's checkpoint machinery, acting on megalite's saves and loads (docs/megatron.md)
    save_retain_interval: int | None = flag(
        "--save-retain-interval", None, "(>= 1) after each save, delete the earlier checkpoints under --save whose "
        "iteration is not a multiple of this; the latest is always kept (Megatron-LM's)", type=int, check=AT_LEAST_1)
    ckpt_fully_parallel_save: bool = flag(
        "--no-ckpt-fully-parallel-save", True, "a tensor every data-parallel rank holds whole is written by the "
        "first replica instead of spread over the replicas by size (Megatron-LM's fully parallel save, on by "
        "default); the distributed optimizer's slices are written by their owners either way",
        action="store_false")
    ckpt_fully_parallel_save_deprecated: bool = flag(
        "--ckpt-fully-parallel-save", False, "deprecated: fully parallel save is the default (Megatron-LM's)",
        action="store_true")
    ckpt_fully_parallel_load: bool = flag(
        "--ckpt-fully-parallel-load", False, "each data-parallel replica reads its share of the checkpoint and the "
        "others get it over the group (Megatron-LM's flag; megalite's loads always work this way)",
        action="store_true")
    dist_ckpt_strictness: str = flag(
        "--dist-ckpt-strictness", "assume_ok_unexpected", "a load's answer to parameters of this model the checkpoint "
        "lacks (Megatron-LM's \"unexpected\" keys) and tensors it holds that this model lacks: assume_ok_unexpected "
        "(the default) and raise_unexpected refuse the first, raise_all both; log_unexpected keeps them as "
        "initialised with a notice, log_all also names the second; return_unexpected, return_all and ignore_all "
        "keep them as initialised silently (Megatron-LM's StrictHandling)",
        choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                 "return_unexpected", "return_all", "ignore_all"])
    dist_ckpt_optim_fully_reshardable: bool = flag(
        "--dist-ckpt-optim-fully-reshardable", False, "with --ckpt-format torch_dist: the optimizer state saved "
        "reshardable over TP, PP, EP and DP (Megatron-LM's; megalite writes it so always, and its own format too)",
        action="store_true")
    verify_integrity: bool = flag(
        "--verify-integrity", False, "hash every checkpoint file at save (a SHA-256 manifest beside them) and check "
        "the files against it when loading (Megatron-LM's; refused without --ckpt-format torch_dist, as there)",
        action="store_true")
    # sparse upcycling (checkpoint/upcycling/): a dense checkpoint under --load becomes this MoE run
    moe_use_upcycling: bool = flag(
        "--moe-use-upcycling", False, "load the dense checkpoint under --load into this MoE model (--num-experts): "
        "each expert a copy of its layer's dense MLP, the router as initialised, a fresh optimizer and schedule; "
        "save it to --save (which must hold no checkpoint) at iteration 1 and train on (as Megatron-LM)",
        action="store_true")
    moe_upcycling_granularity: int = flag(
        "--moe-upcycling-granularity", 1, "with --moe-use-upcycling: each dense MLP cut into this many slices of "
        "--moe-ffn-hidden-size = dense --ffn-hidden-size / g hidden units, expert e being slice e mod g "
        "(arXiv:2410.07524; 1: every expert the whole MLP)", type=int, check=AT_LEAST_1)
    # Megatron-LM's two answers to a learning-rate schedule that differs from the checkpoint's
    # (arguments/schedule_args.py); with neither, the resume is refused naming the differences
    override_opt_param_scheduler: bool = flag(
        "--override-opt_param-scheduler", False, "on resume, run the command line's learning-rate schedule (--lr, "
        "--min-lr, warmup, decay length and style, WSD, --decoupled-lr, --weight-decay) where it differs from the "
        "checkpoint's, from the checkpoint's step on", action="store_true")
    use_checkpoint_opt_param_scheduler: bool = flag(
        "--use-checkpoint-opt_param-scheduler", False, "on resume, continue the checkpoint's learning-rate schedule, "
        "whatever the command line's schedule flags say (--train-iters still says when to stop)", action="store_true")
    # Megatron-LM's load_args_from_checkpoint, applied first by validation (arguments/checkpoint_args.py)
    use_checkpoint_args: bool = flag(
        "--use-checkpoint-args", False, "take the model's architecture and tokenizer from the latest checkpoint "
        "under --load (needs --load): --num-layers, --hidden-size, --ffn-hidden-size, --seq-length, "
        "--num-attention-heads, --kv-channels, --max-position-embeddings where the command line does not give them "
        "(they may be left off); the other architecture flags, the dropouts and the tokenizer always (the "
        "checkpoint wins). The parallel layout stays the command line's: megalite's checkpoints load on any. No "
        "checkpoint there yet: the command line's flags, with a notice (as Megatron-LM)", action="store_true")
    use_tokenizer_model_from_checkpoint_args: bool = flag(
        "--no-use-tokenizer-model-from-checkpoint-args", True, "with --use-checkpoint-args: keep the command "
        "line's --tokenizer-model and --tokenizer-type (the checkpoint's type only where none is given), e.g. "
        "when the checkpoint's tokenizer path is not on this machine", action="store_false")


@dataclass
class TrackingConfig:
    """experiment tracking"""
    wandb_project: str | None = flag("--wandb-project", None, "log to this Weights & Biases project (needs wandb; "
                                     "WANDB_MODE=offline works)", type=str)
    wandb_exp_name: str | None = flag("--wandb-exp-name", None, "W&B run name (default: W&B's own)", type=str)
    wandb_save_dir: str | None = flag("--wandb-save-dir", None, "local directory for W&B run files (default: "
                                      "--save/wandb, else ./wandb)", type=str)
    wandb_entity: str | None = flag("--wandb-entity", None, "W&B team or user (default: your default entity)",
                                    type=str)
    tensorboard_dir: str | None = flag("--tensorboard-dir", None, "write TensorBoard event files here (needs "
                                       "tensorboard)", type=str)
    save: str | None = derived(None, copy_of="checkpoint.save")  # W&B files default to --save/wandb


__all__ = ["TrainingConfig", "CheckpointConfig", "TrackingConfig"]
