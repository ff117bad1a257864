#!/usr/bin/env python3
"""Pretrain a GPT model: one process (`python pretrain_gpt.py ...`) or many
(`torchrun --nproc_per_node N pretrain_gpt.py ...`). Flags follow Megatron-LM; see --help."""
import sys

from megalite.arguments import ArgumentError, build_run_config, parse_args, validate_args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        validate_args(args)
    except ArgumentError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    from megalite.training import pretrain
    pretrain(build_run_config(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
