"""Command-line flags, by Megatron-LM's names, and their validation.

`validate_args` runs before torch.distributed is initialised, so a layout that cannot work
stops every rank with the same message naming the flags, instead of hanging in a collective.
It checks every flag, in three passes:

1. each flag's own range (`_RANGES`): sizes and counts >= 1, learning rates > 0, probabilities
   in [0, 1), ...; the message names the flag, the allowed values and the value given;
2. combinations: the rank grid, batch and pipeline divisibility, model shape, recompute, data
   source, learning-rate schedule, mixed precision, checkpointing, and flags that would have no
   effect (with --mock-data, or without the flag they modify);
3. files (`check_paths`, skipped by tools/plan.py, which plans for another machine): datasets,
   tokenizer files, the checkpoint to load, and outputs that must not overwrite anything.

This module imports torch only at the very end of a successful validation, so a bad flag is
refused in a fraction of a second.
"""
from __future__ import annotations

import argparse
import math
import os

from .data.data_paths import parse_and_normalize_split, parse_blend
from .data.reader import open_dataset
from .data.tokenizers import (TOKENIZER_FILE_FLAGS, TOKENIZER_TYPES, TOKENIZER_TYPES_HELP, add_tiktoken_args,
                              check_tokenizer_args)
from .errors import ArgumentParser, InputError, UserError

DEFAULT_SPLIT = "969, 30, 1"


class ArgumentError(InputError):
    """A flag, or a combination of flags, that cannot run."""


def _str2dtype(args):
    import torch
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.bfloat16 if args.bf16 else torch.float32


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_FP8_HELP = ("refused: FP8 training needs Hopper-class (or newer) GPUs and NVIDIA Transformer Engine, which megalite "
             "does not use")
