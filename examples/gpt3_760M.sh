#!/usr/bin/env bash
# GPT-3 Large (760M parameters), Brown et al. 2020 ("Language Models are Few-Shot Learners"),
# Table 2.1: 24 layers, d_model 1536, 16 heads of 96; batch 0.5M tokens, learning rate 2.5e-4.
# Sequence length 2048; GPT-3's schedule: 300B tokens, 375M tokens of warmup, cosine decay to
# 10% over 260B.
#
# Layout for nodes of 8 x 80 GB GPUs (bf16, ZeRO-1, selective recompute): pure data parallelism
# (TP 1, PP 1, DP 8 on one node). Micro-batch 4, global batch 256: 8 micro-batches per DP rank
# and iteration on 1 node.
#
#   bash examples/gpt3_760M.sh                # one node (8 GPUs)
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0> bash examples/gpt3_760M.sh
#   sbatch --nodes 1 examples/slurm/sbatch.sh examples/gpt3_760M.sh
#   DRY_RUN=1 NNODES=1 bash examples/gpt3_760M.sh   # print the command; its flags after
#       pretrain_gpt.py, given to tools/plan.py with --world-size 8, show memory per GPU
# Every size, path and switch can be set from the environment (examples/common.sh lists them);
# flags after the script's name are passed on to pretrain_gpt.py.
set -euo pipefail

# model (Table 2.1)
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-1536}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

# batch and learning rate (0.5M tokens per batch)
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}   # sequences of SEQ_LENGTH tokens
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
LR=${LR:-2.5e-4}

# parallelism and memory
TP=${TP:-1}   # tensor parallel, within a node
PP=${PP:-1}   # pipeline stages
PRECISION=${PRECISION:-bf16}                               # bf16 | fp16 | fp32
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-1}   # ZeRO-1: optimizer state sharded over DP
RECOMPUTE=${RECOMPUTE:-selective}                          # none | selective | full

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"
