#!/usr/bin/env python3
"""Pretrain a GPT model: one process (`python pretrain_gpt.py ...`) or many
(`torchrun --nproc_per_node N pretrain_gpt.py ...`). Flags follow Megatron-LM; see --help."""
import sys

from megalite.training import main

if __name__ == "__main__":
    sys.exit(main())