# Megatron-LM flags (used by its GPT functional tests) that megalite does not implement: parsed, so that the
# answer is one line saying why instead of argparse's "unrecognized arguments", and refused in validate_args.
REFUSED_FLAGS = {
    "--log-num-zeros-in-grad": ({"action": "store_true"}, "refused: megalite does not count zero gradients"),
    "--log-timers-to-tensorboard": ({"action": "store_true"},
                                    "refused: megalite keeps no per-phase timers; the iteration time is logged "
                                    "(train/elapsed_ms)"),
    "--attention-softmax-in-fp32": ({"action": "store_true"},
                                    "refused: not a switch in megalite (--attention-backend local and SDPA's fused "
                                    "kernels compute the softmax in fp32; SDPA's math path keeps PyTorch's choice)"),
    "--apply-query-key-layer-scaling": ({"action": "store_true"},
                                        "refused: not implemented (an fp16 overflow guard that scales Q·K^T by "
                                        "1/layer and back)"),
    "--squared-relu": ({"action": "store_true"}, "refused: megalite's MLP is GeLU or SwiGLU"),
    "--save-retain-interval": ({"type": int}, "refused: megalite keeps every checkpoint it saves"),
    "--dist-ckpt-strictness": ({}, "refused: an option of Megatron-LM's torch_dist checkpoints, which megalite "
                                   "does not write"),
    "--dist-ckpt-optim-fully-reshardable": ({"action": "store_true"},
                                            "refused: an option of torch_dist checkpoints; megalite's are always "
                                            "reshardable over TP, PP and DP, optimizer state included"),
    "--use-persistent-ckpt-worker": ({"action": "store_true"},
                                     "refused: megalite's --async-save writes from a thread, not a worker process"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ("not set" says nothing)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT model with tensor, pipeline and data parallelism. "
        "Flags keep Megatron-LM's names; bad input is refused with one 'error:' line naming the flag.",
        formatter_class=_HelpFormatter, allow_abbrev=False)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="number of transformer layers (>= 1; required)")
    g.add_argument("--hidden-size", type=int, help="transformer hidden size h (>= 1; required)")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP hidden size (>= 1; default 4h, 8h/3 with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, help="number of attention heads a (>= 1; required)")
    g.add_argument("--kv-channels", type=int, help="per-head size (>= 1; default h / a)")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention")
    g.add_argument("--num-query-groups", type=int,
                   help="key/value groups with --group-query-attention (>= 1, divides --num-attention-heads)")
    g.add_argument("--seq-length", type=int, help="sequence length s (>= 1; required)")
    g.add_argument("--max-position-embeddings", type=int,
                   help="size of the learned position table (>= --seq-length; default s)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base (> 0)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of head channels rotated by RoPE, in (0, 1]")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of the norms (> 0)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of reusing the word embedding")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout probability, in [0, 1)")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout probability, in [0, 1)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight init (> 0)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP (>= 1)")
    g.add_argument("--use-flash-attn", action="store_true", help="flash-attn kernels (needs the flash-attn package and CUDA)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention: auto (torch SDPA picks its kernel; flash-attn with --use-flash-attn), "
                        "flash (SDPA's FlashAttention kernel, or the flash-attn package with --use-flash-attn), "
                        "fused (SDPA's cuDNN / memory-efficient kernels; CUDA only), unfused (SDPA's math "
                        "path), local (megalite's explicit softmax(QK^T/sqrt(d))V); a backend the device "
                        "cannot run is refused at start-up")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights (Megatron-LM's LayerNorm1P, LayerNorm and RMSNorm): the "
                        "weight is stored as w - 1 (initialised to 0) and applied as 1 + w; checkpoints record it")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the fused vocabulary-parallel cross entropy (one all-reduce of [target logit, sum of "
                        "exp] instead of two; the same loss)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted for Megatron-LM scripts, changes nothing: megalite has one model "
                        "implementation, laid out and named as Megatron Core's GPTModel")
    g.add_argument("--openai-gelu", action="store_true", help="GPT-2's tanh-approximated GeLU (transformers' gelu_new)")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1 RoPE scaling of the rotary frequencies")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="--use-rope-scaling: context stretch factor")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0, help="--use-rope-scaling: low_freq_factor")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="--use-rope-scaling: high_freq_factor")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="--use-rope-scaling: the context length the model was pretrained at")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float,
                   help="RoPE position interpolation: positions are divided by this")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP (>= 1)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP (>= 1)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk (>= 1): v = layers / (PP x this) chunks per rank (interleaved 1F1B)")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order TP-CP-PP-DP instead of Megatron's default TP-CP-DP-PP")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, gloo without")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000,
                   help="elements per gradient all-reduce bucket (>= 1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP (>= 1): each sequence split over this many ranks (2·CP chunks, rank r keeps chunks "
                        "r and 2·CP-1-r); keys/values all-gathered for exact attention; gradients reduced and "
                        "ZeRO-1 sharded over DP x CP. --seq-length must divide by 2·CP (2·CP·TP with "
                        "--sequence-parallel)"),

    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="activation recompute: 'full' recomputes whole transformer layers (with "
                        "--recompute-method and --recompute-num-layers), 'selective' only core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with full recompute: 'uniform' keeps the input of every chunk of --recompute-num-layers "
                        "layers and recomputes the chunk; 'block' recomputes the first --recompute-num-layers "
                        "layers of each pipeline stage (model chunk) and keeps the rest")
    g.add_argument("--recompute-num-layers", type=int,
                   help="layers per recomputed chunk (uniform) or recomputed layers per stage (block); "
                        "from 1 to the layers per stage")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations outside the tensor-parallel regions along the sequence "
                        "(needs --tensor-model-parallel-size > 1)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch per DP rank (>= 1; required)")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per iteration (>= 1, a multiple of micro x DP; default micro x DP); with "
                        "--rampup-batch-size the batch it ramps up to")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="ramp the global batch from START by INCREMENT up to --global-batch-size, evenly over "
                        "the first SAMPLES samples (Megatron-LM's syntax; needs --train-samples, as there)")
    g.add_argument("--step-batch-size-schedule", metavar="'TOKENS:BATCH ...'",
                   help="global batch by tokens consumed, e.g. '0:768 250B:1536' (K/M/B/T suffixes; thresholds "
                        "// --seq-length give samples; the first is 0); the last batch is the global batch, so "
                        "--global-batch-size is refused beside it; needs --train-samples")
    g.add_argument("--train-iters", type=int, help="iterations to train (>= 1); this or --train-samples is required")
    g.add_argument("--train-samples", type=int,
                   help="samples to train (>= 1): as many whole global batches as fit (the schedule, the "
                        "batch ramp-up and --lr-*-samples then count samples)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the gradient of the loss summed over the global batch's tokens / their number "
                        "(Megatron-LM's per-token loss); default: each micro-batch's token mean, averaged over "
                        "micro-batches and DP ranks (Megatron-LM's default); the same unless tokens are masked")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch.use_deterministic_algorithms(True); refuses flash-attn and the fused cross "
                        "entropy, and with NCCL needs CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO set (Megatron-LM's rules)")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="torch.cuda.empty_cache() where Megatron-LM calls it: 1 after each forward-backward "
                        "(training and evaluation), 2 also after the optimizer step; a no-op on CPU")
    g.add_argument("--seed", type=int, default=1234, help="random seed, in [0, 2^31)")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 grads and master weights")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (Inductor); compiled during the first iteration")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, help="peak learning rate (> 0; required)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay (>= 0, <= --lr)")
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, help="iterations of warmup + decay (>= 1; default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int,
                   help="with --train-samples: samples of warmup + decay (>= 1; default --train-samples)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="warmup iterations (>= 0; 0: no warmup)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples: warmup samples (>= 0; 0: no warmup)")
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="warmup as a fraction of --lr-decay-iters / --lr-decay-samples, in [0, 1]")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup (>= 0)")
    g.add_argument("--lr-wsd-decay-iters", type=int,
                   help="WSD: length of the final decay phase (>= 1, <= --lr-decay-iters)")
    g.add_argument("--lr-wsd-decay-samples", type=int,
                   help="WSD with --train-samples: samples of the final decay phase (>= 1, <= --lr-decay-samples)")
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=["linear", "cosine", "exponential", "minus_sqrt"],
                   help="WSD: shape of the final decay")
    g.add_argument("--decoupled-lr", type=float,
                   help="peak learning rate of the word embedding and output layer (> 0); they follow the "
                        "schedule of --lr with this peak")
    g.add_argument("--decoupled-min-lr", type=float,
                   help="with --decoupled-lr: their minimum learning rate (>= 0; default --min-lr)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay (>= 0)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (>= 0; 0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="in [0, 1)")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="in [0, 1)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="> 0")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="in [0, 1)")

    g = p.add_argument_group("mixed precision and distributed optimizer")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations, fp32 grads and master weights, loss scaling")
    g.add_argument("--loss-scale", type=float,
                   help="static loss scale (> 0; a power of 2 is exact); default with --fp16: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="--fp16: first dynamic loss scale (> 0)")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="--fp16: the dynamic scale never goes below this (> 0, <= --initial-loss-scale)")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="--fp16: double the dynamic scale after this many steps without overflow (>= 1)")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflows tolerated before the dynamic scale is halved (>= 1)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard fp32 master weights and optimizer state over data-parallel ranks "
                        "(= --data-parallel-sharding-strategy optim)")
    g.add_argument("--data-parallel-sharding-strategy",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
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
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and data-parallel-reduce gradients in bf16 instead of fp32 "
                        "(half the gradient memory and traffic; the fp32 master weights stay)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], help=_FP8_HELP)
    g.add_argument("--fp8-amax-history-len", type=int, help=_FP8_HELP)
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], help=_FP8_HELP)
    g.add_argument("--fp8-param-gather", action="store_true", help=_FP8_HELP)
    g.add_argument("--no-fused-optimizer", dest="fused_optimizer", action="store_false",
                   help="use the unfused torch.optim update instead of torch's fused AdamW / SGD, which is the "
                        "default where the device has it")
    g.add_argument("--inject-overflow-at-iteration", type=int, metavar="N",
                   help="testing only: put an inf into one rank's gradients at iteration N (>= 1), as an fp16 overflow")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="uniform random tokens (seeded) instead of a dataset; the vocabulary comes from --vocab-size "
                        "or --tokenizer-type. Refuses the flags that act on documents or dataset files "
                        "(--split, --data-cache-path, --eod-mask-loss, --reset-position-ids, --reset-attention-mask)")
    g.add_argument("--vocab-size", type=int,
                   help="(>= 1) the model's vocabulary for --mock-data without a tokenizer; the tokenizer's argument "
                        "for NullTokenizer (ids 0..N-1 plus an end-of-document id N: the model gets N+1, as in "
                        "Megatron-LM); with another tokenizer, optional, at least the tokenizer's vocabulary")
    g.add_argument("--data-path", nargs="*", help="dataset prefix(es), or weight prefix pairs to blend")
    g.add_argument("--split", default=DEFAULT_SPLIT,
                   help="train, valid, test proportions of --data-path (non-negative numbers, not all 0)")
    g.add_argument("--train-data-path", nargs="*", help="dataset prefix(es) used whole for training")
    g.add_argument("--valid-data-path", nargs="*", help="dataset prefix(es) used whole for validation")
    g.add_argument("--test-data-path", nargs="*", help="dataset prefix(es) used whole for testing")
    g.add_argument("--data-cache-path", help="directory for index caches (default: cache/ beside the data)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help=TOKENIZER_TYPES_HELP)
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model",
                   help="SentencePieceTokenizer / GPTSentencePieceTokenizer: the .model file; "
                        "HuggingFaceTokenizer: a local tokenizer directory")
    add_tiktoken_args(g)
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each end-of-document")
    g.add_argument("--reset-attention-mask", action="store_true", help="no attention across documents")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes (>= 0; 0: none)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false",
                   help="the data loader builds no attention mask (causal attention needs none); refused with "
                        "--reset-attention-mask, whose document mask the loader builds. Without it megalite "
                        "builds a mask only for --reset-attention-mask: a plain causal mask would equal is_causal")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read each sample from the .bin files with a positioned read instead of memory-mapping "
                        "them (as Megatron-LM; for file systems where mmap is slow)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory to save checkpoints to; one that already holds checkpoints must also "
                                  "be --load (resume), so that nothing is overwritten")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints (>= 1; and one at the end)")
    g.add_argument("--load", help="directory to resume from (its latest checkpoint; none there: start from scratch)")
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM, save and exit cleanly")
    g.add_argument("--exit-interval", type=int,
                   help="exit (after saving) when the iteration is a multiple of this (>= 1)")
    g.add_argument("--exit-duration-in-mins", type=float, help="exit (after saving) after this many minutes (> 0)")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                   help="refused: megalite reads and writes one format of its own (per-rank shards, "
                        "layout-independent; see README), none of Megatron-LM's; drop the flag")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines (>= 1)")
    g.add_argument("--log-jsonl", help="append one JSON object per logged iteration / evaluation to this file")
    g.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (> 0; default: known GPUs only)")
    g.add_argument("--log-throughput", action="store_true",
                   help="add TFLOP/s per device (and MFU where the peak is known) to the console line "
                        "(the JSONL record always has them)")
    g.add_argument("--log-params-norm", action="store_true",
                   help="add the global norm of the parameters to each log line (an extra all-reduce)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="add memory (CUDA allocated / peak / reserved bytes; max RSS on CPU) to each logged "
                        "record, and so to TensorBoard / W&B")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="accepted for Megatron-LM scripts: megalite always logs the validation perplexity")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler trace (CPU and CUDA activity, shapes) of the iterations after "
                        "--profile-step-start up to --profile-step-end, one file per profiled rank, written to "
                        "--tensorboard-dir (TensorBoard's profiler plugin reads it; as Megatron-LM's "
                        "--use-pytorch-profiler), else ./profile")
    g.add_argument("--profile-step-start", type=int,
                   help="with --profile: iterations completed when the trace starts (>= 0; default 10)")
    g.add_argument("--profile-step-end", type=int,
                   help="with --profile: iterations completed when it stops (> start; default 12)")
    g.add_argument("--profile-ranks", type=int, nargs="+",
                   help="with --profile: global ranks to trace (default: 0, as Megatron-LM)")
    g.add_argument("--eval-interval", type=int, default=1000, help="iterations between evaluations (>= 1)")
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation (>= 0; 0: none)")
    g.add_argument("--wandb-project", help="log to this Weights & Biases project (needs wandb; WANDB_MODE=offline works)")
    g.add_argument("--wandb-exp-name", help="W&B run name (default: W&B's own)")
    g.add_argument("--wandb-save-dir", help="local directory for W&B run files (default: --save/wandb, else ./wandb)")
    g.add_argument("--wandb-entity", help="W&B team or user (default: your default entity)")
    g.add_argument("--tensorboard-dir", help="write TensorBoard event files here (needs tensorboard)")

    g = p.add_argument_group("operations: timeouts, NaN checks, stragglers, garbage collection")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of every collective and of start-up (fractions allowed, e.g. 0.5); when it fires, "
                        "every rank still running dumps its Python stacks and the error names the collective, its "
                        "group, the iteration and the pipeline stage")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop the run, naming the iteration and the rank(s), when the loss or the gradients hold a "
                        "NaN or Inf, before the optimizer writes them into the weights; a checkpoint with non-finite "
                        "weights is refused. With --fp16 an overflow still just skips the step (loss scaling)")
    g.add_argument("--log-straggler", action="store_true",
                   help="add each rank's compute time (step time minus time blocked in collectives) and data-wait "
                        "time, min and max with their ranks, to every log line, and a 'straggler' JSONL record with "
                        "every rank's; on CUDA also GPU power, temperature and clock (needs pynvml)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collector; collect at the same iterations on every rank "
                        "(--manual-gc-interval) and around each evaluation, so no rank stalls the others at random")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (>= 0; 0: only around evaluations)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: do not collect at the start and end of each evaluation")

    g = p.add_argument_group("Megatron-LM flags megalite accepts as no-ops or refuses (README: Megatron-LM's "
                             "launch scripts)")
    for flag, (kwargs, why) in REFUSED_FLAGS.items():
        g.add_argument(flag, help=why, **kwargs)
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="accepted, changes nothing: megalite never fuses weight-gradient accumulation into the "
                        "GEMM (Megatron-LM does with apex / Transformer Engine)")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="accepted, changes nothing: megalite's RoPE is plain PyTorch, never a fused kernel")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                   help="local is megalite's own layers (accepted); transformer_engine is refused: megalite "
                        "does not use Transformer Engine")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2],
                   help="0 is megalite's timing (the iteration time; accepted); 1 and 2 (per-phase timers) "
                        "are refused")
    g.add_argument("--rerun-mode", choices=["disabled", "validate_results", "report_stats"],
                   help="disabled is accepted; megalite has no re-run state machine, so the others are refused")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def _fail(msg: str):
    raise ArgumentError(msg)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _finite(v) -> bool:
    return isinstance(v, int) or math.isfinite(v)


