#!/usr/bin/env bash
# GPT-3 6.7B, Brown et al. 2020 ("Language Models are Few-Shot Learners"),
# Table 2.1: 32 layers, d_model 4096, 32 heads of 128; batch 2M tokens, learning rate 1.2e-4.
# Sequence length 2048; GPT-3's schedule: 300B tokens, 375M tokens of warmup, cosine decay to
# 10% over 260B.
#
# Layout for nodes of 8 x 80 GB GPUs (bf16, ZeRO-1, selective recompute): TP 2 with sequence
# parallelism inside a node, ZeRO-1 over DP, 8 nodes (DP 32). Micro-batch 4, global batch 1024:
# 8 micro-batches per DP rank and iteration on 8 nodes.
#
#   bash examples/gpt3_6.7B.sh                # one node (8 GPUs)
#   NNODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> bash examples/gpt3_6.7B.sh
#   sbatch --nodes 8 examples/slurm/sbatch.sh examples/gpt3_6.7B.sh
#   DRY_RUN=1 NNODES=8 bash examples/gpt3_6.7B.sh   # print the command; its flags after
#       pretrain_gpt.py, given to tools/plan.py with --world-size 64, show memory per GPU
# Every size, path and switch can be set from the environment (examples/common.sh lists them);
# flags after the script's name are passed on to pretrain_gpt.py.
set -euo pipefail

# model (Table 2.1)
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

# batch and learning rate (2M tokens per batch)
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1024}   # sequences of SEQ_LENGTH tokens
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
LR=${LR:-1.2e-4}

# parallelism and memory
TP=${TP:-2}   # tensor parallel, within a node; sequence parallel follows (SEQUENCE_PARALLEL=auto)
PP=${PP:-1}   # pipeline stages
PRECISION=${PRECISION:-bf16}                               # bf16 | fp16 | fp32
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-1}   # ZeRO-1: optimizer state sharded over DP
RECOMPUTE=${RECOMPUTE:-selective}                          # none | selective | full

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"
