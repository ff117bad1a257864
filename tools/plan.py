#!/usr/bin/env python3
"""Plan a parallel layout before renting the GPUs: per-GPU memory, pipeline bubble, FLOPs.

Takes pretrain_gpt.py's own flags (model, parallelism, batch, precision, recompute) plus the
number of GPUs, and prints what each GPU would hold:

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --micro-batch-size 1 --global-batch-size 1536 --bf16 \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel \\
        --recompute-activations --use-distributed-optimizer --world-size 1024 [--json]

or, for a launch script in examples/: `DRY_RUN=1 bash examples/gpt3_175B.sh` prints the command.

The accounting (what each category counts, and the activation formula) is in
megalite/planning/memory.py; docs/planning.md shows it at work.

Exit status: 0 when the layout fits --gpu-memory-gb, 1 when it does not, 2 for bad flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import build_parser, configs_from_namespace, validate  # noqa: E402
from megalite.config import DEFAULT_SPLIT  # noqa: E402
from megalite.errors import cli  # noqa: E402
from megalite.model import pad_vocab_size  # noqa: E402
from megalite.planning import report  # noqa: E402

GPT2_VOCAB = 50257
PLAN_OPTIONS = ("world_size", "gpu_memory_gb", "json", "verify")


def build_plan_parser():
    p = build_parser("tools/plan.py")
    p.description = "Per-GPU memory, pipeline bubble and FLOPs of a pretrain_gpt.py layout (no GPU needed)."
    g = p.add_argument_group("plan (this tool's own flags)")
    g.add_argument("--world-size", type=int, help="number of GPUs (default: TP x PP x CP, i.e. DP = 1)")
    g.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU, GiB")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    g.add_argument("--verify", action="store_true",
                   help="also build and step the first and the last pipeline stage's rank on the meta device "
                        "(pretrain_gpt.py --fake-process-group --dry-run, in this process) and print the plan's "
                        "bytes beside the measured ones, category by category (with --json: a \"verify\" list)")
    return p


def _vocab_size(c) -> int:
    """--vocab-size, else the tokenizer's when its files are at hand, else GPT-2's 50257."""
    if c.tokenizer.vocab_size:
        return c.tokenizer.vocab_size
    if c.tokenizer.tokenizer_type and c.tokenizer.tokenizer_type != "NullTokenizer":
        try:
            from megalite.data.tokenizers import build_tokenizer
            return build_tokenizer(c.tokenizer).vocab_size
        except Exception:  # files not on this machine: fall through to the usual GPT-2 size
            pass
    return GPT2_VOCAB


def parse(argv=None):
    """pretrain_gpt.py's flags -> (the validated RunConfig the trainer would run, the plan's own
    options). Flags that only matter at run time (iterations, learning rate, data) get placeholders."""
    ns = build_plan_parser().parse_args(argv)
    options = argparse.Namespace(**{k: getattr(ns, k) for k in PLAN_OPTIONS})
    for k in PLAN_OPTIONS:
        delattr(ns, k)
    c = configs_from_namespace(ns)
    placeholders = {"training.micro_batch_size": 1, "training.train_iters": 1, "optimizer.lr": 1e-4}
    for key, value in placeholders.items():
        section, name = key.split(".")
        if key not in c.explicit:
            setattr(getattr(c, section), name, value)
    c.optimizer.min_lr = min(c.optimizer.min_lr, c.optimizer.lr)
    c.tokenizer.vocab_size = _vocab_size(c)
    d = c.data
    if not any([d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path]):
        # planned on mock data: the flags about documents and dataset files change nothing here
        d.mock_data, d.split, d.data_cache_path = True, DEFAULT_SPLIT, None
        d.eod_mask_loss = d.reset_position_ids = d.reset_attention_mask = False
    # conditions of the machine that runs the job, not of the layout
    flash_attn, c.kernels.use_flash_attn = c.kernels.use_flash_attn, False
    c.parallel.distributed_backend = None
    c.tracking = type(c.tracking)()
    # (given: megalite's smaller gloo buckets are this CPU's, not the planned machine's)
    c = dataclasses.replace(c, explicit=c.explicit | set(placeholders) | {"ddp.ddp_bucket_size"})
    p = c.parallel
    world = options.world_size or (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                   * p.context_parallel_size)
    c = validate(c, world, check_files=False)  # the files are on the machine that will run it
    c.kernels.use_flash_attn = flash_attn
    vocab = c.tokenizer.vocab_size
    c.model = dataclasses.replace(c.model, vocab_size=vocab, padded_vocab_size=pad_vocab_size(
        vocab, c.model.make_vocab_size_divisible_by, c.parallel.tensor_model_parallel_size))
    return c, options


def make_plan(argv=None) -> dict:
    """The plan (the --json object) for pretrain_gpt.py-style flags `argv`."""
    config, options = parse(argv)
    return report.make_plan(config, options.gpu_memory_gb)


def verify(config, plan: dict) -> list[dict]:
    """Dry runs of rank (TP 0, DP 0, CP 0) of the first and the last pipeline stage (the word
    embedding's and the output layer's), each beside the plan's stage."""
    from megalite.dry_run import dry_run
    from megalite.parallel_state import RankGrid
    p = config.parallel
    config = dataclasses.replace(config, parallel=dataclasses.replace(p, fake_process_group=True))
    grid = RankGrid(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.rank_order,
                    p.context_parallel_size)
    rows = []
    for stage in sorted({0, p.pipeline_model_parallel_size - 1}):
        measured = dry_run(config, grid.rank_of(tp=0, pp=stage, dp=0, cp=0))
        planned = plan["stages"][stage]
        rows.append({"rank": measured.rank, "pp_rank": stage, "measured": dataclasses.asdict(measured),
                     "planned": {k: planned[field] for k, field in VERIFIED.items()}})
    return rows