# Each flag's own range: dest -> (test, the allowed values as the message says them). A flag left
# unset (None) is not tested here; whether it is required is a combination rule.
_AT_LEAST_1 = (lambda v: v >= 1, "an integer >= 1")
_RANGES = {
    **{d: _AT_LEAST_1 for d in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "num_query_groups",
        "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "ddp_bucket_size",
        "micro_batch_size", "global_batch_size", "train_iters", "lr_decay_iters",
        "lr_wsd_decay_iters", "loss_scale_window", "hysteresis", "inject_overflow_at_iteration", "vocab_size",
        "save_interval", "exit_interval", "log_interval", "eval_interval", "train_samples", "lr_decay_samples",
        "lr_wsd_decay_samples", "context_parallel_size", "tiktoken_num_special_tokens")},
    "lr_warmup_iters": (lambda v: v >= 0, "an integer >= 0 (0: no warmup)"),
    "lr_warmup_samples": (lambda v: v >= 0, "an integer >= 0 (0: no warmup)"),
    "profile_step_start": (lambda v: v >= 0, "an integer >= 0"),
    "profile_step_end": (lambda v: v >= 1, "an integer >= 1"),
    "decoupled_lr": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "decoupled_min_lr": (lambda v: _finite(v) and v >= 0, "a number >= 0"),
    "num_workers": (lambda v: v >= 0, "an integer >= 0 (0: load in the main process)"),
    "eval_iters": (lambda v: v >= 0, "an integer >= 0 (0: no evaluation)"),
    "seed": (lambda v: 0 <= v < 2**31, "an integer in [0, 2^31)"),
    "rotary_base": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "rotary_percent": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "norm_epsilon": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "hidden_dropout": (lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "attention_dropout": (lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "init_method_std": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "lr": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "min_lr": (lambda v: _finite(v) and v >= 0, "a number >= 0"),
    "lr_warmup_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "lr_warmup_init": (lambda v: _finite(v) and v >= 0, "a number >= 0"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a number >= 0"),
    "clip_grad": (lambda v: _finite(v) and v >= 0, "a number >= 0 (0: no clipping)"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_eps": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "sgd_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "loss_scale": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "initial_loss_scale": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "min_loss_scale": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "peak_tflops": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "exit_duration_in_mins": (lambda v: _finite(v) and v > 0, "a number > 0"),
}
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")
# flags whose effect is on documents: nothing to act on in uniform random tokens
_DOCUMENT_FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
# argparse defaults of flags refused unless left alone (or given an accepted value)
_SAMPLE_FLAGS = ("train_samples", "lr_decay_samples", "lr_wsd_decay_samples")


def _check_ranges(args) -> None:
    for dest in _REQUIRED:
        if getattr(args, dest, None) is None:
            _fail(f"{_flag(dest)} is required")
    for dest, (ok, allowed) in _RANGES.items():
        v = getattr(args, dest, None)
        if v is not None and not ok(v):  # NaN fails every comparison, so it is refused too
            _fail(f"{_flag(dest)} must be {allowed}, got {v}")


def _check_refused(args) -> None:
    """Megatron-LM flags megalite does not implement, and values of accepted flags it cannot honour."""
    for flag in REFUSED_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            _fail(f"{flag} is not supported: {REFUSED_FLAGS[flag][1].removeprefix('refused: ')}; drop it")
    fp8 = [f for f in ("fp8_format", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param_gather")
           if getattr(args, f)]
    if fp8:
        _fail(f"{_flag(fp8[0])} is not supported: FP8 training needs Hopper-class (or newer) GPUs and NVIDIA "
              f"Transformer Engine, which megalite does not use; drop the --fp8-* flags (--bf16 is the nearest)")
    if args.ckpt_format is not None:
        what = {"torch": "one pickled model_optim_rng.pt per model-parallel rank",
                "torch_dist": "Megatron-LM's distributed checkpoint format",
                "zarr": "Megatron-LM's zarr distributed checkpoints",
                "torch_dcp": "torch.distributed.checkpoint files", "fsdp_dtensor": "FSDP DTensor checkpoints"}
        _fail(f"--ckpt-format {args.ckpt_format} ({what[args.ckpt_format]}) is not supported: megalite reads and "
              f"writes one format of its own (rank_NNNNN.pt shards + metadata.json, loadable on any layout; "
              f"tools/checkpoint/convert.py converts to Hugging Face); drop the flag")
    if args.transformer_impl == "transformer_engine":
        _fail("--transformer-impl transformer_engine is not supported: megalite does not use NVIDIA Transformer "
              "Engine; drop the flag (or give local: megalite's own layers)")
    if args.timing_log_level:
        _fail(f"--timing-log-level {args.timing_log_level} is not supported: megalite times whole iterations "
              f"only (level 0)")
    if args.rerun_mode not in (None, "disabled"):
        _fail(f"--rerun-mode {args.rerun_mode} is not supported: megalite has no re-run state machine "
              f"(give disabled, or drop the flag)")


def _check_batch_schedule(args, dp_text: str) -> list[int]:
    """Training length and the global batch: constant, ramped up (--rampup-batch-size) or stepped
    (--step-batch-size-schedule), as Megatron-LM's validate_args and num-microbatches calculator.
    Returns every global batch size the run takes."""
    from .num_microbatches_calculator import NumMicroBatchesCalculator, parse_step_schedule
    if args.train_iters is None and args.train_samples is None:
        _fail("--train-iters or --train-samples is required")
    if args.train_iters is not None and args.train_samples is not None:
        _fail("--train-iters and --train-samples are mutually exclusive (iteration- or sample-based training)")
    sample_based = args.train_samples is not None
    mdp = args.micro_batch_size * args.data_parallel_size
    schedule = None
    if args.step_batch_size_schedule is not None:
        if args.rampup_batch_size is not None:
            _fail("--step-batch-size-schedule and --rampup-batch-size are mutually exclusive")
        if args.global_batch_size is not None:
            _fail("--global-batch-size cannot be combined with --step-batch-size-schedule: the schedule's last "
                  "batch size is the global batch size (Megatron-LM refuses both as well)")
        try:
            schedule = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        except ValueError as e:
            _fail(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: {e}")
        args.global_batch_size = schedule[-1][1]
    elif args.global_batch_size is None:
        args.global_batch_size = mdp
    changing = "--rampup-batch-size" if args.rampup_batch_size else (
        "--step-batch-size-schedule" if schedule else None)
    if changing and not sample_based:
        # Megatron-LM's validate_args: 'expected no batch-size rampup for iteration-based training'
        _fail(f"{changing} needs sample-based training: give --train-samples instead of --train-iters (and "
              f"--lr-decay-samples / --lr-warmup-samples instead of the *-iters flags). Megatron-LM refuses "
              f"it with --train-iters too: an iteration count does not say how many samples a changing batch "
              f"trains on")
    try:
        calc = NumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                                         args.rampup_batch_size, schedule)
    except ValueError as e:
        _fail(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: {e}")
    sizes = calc.batch_sizes(args.train_samples)
    for g in sizes:
        if g % mdp:
            what = (f"--global-batch-size ({g})" if changing is None else
                    f"global batch {g} of {changing}")
            _fail(f"{what} is not divisible by --micro-batch-size ({args.micro_batch_size}) x {dp_text}")
    args.num_microbatches = args.global_batch_size // mdp
    if sample_based:
        args.train_iters = calc.iterations_for(args.train_samples)
        if args.train_iters == 0:
            _fail(f"--train-samples ({args.train_samples}) is less than the first global batch "
                  f"({calc.current_global_batch_size(0)})")
    return sizes


def _check_operations(args) -> None:
    """Profiling, the logging rank's extras, determinism."""
    if args.profile:
        args.profile_step_start = 10 if args.profile_step_start is None else args.profile_step_start
        args.profile_step_end = 12 if args.profile_step_end is None else args.profile_step_end
        if args.profile_step_end <= args.profile_step_start:
            _fail(f"--profile-step-end ({args.profile_step_end}) must be greater than --profile-step-start "
                  f"({args.profile_step_start})")
        if args.profile_step_start >= args.train_iters:
            _fail(f"--profile-step-start ({args.profile_step_start}) is not below the {args.train_iters} "
                  f"training iterations: nothing would be traced")
        args.profile_ranks = [0] if args.profile_ranks is None else args.profile_ranks
        bad = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
        if bad:
            _fail(f"--profile-ranks {bad[0]} is not a rank of this run (world size {args.world_size})")
        args.profile_dir = args.tensorboard_dir or "profile"
    else:
        for dest in ("profile_step_start", "profile_step_end", "profile_ranks"):
            if getattr(args, dest) is not None:
                _fail(f"{_flag(dest)} needs --profile")
        args.profile_dir = None
    if args.deterministic_mode:
        if args.use_flash_attn:
            _fail("--deterministic-mode cannot use --use-flash-attn (its backward is not deterministic)")
        if args.cross_entropy_loss_fusion:
            _fail("--deterministic-mode refuses --cross-entropy-loss-fusion, as Megatron-LM does")


def _check_attention_backend(args, tp: int) -> None:
    """Run the chosen attention backend once, forward and backward, on this machine's device with
    the run's dtype, head shape, dropout and mask: a backend the device cannot run is refused here,
    naming it, instead of failing inside the first iteration."""
    import warnings

    import torch
    from .model.attention import probe_attention
    if args.attention_backend == "auto" and not args.use_flash_attn:
        return
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.distributed_backend == "nccl"
              else torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:  # SDPA says why a kernel was skipped in warnings
        warnings.simplefilter("always")
        try:
            probe_attention(args.attention_backend, args.use_flash_attn, heads=args.num_attention_heads // tp,
                            groups=args.num_query_groups // tp, head_dim=args.kv_channels, dtype=args.params_dtype,
                            dropout=args.attention_dropout, with_mask=args.reset_attention_mask, device=device)
            return
        except Exception as e:  # the kernel's own reason, shortened
            error = e
    why = [m for m in (str(w.message).split(" (Triggered")[0].strip() for w in caught) if not m.endswith(":")]
    reason = "; ".join(dict.fromkeys(why + [str(error).strip().splitlines()[0] if str(error).strip()
                                            else type(error).__name__]))[:300]
    _fail(f"--attention-backend {args.attention_backend} cannot run here ({device.type}, "
          f"{str(args.params_dtype).replace('torch.', '')}, head size {args.kv_channels}"
          f"{', attention dropout ' + str(args.attention_dropout) if args.attention_dropout else ''}"
          f"{', --reset-attention-mask' if args.reset_attention_mask else ''}): {reason}")


def validate_args(args, world_size: int | None = None, check_files: bool = True):
    """Check and complete `args` for `world_size` ranks. No collective; file checks (stat and
    small reads, no writes) only with `check_files`."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    args.notices = []  # start-up notes (a flag switched off as Megatron-LM does, ...), printed once
    _check_ranges(args)
    _check_refused(args)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        _fail(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
              f"--pipeline-model-parallel-size ({pp})" + (f" x --context-parallel-size ({cp})" if cp > 1 else ""))
    args.data_parallel_size = dp = world_size // (tp * pp * cp)
    args.rank_order = "tp-cp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-dp-pp"

    cp_text = f" x CP {cp}" if cp > 1 else ""
    batch_sizes = _check_batch_schedule(
        args, f"data-parallel size ({dp} = world {world_size} / (TP {tp} x PP {pp}{cp_text}))")

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
        for g in batch_sizes if args.virtual_pipeline_model_parallel_size > 1 else ():
            m = g // (args.micro_batch_size * dp)
            if m % pp:
                _fail(f"the interleaved schedule needs the number of micro-batches (global batch {g} / "
                      f"(--micro-batch-size x DP) = {m}) to be a multiple of --pipeline-model-parallel-size ({pp})")

    _check_model_shape(args, tp)
    _check_context_parallel(args, tp)
    _check_recompute(args, pp)
    _check_data(args)
    _check_schedule(args)
    _check_precision(args)
    _check_operations(args)

    # experiment trackers (W&B, TensorBoard): optional packages, checked before any process starts
    from .runtime.tracking import missing_packages
    for msg in missing_packages(args):
        _fail(msg)
    for flag in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
        if getattr(args, flag) and not args.wandb_project:
            _fail(f"{_flag(flag)} needs --wandb-project")

    # checkpointing
    if args.save_interval and not args.save:
        _fail("--save-interval needs --save")
    if args.async_save and not args.save:
        _fail("--async-save needs --save")
    if (args.finetune or args.no_load_optim or args.no_load_rng) and not args.load:
        _fail("--finetune / --no-load-optim / --no-load-rng need --load")
    _check_timeouts_and_gc(args)

    if check_files:
        check_paths(args)

    # last, the checks that need torch (imported only now: a bad flag above is refused fast)
    import torch
    if args.use_flash_attn:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            _fail("--use-flash-attn needs the flash-attn package (pip install flash-attn); it is not installed")
        if not torch.cuda.is_available() or not args.bf16:
            _fail("--use-flash-attn needs CUDA and --bf16")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA; use gloo on CPU")
    args.params_dtype = _str2dtype(args)
    if check_files:  # a probe on this machine's device; tools/plan.py plans for another one
        _check_attention_backend(args, tp)
    if args.deterministic_mode and args.distributed_backend == "nccl":
        if not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            _fail("--deterministic-mode on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS)")
        algos = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
        if os.environ.get("NCCL_ALGO") not in algos:
            _fail(f"--deterministic-mode needs NCCL_ALGO set to one of {', '.join(algos)} (as Megatron-LM)")
    if args.empty_unused_memory_level and args.distributed_backend != "nccl":
        args.notices.append(f"--empty-unused-memory-level {args.empty_unused_memory_level}: a no-op on CPU "
                            f"(it frees cached CUDA memory)")
    return args


def _check_model_shape(args, tp: int) -> None:
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
        args.ffn_hidden_size = max(1, int(8 * args.hidden_size / 3)) if args.swiglu else 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by --tensor-model-parallel-size ({tp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({args.max_position_embeddings})")
    if args.position_embedding_type == "rope":
        # RoPE rotates channel pairs: the rotated part of each head must be a positive even size
        rot = int(args.kv_channels * args.rotary_percent)
        if rot < 2 or rot % 2:
            _fail(f"--rotary-percent {args.rotary_percent} x {args.kv_channels} channels per head = {rot} rotated "
                  f"channels; RoPE needs a positive even number")
    if args.reset_attention_mask and args.use_flash_attn:
        _fail("--reset-attention-mask needs an explicit mask, which --use-flash-attn does not take")
    if args.use_flash_attn and args.attention_backend not in ("auto", "flash"):
        _fail(f"--use-flash-attn selects the flash-attn package, which --attention-backend "
              f"{args.attention_backend} excludes; use --attention-backend flash (or auto)")
    if args.openai_gelu and args.swiglu:
        _fail("--openai-gelu selects the GeLU MLP's activation; --swiglu has none (choose one)")
    if (args.use_rope_scaling or args.rotary_seq_len_interpolation_factor) and args.position_embedding_type != "rope":
        _fail("--use-rope-scaling / --rotary-seq-len-interpolation-factor need --position-embedding-type rope")
    if args.use_rope_scaling and not args.rope_scaling_low_freq_factor < args.rope_scaling_high_freq_factor:
        _fail("--rope-scaling-low-freq-factor must be below --rope-scaling-high-freq-factor")


def _check_recompute(args, pp: int) -> None:
    """Activation memory: recompute and sequence parallelism (Megatron-LM's rules)."""
    tp = args.tensor_model_parallel_size
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
    if args.sequence_parallel and tp == 1:
        # as Megatron-LM: without TP there is nothing to shard along the sequence
        args.sequence_parallel = False
        args.notices.append("--sequence-parallel switched off: --tensor-model-parallel-size is 1 (as Megatron-LM)")
    if args.sequence_parallel:
        if args.seq_length % tp:
            _fail(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                  f"--tensor-model-parallel-size ({tp})")


def _check_context_parallel(args, tp: int) -> None:
    """--context-parallel-size: the sequence must cut into 2·CP equal chunks (each split again over
    TP under sequence parallelism), and the features that cannot follow a sequence split are refused."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    sp = args.sequence_parallel and tp > 1
    need = 2 * cp * (tp if sp else 1)
    if args.seq_length % need:
        _fail(f"--context-parallel-size {cp} needs --seq-length ({args.seq_length}) divisible by 2 x CP"
              + (f" x --tensor-model-parallel-size (with --sequence-parallel) = {need}" if sp else f" = {need}"))
    if args.use_flash_attn:
        _fail(f"--context-parallel-size {cp} cannot be combined with --use-flash-attn: context-parallel attention "
              f"needs an explicit mask over the gathered keys, which flash_attn_func does not take; drop "
              f"--use-flash-attn (torch SDPA is used)")


def _check_data(args) -> None:
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        _fail("--reset-attention-mask needs the attention mask the data loader builds (documents may not attend "
              "to each other), which --no-create-attention-mask-in-dataloader turns off; drop one of them "
              "(Megatron-LM would silently attend across documents)")
    paths = {"data_path": args.data_path, "train_data_path": args.train_data_path,
             "valid_data_path": args.valid_data_path, "test_data_path": args.test_data_path}
    given = [d for d, v in paths.items() if v is not None]
    try:
        check_tokenizer_args(args)
    except InputError as e:
        _fail(str(e))
    if args.mock_data:
        if given:
            _fail(f"--mock-data cannot be combined with {_flag(given[0])}: mock data replaces the dataset")
        if args.vocab_size is None and args.tokenizer_type is None:
            _fail("--mock-data needs --vocab-size (or a --tokenizer-type, whose vocabulary is used)")
        # refused rather than ignored: each would change nothing, and a user who sets one expects it to
        for dest in _DOCUMENT_FLAGS:
            if getattr(args, dest):
                _fail(f"{_flag(dest)} has no effect with --mock-data: mock samples are uniform random tokens "
                      f"with no end-of-document markers; drop it, or train on a dataset (--data-path)")
        if args.split != DEFAULT_SPLIT:
            _fail("--split has no effect with --mock-data (there is no dataset to split); drop it")
        if args.data_cache_path:
            _fail("--data-cache-path has no effect with --mock-data (mock data builds no index); drop it")
        if not args.mmap_bin_files:
            _fail("--no-mmap-bin-files has no effect with --mock-data (there are no .bin files to read); drop it")
        return
    if not given:
        _fail("no training data: give --data-path (or --train-data-path ...) or --mock-data")
    for dest in given:
        if not paths[dest]:
            _fail(f"{_flag(dest)} needs at least one dataset prefix")
        try:
            parse_blend(paths[dest], _flag(dest))
        except InputError as e:
            _fail(str(e))
    if args.data_path is not None and len(given) > 1:
        _fail(f"use either --data-path with --split or --train/valid/test-data-path, not both "
              f"(got --data-path and {_flag(given[1])})")
    if args.data_path is None and args.split != DEFAULT_SPLIT:
        _fail("--split applies to --data-path only; --train/valid/test-data-path are used whole")
    try:
        parse_and_normalize_split(args.split)
    except InputError as e:
        _fail(str(e))
    if args.tokenizer_type is None:
        _fail("--tokenizer-type is required with a dataset (it gives the vocabulary and the end-of-document id)")
    if args.train_data_path is None and args.data_path is None:
        _fail("no training data: --valid-data-path / --test-data-path need --train-data-path")


def _check_schedule(args) -> None:
    """The learning-rate schedule, in iterations (--train-iters) or samples (--train-samples), as
    Megatron-LM: the flags of the other kind are refused. Either way the schedule itself counts
    samples (OptimizerConfig.lr_*_samples): iterations are converted at the global batch size."""
    G = args.global_batch_size
    unit = "samples" if args.train_samples is not None else "iters"
    other = "iters" if unit == "samples" else "samples"
    for name in ("decay", "wsd_decay", "warmup"):
        dest = f"lr_{name}_{other}"
        if getattr(args, dest):  # None, or the warmup's default 0
            _fail(f"{_flag(dest)} belongs to {'iteration' if other == 'iters' else 'sample'}-based training; "
                  f"with {'--train-samples' if unit == 'samples' else '--train-iters'} give "
                  f"{_flag(f'lr_{name}_{unit}')}")
    decay, warmup, wsd = (f"lr_decay_{unit}", f"lr_warmup_{unit}", f"lr_wsd_decay_{unit}")
    if getattr(args, decay) is None:
        setattr(args, decay, args.train_iters if unit == "iters" else args.train_samples)
    if args.lr_warmup_fraction is not None:
        if getattr(args, warmup):
            _fail(f"--lr-warmup-fraction and {_flag(warmup)} are mutually exclusive")
        setattr(args, warmup, int(args.lr_warmup_fraction * getattr(args, decay)))
    if getattr(args, warmup) > getattr(args, decay):
        _fail(f"{_flag(warmup)} ({getattr(args, warmup)}) exceeds {_flag(decay)} ({getattr(args, decay)})")
    if args.lr_decay_style == "WSD":
        if getattr(args, wsd) is None:
            _fail(f"--lr-decay-style WSD needs {_flag(wsd)}")
        if getattr(args, wsd) > getattr(args, decay):
            _fail(f"{_flag(wsd)} ({getattr(args, wsd)}) exceeds {_flag(decay)} ({getattr(args, decay)})")
    elif getattr(args, wsd) is not None:
        _fail(f"{_flag(wsd)} applies to --lr-decay-style WSD only")
    # the schedule in samples (exactly Megatron-LM's: a warmup fraction may end inside an iteration)
    scale = G if unit == "iters" else 1
    args.lr_decay_samples = getattr(args, decay) * scale
    args.lr_warmup_samples = (args.lr_warmup_fraction * args.lr_decay_samples if args.lr_warmup_fraction is not None
                              else getattr(args, warmup) * scale)
    args.lr_wsd_decay_samples = getattr(args, wsd) * scale if getattr(args, wsd) is not None else None
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) exceeds --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        _fail("--decoupled-min-lr needs --decoupled-lr (Megatron-LM ignores it alone)")
    if args.decoupled_lr is not None:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if low > args.decoupled_lr:
            which = "--decoupled-min-lr" if args.decoupled_min_lr is not None else "--min-lr"
            _fail(f"the decoupled minimum learning rate ({which} {low}) exceeds --decoupled-lr ({args.decoupled_lr})")


def _check_precision(args) -> None:
    """Mixed precision and the distributed optimizer."""
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive")
    if args.loss_scale is not None and not (args.fp16 or args.bf16):
        _fail("--loss-scale needs --fp16 or --bf16 (fp32 training does not scale the loss)")
    dynamic = {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2}
    for flag, default in dynamic.items():
        if getattr(args, flag) != default and (not args.fp16 or args.loss_scale is not None):
            _fail(f"{_flag(flag)} sets dynamic loss scaling, which only --fp16 without --loss-scale uses")
    if args.fp16 and args.min_loss_scale > args.initial_loss_scale:
        _fail(f"need 0 < --min-loss-scale ({args.min_loss_scale}) <= --initial-loss-scale "
              f"({args.initial_loss_scale})")
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
    if args.compile and strategy == "optim_grads_params":
        _fail("--compile with --data-parallel-sharding-strategy optim_grads_params is not supported: ZeRO-3 "
              "gathers and frees each layer's parameters in hooks around the very layers --compile traces; "
              "use optim_grads, or drop --compile")
    if args.grad_reduce_in_bf16 and not args.bf16:
        _fail("--grad-reduce-in-bf16 needs --bf16 (with fp16 or fp32 parameters the gradients stay fp32; "
              "Megatron-LM ignores it there)")


def _check_timeouts_and_gc(args) -> None:
    """The operations group: timeouts and garbage collection."""
    m = args.distributed_timeout_minutes
    if not (_finite(m) and m > 0):
        _fail(f"--distributed-timeout-minutes must be a number > 0 (fractions allowed), got {m}")
    if args.manual_gc_interval < 0:
        _fail(f"--manual-gc-interval must be an integer >= 0 (0: only around evaluations), got {args.manual_gc_interval}")
    if not args.manual_gc and (args.manual_gc_interval or not args.manual_gc_eval):
        _fail("--manual-gc-interval / --no-manual-gc-eval need --manual-gc")


def check_paths(args) -> None:
    """The files and directories the flags name: inputs must exist, outputs must not clobber
    anything. Stats and small reads only; every rank sees the same answer on a shared file system."""
    from .checkpoint.files import TRACKER, inspect_checkpoint

    # datasets
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, dest):
            prefixes, _ = parse_blend(getattr(args, dest), _flag(dest))
            for prefix in prefixes:
                try:  # files, header, sizes and dtype (memory-mapped: the same cost for any corpus size)
                    open_dataset(prefix, _flag(dest))
                except UserError as e:
                    _fail(str(e))
    # tokenizer files
    for dest in TOKENIZER_FILE_FLAGS.get(args.tokenizer_type, ()):
        path = getattr(args, dest)
        want_dir = dest == "tokenizer_model" and args.tokenizer_type == "HuggingFaceTokenizer"
        if not (os.path.isdir(path) if want_dir else os.path.isfile(path)):
            _fail(f"{_flag(dest)} {path}: {'directory' if want_dir else 'file'} not found "
                  f"(--tokenizer-type {args.tokenizer_type})")
    # outputs that must be directories, or files, and that this process can create
    for dest in ("save", "load", "data_cache_path", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, dest)
        if path and os.path.exists(path) and not os.path.isdir(path):
            _fail(f"{_flag(dest)} {path} exists and is not a directory")
    if args.log_jsonl and os.path.isdir(args.log_jsonl):
        _fail(f"--log-jsonl {args.log_jsonl} is a directory; give a file to append to")
    for dest in ("save", "data_cache_path", "tensorboard_dir", "wandb_save_dir", "log_jsonl"):
        path = getattr(args, dest)
        if path:
            _check_creatable(path, _flag(dest))
    if getattr(args, "profile_dir", None):
        _check_creatable(args.profile_dir, "--profile (its trace directory)")
    # the checkpoint to resume from: readable before any process group exists
    if args.load and os.path.isfile(os.path.join(args.load, TRACKER)):
        inspect_checkpoint(args.load, "--load")
    # a run writes iter_N directories and moves the latest pointer: into a directory that holds
    # another run's checkpoints it would replace them, so that needs --load of the same directory
    if args.save and os.path.isfile(os.path.join(args.save, TRACKER)):
        same = args.load and os.path.realpath(args.load) == os.path.realpath(args.save)
        if not same:
            _fail(f"--save {args.save} already holds checkpoints; saving into it without resuming from it would "
                  f"overwrite them: add --load {args.save} to resume, or choose a new --save directory")
        if args.finetune:
            _fail(f"--finetune restarts at iteration 0, so saving into --save {args.save} would overwrite its "
                  f"checkpoints; choose a new --save directory")


def _check_creatable(path: str, flag: str) -> None:
    """The nearest existing ancestor of `path` must be a writable directory (found at start-up,
    not at the first save)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        _fail(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(f"{flag} {path}: {parent} is not writable")


def build_run_config(args: argparse.Namespace):
    """The validated flags as typed configs, one per subsystem: the Namespace stops here."""
    from .config import (CheckpointConfig, DataConfig, DDPConfig, OptimizerConfig, ParallelConfig, RunConfig,
                         TrackingConfig, TrainingConfig, from_args)
    from .model import GPTConfig
    from .runtime.tracking import json_safe
    model = from_args(GPTConfig, args, vocab_size=args.vocab_size or 0, padded_vocab_size=0,
                      add_bias_linear=not args.disable_bias_linear)  # vocabulary: filled from the tokenizer
    return RunConfig(model=model, parallel=from_args(ParallelConfig, args), ddp=from_args(DDPConfig, args),
                     optimizer=from_args(OptimizerConfig, args), data=from_args(DataConfig, args),
                     checkpoint=from_args(CheckpointConfig, args), tracking=from_args(TrackingConfig, args),
                     training=from_args(TrainingConfig, args), flags=json_safe(vars(args)),
                     notices=list(getattr(args, "notices", [])))
