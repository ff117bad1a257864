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
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order TP-PP-DP instead of Megatron's default TP-DP-PP")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, gloo without")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000, help="elements per gradient all-reduce bucket")

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

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-jsonl", help="append one JSON object per logged iteration / evaluation here")
    g.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: known GPUs only)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation (0: none)")
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
    if pp != 1:
        _fail("--pipeline-model-parallel-size > 1 is not supported yet")
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

    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA; use gloo on CPU")
    args.params_dtype = _str2dtype(args)
    return args