# the dry run's field -> the plan's: activations are what forward keeps (full recompute's rebuilt
# layers come later, in backward); the working set is what DataParallel allocates during the step
VERIFIED = {"param_bytes": "param_bytes", "grad_bytes": "grad_bytes", "optimizer_bytes": "optimizer_bytes",
            "activation_bytes": "held_activation_bytes", "zero_working_set_bytes": "working_set_bytes"}


def format_verify(rows: list[dict]) -> str:
    lines = ["", "verify  the plan beside a dry run (meta device, fake process group) of each rank, MiB"]
    for row in rows:
        m = row["measured"]
        lines.append(f"  rank {row['rank']} (pipeline stage {row['pp_rank']}): built in {m['build_seconds']:.1f} s, "
                     f"one iteration of {m['num_microbatches']} micro-batches in {m['step_seconds']:.1f} s")
        for key in VERIFIED:
            plan_b, got = row["planned"][key], m[key]
            diff = f"{100 * (got - plan_b) / plan_b:+.1f}%" if plan_b else "-"
            lines.append(f"    {key.removesuffix('_bytes').replace('zero_working_set', 'ZeRO working'):<12} plan "
                         f"{plan_b / 2**20:12.1f}  measured "
                         f"{got / 2**20:12.1f}  {'exact' if got == plan_b else diff}")
    return "\n".join(lines)


@cli("tools/plan.py")
def main(argv=None) -> int:
    config, options = parse(argv)
    plan = report.make_plan(config, options.gpu_memory_gb)
    rows = verify(config, plan) if options.verify else None
    if options.json:
        print(json.dumps(plan if rows is None else {**plan, "verify": rows}, indent=1))
    else:
        print(report.format_plan(plan) + (format_verify(rows) if rows is not None else ""))
    return 0 if plan["fits"] else 1  # scripts can test the exit status


if __name__ == "__main__":
    sys.exit(main())
