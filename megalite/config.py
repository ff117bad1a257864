"""Typed configurations of the subsystems, one small dataclass each (as megatron/core's
OptimizerConfig and DistributedDataParallelConfig). Field names are the flags' names, so a
setting can be followed from `--flag-name` to `config.flag_name` in the module that uses it.

The argparse Namespace stops at the entry point: `arguments.build_run_config` fills these from
the validated flags (`from_args`); everything past it takes the config it needs. The model's
own config is `model.GPTConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    rank_order: str = "tp-dp-pp"
    distributed_backend: str = "gloo"


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DDPConfig:
    """The data-parallel side: what is sharded over DP (Megatron-LM's
    --data-parallel-sharding-strategy: no_shard; optim = ZeRO-1 = --use-distributed-optimizer;
    optim_grads = ZeRO-2; optim_grads_params = ZeRO-3), bucketed reductions and gathers."""
    data_parallel_sharding_strategy: str = "no_shard"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int = 40_000_000
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
    # schedule, counted in iterations
    lr_decay_style: str = "linear"
    lr_decay_iters: int = 1
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
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
    # the tokenizer
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128


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
    train_iters: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    seed: int = 1234
    log_interval: int = 100
    log_jsonl: str | None = None
    peak_tflops: float | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_signal_handler: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None


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


def from_args(cls, args, **overrides):
    """An instance of dataclass `cls` whose fields take the same-named attributes of `args`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
