"""Typed configurations of the subsystems, one small dataclass each (as megatron/core's
OptimizerConfig and DistributedDataParallelConfig). Field names are the flags' names, so a
setting can be followed from `--flag-name` to `config.flag_name` in the module that uses it.

The argparse Namespace stops at the entry point: `arguments.build_run_config` fills these from
the validated flags (`from_args`); everything past it takes the config it needs. The model's
own config is `model.GPTConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .distributed.strategy import NAMES as SHARDING_STRATEGIES


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    rank_order: str = "tp-cp-dp-pp"
    distributed_backend: str = "gloo"
    distributed_timeout_minutes: float = 10.0


@dataclass
class DDPConfig:
    """The data-parallel side: what is sharded over DP (Megatron-LM's
    --data-parallel-sharding-strategy: no_shard; optim = ZeRO-1 = --use-distributed-optimizer;
    optim_grads = ZeRO-2; optim_grads_params = ZeRO-3), bucketed reductions and gathers."""
    data_parallel_sharding_strategy: str = "no_shard"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int = 40_000_000
    # --grad-reduce-in-bf16: the gradient buffer (accumulation and DP reduction) in bf16, not fp32
    grad_reduce_in_bf16: bool = False
    # Measured alternatives (benchmarks/RESULTS_zero.md), not flags: the defaults won.
    # ZeRO-2/3 with several micro-batches: reduce-scatter every micro-batch's gradients (True),
    # or accumulate the step's gradients in a full-size fp32 buffer and reduce once (False).
    reduce_grads_every_microbatch: bool = True
    # ZeRO-3: free gathered parameters after each use (False), or keep them gathered from their
    # first use in a step until the last micro-batch's backward (True).
    keep_params_gathered_in_step: bool = False

    def __post_init__(self):
        if self.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy must be one of {SHARDING_STRATEGIES}, "
                             f"got {self.data_parallel_sharding_strategy!r}")

    @property
    def use_distributed_optimizer(self) -> bool:
        """Optimizer state sharded over DP (every strategy but no_shard)."""
        return self.data_parallel_sharding_strategy != "no_shard"


@dataclass
class OptimizerConfig:
    """The update, its learning-rate schedule and loss scaling."""
    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    fused_optimizer: bool = True
    # ZeRO-Offload (Ren et al. 2021): this fraction of the rank's fp32 masters and Adam moments
    # lives in host memory and is stepped there
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    # schedule, counted in samples (validate_args converts the *_iters flags at the global batch);
    # lr_decay_samples None: a config built by hand, counted in iterations
    lr_decay_style: str = "linear"
    lr_decay_iters: int = 1
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    lr_decay_samples: int | None = None
    lr_warmup_samples: float = 0
    lr_wsd_decay_samples: int | None = None
    global_batch_size: int = 1  # converts the iteration count of schedules saved before samples
    # --decoupled-lr / --decoupled-min-lr: peak and minimum of the embedding and output layer
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # loss scaling: --loss-scale (constant) or --fp16 (dynamic)
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    inject_overflow_at_iteration: int | None = None


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: list[str] | None = None
    split: str = "969, 30, 1"
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    seq_length: int = 1024
    seed: int = 1234
    micro_batch_size: int = 1
    num_workers: int = 0
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    create_attention_mask_in_dataloader: bool = True
    mmap_bin_files: bool = True
    # the tokenizer
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: list[str] | None = None


@dataclass
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    async_save: bool = False
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False


@dataclass
class TrackingConfig:
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None
    tensorboard_dir: str | None = None
    save: str | None = None  # W&B files default to --save/wandb, as in Megatron-LM


@dataclass
class TrainingConfig:
    """The loop: how long, how often to log, evaluate and stop."""
    train_iters: int = 1  # with --train-samples: the whole global batches that fit in them
    train_samples: int | None = None
    global_batch_size: int = 1  # the final one when the batch ramps up
    micro_batch_size: int = 1
    num_microbatches: int = 1  # at global_batch_size (evaluation uses it)
    rampup_batch_size: list[int] | None = None
    step_batch_size_schedule: str | None = None
    seq_length: int = 1024
    calculate_per_token_loss: bool = False
    deterministic_mode: bool = False
    empty_unused_memory_level: int = 0
    seed: int = 1234
    compile: bool = False  # torch.compile of the transformer layers
    log_interval: int = 100
    log_jsonl: str | None = None
    log_throughput: bool = False
    log_params_norm: bool = False
    log_memory_to_tensorboard: bool = False
    peak_tflops: float | None = None
    # --profile: torch.profiler over iterations (profile_step_start, profile_step_end] on profile_ranks
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    profile_dir: str | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_signal_handler: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    # operations (the flags' last group)
    check_for_nan_in_loss_and_grad: bool = True
    log_straggler: bool = False
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True


@dataclass
class RunConfig:
    """Everything one run is configured with. `flags` keeps the validated flags as plain data
    (JSON-safe) for checkpoint metadata and experiment trackers: a record, not an input."""
    model: object  # model.GPTConfig
    parallel: ParallelConfig
    ddp: DDPConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig
    training: TrainingConfig
    flags: dict = field(default_factory=dict)
    notices: list = field(default_factory=list)  # start-up notes from validation, printed once


def from_args(cls, args, **overrides):
    """An instance of dataclass `cls` whose fields take the same-named attributes of `args`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
