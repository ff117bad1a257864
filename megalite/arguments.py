"""Command-line flags, by Megatron-LM's names, and their validation.

`validate_args` runs before torch.distributed is initialised, so a layout that cannot work
stops every rank with the same message naming the flags, instead of hanging in a collective.
"""
from __future__ import annotations

import argparse
import os

import torch

from .parallel_state import RankGrid


class ArgumentError(ValueError):
    """A flag, or a combination of flags, that cannot run."""


def _str2dtype(args) -> torch.dtype:
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.bfloat16 if args.bf16 else torch.float32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT model with tensor, pipeline and data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="number of transformer layers")
    g.add_argument("--hidden-size", type=int, help="transformer hidden size h")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP hidden size (default 4h)")
    g.add_argument("--num-attention-heads", type=int, help="number of attention heads a")
    g.add_argument("--kv-channels", type=int, help="per-head size (default h / a)")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention")
    g.add_argument("--num-query-groups", type=int, help="key/value groups with --group-query-attention")
    g.add_argument("--seq-length", type=int, help="sequence length s")
    g.add_argument("--max-position-embeddings", type=int, help="size of the position table (default s)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of head channels rotated by RoPE")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of reusing the word embedding")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--use-flash-attn", action="store_true", help="flash-attn kernels (needs the flash-attn package and CUDA)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk: v = layers / (PP x this) chunks per rank (interleaved 1F1B)")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order TP-PP-DP instead of Megatron's default TP-DP-PP")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, gloo without")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000, help="elements per gradient all-reduce bucket")

    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="activation recompute: 'full' recomputes whole transformer layers (with "
                        "--recompute-method and --recompute-num-layers), 'selective' only core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with full recompute: 'uniform' keeps the input of every chunk of --recompute-num-layers "
                        "layers and recomputes the chunk; 'block' recomputes the first --recompute-num-layers "
                        "layers of each pipeline stage (model chunk) and keeps the rest")
    g.add_argument("--recompute-num-layers", type=int,
                   help="layers per recomputed chunk (uniform) or recomputed layers per stage (block)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations outside the tensor-parallel regions along the sequence "
                        "(needs --tensor-model-parallel-size > 1)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch per DP rank")
    g.add_argument("--global-batch-size", type=int, help="samples per iteration (default micro x DP)")
    g.add_argument("--train-iters", type=int, help="iterations to train")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 grads and master weights")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of --lr-decay-iters")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup")
    g.add_argument("--lr-wsd-decay-iters", type=int, help="WSD: length of the final decay phase")
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=["linear", "cosine", "exponential", "minus_sqrt"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = p.add_argument_group("mixed precision and distributed optimizer")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations, fp32 grads and master weights, loss scaling")
    g.add_argument("--loss-scale", type=float,
                   help="static loss scale (a power of 2 is exact); default with --fp16: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="--fp16: first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="--fp16: the dynamic scale never goes below this")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="--fp16: double the dynamic scale after this many steps without overflow")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflows tolerated before the dynamic scale is halved")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard fp32 master weights and optimizer state over data-parallel ranks "
                        "(= --data-parallel-sharding-strategy optim)")
    g.add_argument("--data-parallel-sharding-strategy", choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="what is sharded over data-parallel ranks: nothing; the optimizer state (ZeRO-1); "
                        "and the gradients (ZeRO-2); and the parameters, gathered per layer for forward and "
                        "backward (ZeRO-3). Default: optim with --use-distributed-optimizer, else no_shard")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep fp32 master weights and optimizer state (a fraction of them: "
                        "--optimizer-offload-fraction) in host memory and step them on the CPU; needs a sharded "
                        "strategy")
    g.add_argument("--optimizer-offload-fraction", type=float, default=argparse.SUPPRESS,
                   help="with --optimizer-cpu-offload: fraction of each rank's optimizer state offloaded, in (0, 1] "
                        "(default 1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket's DP gradient reduction during backward, as soon as it is complete")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with a sharded strategy: all-gather each bucket's parameters during the next forward, "
                        "just before they are used (ZeRO-3: prefetch the next layer's gather)")
    g.add_argument("--no-fused-optimizer", dest="fused_optimizer", action="store_false",
                   help="use the unfused torch.optim update instead of torch's fused AdamW / SGD, which is the "
                        "default where the device has it")
    g.add_argument("--inject-overflow-at-iteration", type=int, metavar="N",
                   help="testing only: put an inf into one rank's gradients at iteration N, as an fp16 overflow")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="random tokens (seeded); needs --vocab-size")
    g.add_argument("--vocab-size", type=int, help="vocabulary size for --mock-data / NullTokenizer")
    g.add_argument("--data-path", nargs="*", help="dataset prefix(es), or weight prefix pairs to blend")
    g.add_argument("--split", default="969, 30, 1", help="train, valid, test proportions of --data-path")
    g.add_argument("--train-data-path", nargs="*", help="dataset prefix(es) used whole for training")
    g.add_argument("--valid-data-path", nargs="*", help="dataset prefix(es) used whole for validation")
    g.add_argument("--test-data-path", nargs="*", help="dataset prefix(es) used whole for testing")
    g.add_argument("--data-cache-path", help="where index caches go (default: beside the data)")
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer",
                                                "NullTokenizer"])
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file, or a Hugging Face tokenizer directory")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each end-of-document")
    g.add_argument("--reset-attention-mask", action="store_true", help="no attention across documents")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints (and one at the end)")
    g.add_argument("--load", help="directory to resume from (its latest checkpoint)")
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM, save and exit cleanly")
    g.add_argument("--exit-interval", type=int, help="exit (after saving) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, help="exit (after saving) after this many minutes")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-jsonl", help="append one JSON object per logged iteration / evaluation here")
    g.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: known GPUs only)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation (0: none)")
    g.add_argument("--wandb-project", help="log to this Weights & Biases project (needs wandb; WANDB_MODE=offline works)")
    g.add_argument("--wandb-exp-name", help="W&B run name (default: W&B's own)")
    g.add_argument("--wandb-save-dir", help="local directory for W&B run files (default: --save/wandb, else ./wandb)")
    g.add_argument("--wandb-entity", help="W&B team or user (default: your default entity)")
    g.add_argument("--tensorboard-dir", help="write TensorBoard event files here (needs tensorboard)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _fail(msg: str):
    raise ArgumentError(msg)


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check and complete `args` for `world_size` ranks. Pure: no collective, no file I/O."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "lr"):
        if getattr(args, flag) is None:
            _fail(f"--{flag.replace('_', '-')} is required")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        grid = RankGrid(world_size, tp, pp, "tp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-dp-pp")
    except ValueError as e:
        _fail(str(e))
    args.data_parallel_size = dp = grid.dp
    args.rank_order = grid.order

    # batch
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        _fail(f"--global-batch-size ({args.global_batch_size}) is not divisible by --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({dp} = world {world_size} / (TP {tp} x PP {pp}))")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    # pipeline stages and virtual chunks
    if args.num_layers % pp:
        _fail(f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    args.virtual_pipeline_model_parallel_size = 1
    k = args.num_layers_per_virtual_pipeline_stage
    if k is not None:
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        if (args.num_layers // pp) % k:
            _fail(f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) = "
                  f"{args.num_layers // pp} layers per stage is not divisible by "
                  f"--num-layers-per-virtual-pipeline-stage ({k})")
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * k)
        if args.virtual_pipeline_model_parallel_size > 1 and args.num_microbatches % pp:
            _fail(f"the interleaved schedule needs the number of micro-batches (--global-batch-size / "
                  f"(--micro-batch-size x DP) = {args.num_microbatches}) to be a multiple of "
                  f"--pipeline-model-parallel-size ({pp})")

    # model shape
    heads = args.num_attention_heads
    if args.num_query_groups is not None and not args.group_query_attention:
        _fail("--num-query-groups needs --group-query-attention")
    if not args.group_query_attention:
        args.num_query_groups = heads
    elif args.num_query_groups is None:
        _fail("--group-query-attention needs --num-query-groups")
    if heads % args.num_query_groups:
        _fail(f"--num-attention-heads ({heads}) is not divisible by --num-query-groups ({args.num_query_groups})")
    if heads % tp:
        _fail(f"--num-attention-heads ({heads}) is not divisible by --tensor-model-parallel-size ({tp})")
    if args.num_query_groups % tp:
        _fail(f"--num-query-groups ({args.num_query_groups}) is not divisible by --tensor-model-parallel-size ({tp})")
    if args.kv_channels is None:
        if args.hidden_size % heads:
            _fail(f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads ({heads}); "
                  f"set --kv-channels")
        args.kv_channels = args.hidden_size // heads
    if args.ffn_hidden_size is None:
        # SwiGLU keeps the MLP's parameter count near 8h² with ffn = 8h/3 (Megatron does the same)
        args.ffn_hidden_size = int(8 * args.hidden_size / 3) if args.swiglu else 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by --tensor-model-parallel-size ({tp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({args.max_position_embeddings})")
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            _fail(f"--{flag.replace('_', '-')} must be in [0, 1)")
    if args.use_flash_attn:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            _fail("--use-flash-attn needs the flash-attn package (pip install flash-attn); it is not installed")
        if not torch.cuda.is_available() or not args.bf16:
            _fail("--use-flash-attn needs CUDA and --bf16")
    if args.reset_attention_mask and args.use_flash_attn:
        _fail("--reset-attention-mask needs an explicit mask, which --use-flash-attn does not take")

    # activation memory: recompute and sequence parallelism (Megatron-LM's rules)
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            _fail("--recompute-activations (selective recompute) conflicts with --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        per_chunk = args.num_layers // (pp * args.virtual_pipeline_model_parallel_size)
        if args.recompute_method is None:
            _fail("--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None or not 1 <= args.recompute_num_layers <= per_chunk:
            _fail(f"--recompute-granularity full needs --recompute-num-layers between 1 and the layers per "
                  f"pipeline stage (model chunk), {per_chunk}; got {args.recompute_num_layers}")
    elif args.recompute_granularity == "selective":
        if args.recompute_method is not None or args.recompute_num_layers is not None:
            _fail("--recompute-method / --recompute-num-layers apply to --recompute-granularity full only, "
                  "not selective")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        _fail("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if args.sequence_parallel:
        if tp < 2:
            _fail("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if args.seq_length % tp:
            _fail(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                  f"--tensor-model-parallel-size ({tp})")

    # data
    paths = [args.data_path, args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.mock_data:
        if any(paths):
            _fail("--mock-data cannot be combined with --data-path / --*-data-path")
        if args.vocab_size is None:
            _fail("--mock-data needs --vocab-size")
    else:
        if not any(paths):
            _fail("give --data-path (or --train-data-path ...) or --mock-data")
        if args.data_path and any(paths[1:]):
            _fail("use either --data-path with --split or --train/valid/test-data-path, not both")
        if args.tokenizer_type is None:
            _fail("--tokenizer-type is required with --data-path")

    # learning rate
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            _fail("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters > args.lr_decay_iters:
        _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) exceeds --lr-decay-iters ({args.lr_decay_iters})")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) exceeds --lr ({args.lr})")
    if args.log_interval < 1 or args.eval_interval < 1:
        _fail("--log-interval and --eval-interval must be >= 1")

    # mixed precision and distributed optimizer
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive")
    if args.loss_scale is not None:
        if not (args.fp16 or args.bf16):
            _fail("--loss-scale needs --fp16 or --bf16 (fp32 training does not scale the loss)")
        if args.loss_scale <= 0:
            _fail(f"--loss-scale must be > 0, got {args.loss_scale}")
    dynamic = {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2}
    for flag, default in dynamic.items():
        if getattr(args, flag) != default and (not args.fp16 or args.loss_scale is not None):
            _fail(f"--{flag.replace('_', '-')} sets dynamic loss scaling, which only --fp16 without --loss-scale uses")
    if args.fp16:
        if not 0 < args.min_loss_scale <= args.initial_loss_scale:
            _fail(f"need 0 < --min-loss-scale ({args.min_loss_scale}) <= --initial-loss-scale "
                  f"({args.initial_loss_scale})")
        if args.loss_scale_window < 1 or args.hysteresis < 1:
            _fail("--loss-scale-window and --hysteresis must be >= 1")
    if args.inject_overflow_at_iteration is not None and not (args.fp16 or args.loss_scale is not None):
        _fail("--inject-overflow-at-iteration needs loss scaling (--fp16, or --loss-scale)")
    strategy = args.data_parallel_sharding_strategy
    if strategy is None:
        strategy = "optim" if args.use_distributed_optimizer else "no_shard"
    elif strategy == "no_shard" and args.use_distributed_optimizer:
        _fail("--use-distributed-optimizer shards the optimizer state, which "
              "--data-parallel-sharding-strategy no_shard does not; drop one of them")
    args.data_parallel_sharding_strategy = strategy
    args.use_distributed_optimizer = strategy != "no_shard"
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer (or a --data-parallel-sharding-strategy "
              "other than no_shard)")
    fraction = getattr(args, "optimizer_offload_fraction", None)  # absent unless given
    if fraction is not None and not args.optimizer_cpu_offload:
        _fail("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    args.optimizer_offload_fraction = 1.0 if fraction is None else fraction
    if args.optimizer_cpu_offload:
        if not args.use_distributed_optimizer:
            _fail("--optimizer-cpu-offload offloads each rank's shard of the optimizer state: it needs "
                  "--use-distributed-optimizer or --data-parallel-sharding-strategy optim, optim_grads or "
                  "optim_grads_params")
        if not 0.0 < args.optimizer_offload_fraction <= 1.0:
            _fail(f"--optimizer-offload-fraction must be in (0, 1], got {args.optimizer_offload_fraction} "
                  "(to offload nothing, drop --optimizer-cpu-offload)")

    # experiment trackers (W&B, TensorBoard): optional packages, checked before any process starts
    from .tracking import missing_packages
    for msg in missing_packages(args):
        _fail(msg)
    for flag in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
        if getattr(args, flag) and not args.wandb_project:
            _fail(f"--{flag.replace('_', '-')} needs --wandb-project")

    # checkpointing
    if args.save_interval is not None and args.save_interval < 1:
        _fail("--save-interval must be >= 1")
    if args.save_interval and not args.save:
        _fail("--save-interval needs --save")
    if args.async_save and not args.save:
        _fail("--async-save needs --save")
    if (args.finetune or args.no_load_optim or args.no_load_rng) and not args.load:
        _fail("--finetune / --no-load-optim / --no-load-rng need --load")
    if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
        _fail(f"--save {args.save} exists and is not a directory")
    if args.load and os.path.exists(args.load) and not os.path.isdir(args.load):
        _fail(f"--load {args.load} is not a directory")

    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA; use gloo on CPU")
    args.params_dtype = _str2dtype(args)
    return args


def build_run_config(args: argparse.Namespace):
    """The validated flags as typed configs, one per subsystem: the Namespace stops here."""
    from .config import (CheckpointConfig, DataConfig, DDPConfig, OptimizerConfig, ParallelConfig, RunConfig,
                         TrackingConfig, TrainingConfig, from_args)
    from .model import GPTConfig
    from .tracking import json_safe
    model = from_args(GPTConfig, args, vocab_size=args.vocab_size or 0, padded_vocab_size=0,
                      add_bias_linear=not args.disable_bias_linear)  # vocabulary: filled from the tokenizer
    return RunConfig(model=model, parallel=from_args(ParallelConfig, args), ddp=from_args(DDPConfig, args),
                     optimizer=from_args(OptimizerConfig, args), data=from_args(DataConfig, args),
                     checkpoint=from_args(CheckpointConfig, args), tracking=from_args(TrackingConfig, args),
                     training=from_args(TrainingConfig, args), flags=json_safe(vars(args)))
