#!/usr/bin/env bash
# GPT-3 2.7B, Brown et al. 2020 ("Language Models are Few-Shot Learners"),
# Table 2.1: 32 layers, d_model 2560, 32 heads of 80; batch 1M tokens, learning rate 1.6e-4.
# Sequence length 2048; GPT-3's schedule: 300B tokens, 375M tokens of warmup, cosine decay to
# 10% over 260B.
#
# Layout for nodes of 8 x 80 GB GPUs (bf16, ZeRO-1, selective recompute): data parallelism with
# ZeRO-1 (TP 1, PP 1), 4 nodes (DP 32). Micro-batch 4, global batch 512: 4 micro-batches per DP
# rank and iteration on 4 nodes.
#
#   bash examples/gpt3_2.7B.sh                # one node (8 GPUs)
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> bash examples/gpt3_2.7B.sh
#   sbatch --nodes 4 examples/slurm/sbatch.sh examples/gpt3_2.7B.sh
#   DRY_RUN=1 NNODES=4 bash examples/gpt3_2.7B.sh   # print the command; its flags after
#       pretrain_gpt.py, given to tools/plan.py with --world-size 32, show memory per GPU
# Every size, path and switch can be set from the environment (examples/common.sh lists them);
# flags after the script's name are passed on to pretrain_gpt.py.
set -euo pipefail

# model (Table 2.1)
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-2560}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

# batch and learning rate (1M tokens per batch)
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-512}   # sequences of SEQ_LENGTH tokens
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
LR=${LR:-1.6e-4}

# parallelism and memory
TP=${TP:-1}   # tensor parallel, within a node
PP=${PP:-1}   # pipeline stages
PRECISION=${PRECISION:-bf16}                               # bf16 | fp16 | fp32
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-1}   # ZeRO-1: optimizer state sharded over DP
RECOMPUTE=${RECOMPUTE:-selective}                          # none | selective | full

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"
