#!/usr/bin/env python3
"""Plan a parallel layout before renting the GPUs: per-GPU memory, pipeline bubble, FLOPs.

Takes pretrain_gpt.py's own flags (model, parallelism, batch, precision, recompute) plus the
number of GPUs, and prints what each GPU would hold:

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --micro-batch-size 1 --global-batch-size 1536 --bf16 \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel \\
        --recompute-activations --use-distributed-optimizer --world-size 1024 [--json]

or, for a launch script in examples/: `DRY_RUN=1 bash examples/gpt3_175B.sh` prints the command.

Memory per GPU (Megatron-LM's accounting, bytes per parameter; d = DP size), for the strategy of
--data-parallel-sharding-strategy and, side by side, for every other one:
  params     4 (fp32) or 2 (--bf16 / --fp16); / d under ZeRO-3 (optim_grads_params)
  grads      4: the contiguous fp32 gradient buffer, whatever the parameter dtype; / d under
             ZeRO-2 (optim_grads) and ZeRO-3
  optimizer  Adam m and v: 8, plus an fp32 master copy (4) when parameters are 16-bit;
             / d under ZeRO-1 (optim, --use-distributed-optimizer), ZeRO-2 and ZeRO-3; with
             --optimizer-cpu-offload the fraction --optimizer-offload-fraction of it is host memory
  working set  ZeRO-2/3 only, what comes and goes during a step: gradients pass through
             bucket-sized fp32 staging buffers (at most 4 at once: 2 reducing, 2 filling, so the
             4 biggest buckets);
             ZeRO-3 gathers whole parameters per unit (the chunk's own: output layer, final
             norm; plus the two biggest of the embedding and the layers: the one in use and the
             prefetched next), in the parameter dtype
  padding    each bucket is padded to a multiple of d: at most (d-1) elements per bucket of the
             parameter and gradient buffers, stated as a bound, not added to the total
  activations  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
             Models"), Table 2, per layer and micro-batch in 16-bit:
                 s·b·h·(10 + 24/t + 5·a·s/(h·t))    TP
                 s·b·h·(34 + 5·a·s/h)/t             TP + sequence parallel
             selective recompute (or flash attention) drops the 5·a·s/h term (the s² attention
             scores are recomputed / never stored); full recompute keeps only each recomputed
             group's 2·s·b·h input (/t with SP). The 24 is 8 (Q, K, V, attention output) + 16 (a
             4h GeLU MLP); it is scaled here for GQA (K, V by groups/heads), other MLP sizes and
             SwiGLU (1.5x). The first pipeline stage holds the activations of the micro-batches
             in flight: min(p, m) with 1F1B, p + (p-1)/v chunks' worth with the interleaved
             schedule (Sec. 4.2.3). The last stage adds the output layer and fp32 logits,
             4·s·b·h·(1 + v/h)/t. fp32 activations count double. Context parallelism
             (--context-parallel-size c) divides every term by c (s -> s/c per rank; the scores are
             [s/c, s]), and adds the K and V of the whole sequence that its all-gather keeps for
             backward, 4·s·b·h·(groups/heads)/t per layer.
Parameter counts are exact for megalite's model (checked against the `memory_footprint`
record of real runs in tests/test_plan.py): padded vocabulary, the tied embedding's copy on the
last stage when PP > 1, position embeddings on the first stage, biases and norms per the flags.
Not counted: the CUDA context, NCCL buffers, allocator fragmentation, temporary buffers (a few GB).

Pipeline bubble (Narayanan et al. 2021, Sec. 2.2): (p - 1) / (v·m + p - 1), m micro-batches per
iteration, v virtual stages per rank. FLOPs: megalite.runtime.metrics.num_floating_point_operations.
Exit status: 0 when the layout fits --gpu-memory-gb, 1 when it does not, 2 for bad flags.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import DEFAULT_SPLIT, build_parser, validate_args  # noqa: E402
from megalite.distributed.strategy import STRATEGIES, ShardingStrategy, default_strategy_name  # noqa: E402
from megalite.errors import cli  # noqa: E402
from megalite.runtime.metrics import num_floating_point_operations  # noqa: E402
from megalite.model import pad_vocab_size  # noqa: E402

GIB = 2**30
GPT2_VOCAB = 50257

# Flags of features that may not be in this trainer yet: declared here (Megatron-LM's names and
# meanings) only when pretrain_gpt.py's parser lacks them, so a layout can be planned either way.
FUTURE_FLAGS = [
    ("--use-distributed-optimizer", dict(action="store_true", help="ZeRO-1: optimizer state sharded over DP")),
    ("--overlap-grad-reduce", dict(action="store_true")),
    ("--overlap-param-gather", dict(action="store_true")),
    ("--fp16", dict(action="store_true", help="fp16 parameters (memory as --bf16)")),
    ("--sequence-parallel", dict(action="store_true")),
    ("--recompute-activations", dict(action="store_true", help="selective recompute")),
    ("--recompute-granularity", dict(choices=["full", "selective"])),
    ("--recompute-method", dict(choices=["uniform", "block"])),
    ("--recompute-num-layers", dict(type=int)),
]


def build_plan_parser():
    p = build_parser()
    p.prog = "tools/plan.py"
    p.description = "Per-GPU memory, pipeline bubble and FLOPs of a pretrain_gpt.py layout (no GPU needed)."
    g = p.add_argument_group("plan (this tool's own flags)")
    g.add_argument("--world-size", type=int, help="number of GPUs (default: TP x PP, i.e. DP = 1)")
    g.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU, GiB")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    future = [(f, kw) for f, kw in FUTURE_FLAGS if f not in p._option_string_actions]
    if future:
        g = p.add_argument_group("flags of features this trainer does not have yet (planned as in Megatron-LM)")
        for flag, kw in future:
            g.add_argument(flag, **kw)
    return p


def _vocab_size(args) -> int:
    """--vocab-size, else the tokenizer's when its files are at hand, else GPT-2's 50257."""
    if args.vocab_size:
        return args.vocab_size
    if args.tokenizer_type and args.tokenizer_type != "NullTokenizer":
        try:
            from megalite.data.tokenizers import build_tokenizer
            return build_tokenizer(args).vocab_size
        except Exception:  # files not on this machine: fall through to the usual GPT-2 size
            pass
    return GPT2_VOCAB


def parse(argv=None):
    """pretrain_gpt.py's flags -> validated args (what the trainer would run), plus plan options.
    Flags that only matter at run time (iterations, learning rate, data) get placeholders."""
    args = build_plan_parser().parse_args(argv)
    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    if args.train_iters is None:
        args.train_iters = 1
    if args.lr is None:
        args.lr = 1e-4
        args.min_lr = min(args.min_lr, args.lr)
    args.vocab_size = _vocab_size(args)
    if not any([args.data_path, args.train_data_path, args.valid_data_path, args.test_data_path]):
        # planned on mock data: the flags about documents and dataset files change nothing here
        args.mock_data = True
        args.split, args.data_cache_path = DEFAULT_SPLIT, None
        args.eod_mask_loss = args.reset_position_ids = args.reset_attention_mask = False
    # conditions of the machine that runs the job, not of the layout
    args.plan_flash_attn, args.use_flash_attn = args.use_flash_attn, False
    args.distributed_backend = None
    for flag in ("wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "tensorboard_dir"):
        setattr(args, flag, None)
    world = args.world_size or (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                * args.context_parallel_size)
    validate_args(args, world, check_files=False)  # the files are on the machine that will run it
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size)
    return args


# -- parameters --------------------------------------------------------------------------------
def layer_params(args) -> tuple[int, int]:
    """(elements sharded over TP, on one TP rank; elements replicated on every TP rank) of one
    transformer layer, as megalite builds it."""
    h, t = args.hidden_size, args.tensor_model_parallel_size
    bias = not args.disable_bias_linear
    norm = h * (2 if args.normalization == "LayerNorm" else 1)
    qkv = (args.num_attention_heads + 2 * args.num_query_groups) * args.kv_channels // t
    proj_in = args.num_attention_heads * args.kv_channels // t
    fc1 = args.ffn_hidden_size * (2 if args.swiglu else 1) // t
    fc2_in = args.ffn_hidden_size // t
    sharded = qkv * h + proj_in * h + fc1 * h + fc2_in * h + ((qkv + fc1) if bias else 0)
    replicated = 2 * norm + (2 * h if bias else 0)  # two norms; row-parallel biases are whole
    return sharded, replicated


def stage_params(args, pp_rank: int) -> int:
    """Parameters held by one GPU of pipeline stage `pp_rank` (every TP and DP rank of a stage
    holds the same number)."""
    h, t = args.hidden_size, args.tensor_model_parallel_size
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    sharded, replicated = layer_params(args)
    n = (args.num_layers // p) * (sharded + replicated)
    word = args.padded_vocab_size // t * h
    for c in range(v):
        pre, post = pp_rank == 0 and c == 0, pp_rank == p - 1 and c == v - 1
        if pre:
            n += word
            if args.position_embedding_type == "learned_absolute":
                n += args.max_position_embeddings * h
        if post:
            n += h * (2 if args.normalization == "LayerNorm" else 1)  # final norm
            if args.untie_embeddings_and_output_weights or not pre:
                n += word  # output layer, or the tied embedding's copy on the last stage
    return n


def total_params(args) -> int:
    """Parameters of the whole model, each counted once (as the trainer's start-up line)."""
    h, t = args.hidden_size, args.tensor_model_parallel_size
    sharded, replicated = layer_params(args)
    n = args.num_layers * (sharded * t + replicated)
    n += args.padded_vocab_size * h * (2 if args.untie_embeddings_and_output_weights else 1)
    if args.position_embedding_type == "learned_absolute":
        n += args.max_position_embeddings * h
    return n + h * (2 if args.normalization == "LayerNorm" else 1)


# -- activations -------------------------------------------------------------------------------
def recompute_setting(args) -> tuple[str | None, str | None, int]:
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"
    method = getattr(args, "recompute_method", None) or "uniform"
    k = getattr(args, "recompute_num_layers", None) or 1
    return granularity, (method if granularity == "full" else None), k


def layer_activation_bytes(args) -> tuple[float, float]:
    """(bytes one layer stores for one micro-batch, bytes of its input alone), Korthikanti et al.
    2022 Table 2, for this TP / SP / recompute setting."""
    c = getattr(args, "context_parallel_size", 1)
    s, b, h = args.seq_length // c, args.micro_batch_size, args.hidden_size  # this rank's s/c tokens
    a, t = args.num_attention_heads, args.tensor_model_parallel_size
    sp = bool(getattr(args, "sequence_parallel", False)) and t > 1
    granularity, _, _ = recompute_setting(args)
    # 24 = 8 attention (Q, K, V, context) + 16 MLP (4h GeLU): scaled for GQA, the MLP size, SwiGLU;
    # under CP the all-gathered K and V of the whole sequence (c x this rank's) are kept too
    attention = 4 + 4 * args.num_query_groups / a * (1 + c if c > 1 else 1)
    mlp = 4 * args.ffn_hidden_size / h * (1.5 if args.swiglu else 1.0)
    # the scores of s/c queries against all s keys
    scores = 0.0 if (granularity == "selective" or args.plan_flash_attn) else 5 * a * args.seq_length / h
    coeff = (10 + attention + mlp + scores) / t if sp else 10 + (attention + mlp + scores) / t
    scale = 1.0 if (args.bf16 or getattr(args, "fp16", False)) else 2.0  # the formula is for 16-bit
    return s * b * h * coeff * scale, 2 * s * b * h / (t if sp else 1) * scale


def in_flight_chunks(args, pp_rank: int) -> int:
    """Model chunks' worth of micro-batch activations pipeline rank `pp_rank` holds at its peak:
    Megatron-LM's warm-up count plus one, at most all m·v of them."""
    p, v, m = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, args.num_microbatches
    if p == 1:
        return 1
    warmup = (p - pp_rank - 1) * 2 + (v - 1) * p if v > 1 else p - pp_rank - 1
    return min(warmup + 1, m * v)


def stage_activation_bytes(args, pp_rank: int) -> float:
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    s, b, h, t = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    s //= getattr(args, "context_parallel_size", 1)  # this rank's tokens under CP
    sp = bool(getattr(args, "sequence_parallel", False)) and t > 1
    full, checkpoint = layer_activation_bytes(args)
    granularity, method, k = recompute_setting(args)
    n = args.num_layers // (p * v)  # layers per model chunk
    transient = 0.0
    if granularity == "full":
        if method == "block":
            kept = min(k, n) * checkpoint + (n - min(k, n)) * full
        else:  # uniform: the input of every group of k layers; one group is rebuilt at a time
            kept = math.ceil(n / k) * checkpoint
        transient = min(k, n) * full
    else:
        kept = n * full
    chunks = in_flight_chunks(args, pp_rank)
    total = chunks * kept + transient
    scale = 1.0 if (args.bf16 or getattr(args, "fp16", False)) else 2.0
    if pp_rank == 0:  # embedding dropout mask per micro-batch in flight
        total += chunks / v * s * b * h / (t if sp else 1)
    if pp_rank == p - 1:  # final norm output, output-layer input, fp32 logits (one micro-batch)
        total += 4 * s * b * h / t * (1 + args.padded_vocab_size / h) * scale
    return total


# -- data-parallel sharding ------------------------------------------------------------------------
def unit_params(args, pp_rank: int) -> tuple[int, list[int]]:
    """ZeRO-3 units of one GPU of stage `pp_rank` (distributed/zero3.py): (the largest chunk's own
    unit: output layer, final norm, and the word embedding when it is the output layer too; the
    other units: embedding and layers), in elements."""
    h, t = args.hidden_size, args.tensor_model_parallel_size
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    sharded, replicated = layer_params(args)
    word = args.padded_vocab_size // t * h
    pos = args.max_position_embeddings * h if args.position_embedding_type == "learned_absolute" else 0
    tied = not args.untie_embeddings_and_output_weights
    own, units = 0, [sharded + replicated] * (args.num_layers // (p * v))
    for c in range(v):
        pre, post = pp_rank == 0 and c == 0, pp_rank == p - 1 and c == v - 1
        n = 0
        if post:
            n += h * (2 if args.normalization == "LayerNorm" else 1) + (word if (not tied or not pre) else 0)
        if pre and post and tied:
            n += word + pos
        elif pre:
            units.append(word + pos)
        own = max(own, n)
    return own, units


def bucket_sizes(args, pp_rank: int, strategy: ShardingStrategy) -> list[int]:
    """Approximate bucket sizes (elements) of the sharded-gradient layouts (distributed/buckets.py):
    a vocabulary table of at least --ddp-bucket-size elements gets a bucket of its own; ZeRO-3
    cuts every unit into buckets, ZeRO-2 only the stage's parameters as a whole."""
    bs, h, t = args.ddp_bucket_size, args.hidden_size, args.tensor_model_parallel_size
    word = args.padded_vocab_size // t * h
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    tables = 0  # word embedding and output layer tables on this stage
    for c in range(v):
        pre, post = pp_rank == 0 and c == 0, pp_rank == p - 1 and c == v - 1
        tables += int(pre) + int(post and (args.untie_embeddings_and_output_weights or not pre))
    tables = tables if word >= bs else 0
    own, units = unit_params(args, pp_rank)
    parts = units + [own] if strategy.shards_params else [stage_params(args, pp_rank)]
    sizes, left = [word] * tables, tables
    for u in sorted(parts, reverse=True):
        cut = min(left, u // word) if tables else 0  # the tables come out of the units holding them
        left -= cut
        u -= cut * word
        sizes += [bs] * (u // bs) + ([u % bs] if u % bs else [])
    return sizes


def strategy_bytes(args, pp_rank: int, strategy: ShardingStrategy) -> dict:
    """Bytes per GPU of stage `pp_rank` under `strategy` (module docstring). ZeRO shards over
    DP x CP: context-parallel ranks hold the same parameters."""
    d = args.data_parallel_size * getattr(args, "context_parallel_size", 1)
    s_opt, s_grads, s_params = strategy.shards_optimizer, strategy.shards_grads, strategy.shards_params
    n = stage_params(args, pp_rank)
    sixteen_bit = bool(args.bf16 or getattr(args, "fp16", False))
    pb = 2 if sixteen_bit else 4
    state = 8 if args.optimizer == "adam" else (4 if args.sgd_momentum else 0)
    opt_per_param = state + (4 if sixteen_bit else 0)
    offload = getattr(args, "optimizer_offload_fraction", 1.0) if getattr(args, "optimizer_cpu_offload", False) else 0.0
    if s_opt and offload and not sixteen_bit:
        opt_per_param += 4  # an offloaded fp32 parameter gets a host master of its own
    optimizer = n * opt_per_param / (d if s_opt else 1)
    own, units = unit_params(args, pp_rank)
    v = args.virtual_pipeline_model_parallel_size
    if s_params:
        buckets = v * (args.num_layers // (args.pipeline_model_parallel_size * v) + 3)
    else:
        buckets = math.ceil(n / args.ddp_bucket_size) + (v + 1 if s_grads else 0)
    gathered = staging = 0.0
    if s_grads:
        staging = 4 * sum(sorted(bucket_sizes(args, pp_rank, strategy))[-4:])
    if s_params:
        gathered = (own + sum(sorted(units)[-2:])) * pb
    out = {"params": n * pb / (d if s_params else 1), "grads": 4 * n / (d if s_grads else 1),
           "optimizer": optimizer * (1 - offload), "optimizer_host": optimizer * offload,
           "working_set": gathered + staging, "gathered_params": gathered, "staging_grads": staging,
           "buckets": buckets, "padding_max": (d - 1) * buckets * (pb + 4) if s_opt else 0}
    return out


# -- the plan ------------------------------------------------------------------------------------
def make_plan(argv=None) -> dict:
    """The plan (the --json object) for pretrain_gpt.py-style flags `argv`."""
    return plan_from_args(parse(argv))


def plan_from_args(args) -> dict:
    p, t, dp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size, args.data_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    strategy = getattr(args, "data_parallel_sharding_strategy", None) or default_strategy_name(
        getattr(args, "use_distributed_optimizer", False))
    zero1 = STRATEGIES[strategy].shards_optimizer
    stages = []
    for r in range(p):
        n = stage_params(args, r)
        by = {name: strategy_bytes(args, r, s) for name, s in STRATEGIES.items()}
        activations = stage_activation_bytes(args, r)
        for b in by.values():
            b["total"] = b["params"] + b["grads"] + b["optimizer"] + b["working_set"] + activations
        mem = by[strategy]
        opt_full, opt_zero1 = by["no_shard"]["optimizer"], by["optim"]["optimizer"] + by["optim"]["optimizer_host"]
        stages.append({
            "pp_rank": r, "num_params": n, "param_bytes": mem["params"], "grad_bytes": mem["grads"],
            "optimizer_bytes": mem["optimizer"], "optimizer_host_bytes": mem["optimizer_host"],
            "optimizer_bytes_without_zero1": opt_full, "optimizer_bytes_with_zero1": opt_zero1,
            "working_set_bytes": mem["working_set"], "gathered_param_bytes": mem["gathered_params"],
            "staging_grad_bytes": mem["staging_grads"], "padding_bytes_max": mem["padding_max"],
            "activation_bytes": activations, "total_bytes": mem["total"],
            "total_bytes_without_zero1": by["no_shard"]["total"],
            "total_bytes_with_zero1": by["optim"]["total"] - by["optim"]["optimizer"] + opt_zero1,
            "total_bytes_by_strategy": {s: b["total"] for s, b in by.items()},
            "by_strategy": by,
            "in_flight_micro_batches": in_flight_chunks(args, r) / args.virtual_pipeline_model_parallel_size,
        })
    worst = max(stages, key=lambda st: st["total_bytes"])
    v, m = args.virtual_pipeline_model_parallel_size, args.num_microbatches
    granularity, method, k = recompute_setting(args)
    memory_gb = {key: worst[f"{field}_bytes"] / GIB for key, field in
                 (("params", "param"), ("grads", "grad"), ("optimizer", "optimizer"),
                  ("working_set", "working_set"), ("activations", "activation"), ("total", "total"))}
    by_strategy_gb = {s: {k: val / GIB for k, val in worst["by_strategy"][s].items() if k != "buckets"}
                      for s in STRATEGIES}
    return {
        "layout": {"world_size": args.world_size, "tp": t, "pp": p, "dp": dp, "cp": cp, "vpp": v,
                   "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
                   "num_microbatches": m, "seq_length": args.seq_length,
                   "precision": "bf16" if args.bf16 else ("fp16" if getattr(args, "fp16", False) else "fp32"),
                   "distributed_optimizer": zero1, "data_parallel_sharding_strategy": strategy,
                   "optimizer_cpu_offload": bool(getattr(args, "optimizer_cpu_offload", False)),
                   "sequence_parallel": bool(getattr(args, "sequence_parallel", False)) and t > 1,
                   "recompute": granularity or "none", "recompute_method": method,
                   "recompute_num_layers": k if granularity == "full" else None,
                   "flash_attn": bool(args.plan_flash_attn)},
        "model": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "num_attention_heads": args.num_attention_heads, "num_query_groups": args.num_query_groups,
                  "ffn_hidden_size": args.ffn_hidden_size, "vocab_size": args.vocab_size,
                  "padded_vocab_size": args.padded_vocab_size},
        "num_params_total": total_params(args),
        "num_params_per_gpu": max(st["num_params"] for st in stages),
        "memory_gb": memory_gb,
        "memory_gb_optimizer_without_zero1": worst["optimizer_bytes_without_zero1"] / GIB,
        "memory_gb_optimizer_with_zero1": worst["optimizer_bytes_with_zero1"] / GIB,
        "memory_gb_total_without_zero1": worst["total_bytes_without_zero1"] / GIB,
        "memory_gb_total_with_zero1": worst["total_bytes_with_zero1"] / GIB,
        "memory_gb_optimizer_host": worst["optimizer_host_bytes"] / GIB,
        "memory_gb_padding_max": worst["padding_bytes_max"] / GIB,
        "memory_gb_by_strategy": by_strategy_gb,
        "worst_pp_rank": worst["pp_rank"],
        "stages": stages,
        "bubble_fraction": (p - 1) / (v * m + p - 1),
        "flops_per_iteration": num_floating_point_operations(args, args.global_batch_size),
        "tokens_per_iteration": args.global_batch_size * args.seq_length,
        "gpu_memory_gb": args.gpu_memory_gb,
        "fits": memory_gb["total"] <= args.gpu_memory_gb,
    }


def format_plan(plan: dict) -> str:
    lay, mod = plan["layout"], plan["model"]
    rec = lay["recompute"] + (f" ({lay['recompute_method']}, {lay['recompute_num_layers']} layers)"
                              if lay["recompute"] == "full" else "")
    lines = [
        f"model   {plan['num_params_total'] / 1e9:.3f}B parameters: {mod['num_layers']} layers, hidden "
        f"{mod['hidden_size']}, {mod['num_attention_heads']} heads ({mod['num_query_groups']} query groups), "
        f"ffn {mod['ffn_hidden_size']}, vocab {mod['vocab_size']} (padded {mod['padded_vocab_size']})",
        f"layout  {lay['world_size']} GPUs = TP {lay['tp']}" + (f" x CP {lay['cp']}" if lay["cp"] > 1 else "")
        + f" x PP {lay['pp']} x DP {lay['dp']}"
        + (f", {lay['vpp']} virtual stages per rank" if lay["vpp"] > 1 else "")
        + f"; {lay['precision']}, DP sharding {lay['data_parallel_sharding_strategy']}"
        + (" + optimizer offload" if lay["optimizer_cpu_offload"] else "") + ", "
        f"sequence parallel {'on' if lay['sequence_parallel'] else 'off'}, recompute {rec}"
        + (", flash-attn" if lay["flash_attn"] else ""),
        f"batch   {lay['num_microbatches']} micro-batches of {lay['micro_batch_size']} x {lay['seq_length']} tokens "
        f"per DP rank; global batch {lay['global_batch_size']} ({plan['tokens_per_iteration'] / 1e6:.2f}M tokens)",
        "",
        f"memory per GPU, GiB (pipeline stage with the most: {plan['worst_pp_rank']}; "
        f"{plan['num_params_per_gpu'] / 1e6:.1f}M parameters on it)",
    ]
    mem = plan["memory_gb"]
    zero_note = (f"   (without ZeRO-1: {plan['memory_gb_optimizer_without_zero1']:.2f})"
                 if lay["distributed_optimizer"] else
                 f"   (with ZeRO-1 over DP {lay['dp']}" + (f" x CP {lay['cp']}" if lay["cp"] > 1 else "")
                 + f": {plan['memory_gb_optimizer_with_zero1']:.2f})")
    if lay["optimizer_cpu_offload"]:
        zero_note += f"   + {plan['memory_gb_optimizer_host']:.2f} in host memory (offloaded)"
    for key in ("params", "grads", "optimizer", "working_set", "activations"):
        if key == "working_set" and not mem[key]:
            continue
        lines.append(f"  {key.replace('_', ' '):<12}{mem[key]:9.2f}" + (zero_note if key == "optimizer" else "")
                     + ("   (gathered parameters + gradient staging, ZeRO-2/3)" if key == "working_set" else ""))
    lines.append(f"  {'total':<12}{mem['total']:9.2f}   of {plan['gpu_memory_gb']:.0f}: "
                 + ("fits" if plan["fits"] else "DOES NOT FIT")
                 + " (plus CUDA context, NCCL buffers, fragmentation: a few GiB)")
    if plan["memory_gb_padding_max"]:
        lines.append(f"  {'':<12}(plus bucket padding, at most {plan['memory_gb_padding_max'] * 2**20:.1f} KiB)")
    lines.append(f"  by DP sharding strategy over DP {lay['dp']}:  params   grads  optimizer  working set   total")
    for s, b in plan["memory_gb_by_strategy"].items():
        mark = "*" if s == lay["data_parallel_sharding_strategy"] else " "
        name = STRATEGIES[s].describe()
        lines.append(f"   {mark} {name:<30}{b['params']:8.2f}{b['grads']:8.2f}{b['optimizer']:11.2f}"
                     f"{b['working_set']:13.2f}{b['total']:8.2f}"
                     + ("" if b["total"] <= plan["gpu_memory_gb"] else "  no fit"))
    if len(plan["stages"]) > 1:
        lines.append("  by stage:   " + "  ".join(f"{st['pp_rank']}: {st['total_bytes'] / GIB:.1f}"
                                                  for st in plan["stages"]))
    lines += [
        "",
        f"pipeline bubble  {100 * plan['bubble_fraction']:.1f}% of an iteration "
        f"((p-1)/(v*m+p-1) = {lay['pp'] - 1}/({lay['vpp']}*{lay['num_microbatches']}+{lay['pp'] - 1}))",
        f"FLOPs/iteration  {plan['flops_per_iteration']:.3e} "
        f"({plan['flops_per_iteration'] / lay['world_size'] / 1e12:.1f} TFLOP per GPU; "
        f"at 400 TFLOP/s/GPU: {plan['flops_per_iteration'] / lay['world_size'] / 400e12:.2f} s/iteration)",
    ]
    return "\n".join(lines)


@cli("tools/plan.py")
def main(argv=None) -> int:
    args = parse(argv)
    plan = plan_from_args(args)
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0 if plan["fits"] else 1  # scripts can test the exit status


if __name__ == "__main__":
    sys.exit(main())
