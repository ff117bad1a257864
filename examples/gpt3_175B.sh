#!/usr/bin/env bash
# GPT-3 175B, Brown et al. 2020 ("Language Models are Few-Shot Learners"),
# Table 2.1: 96 layers, d_model 12288, 96 heads of 128; batch 3.2M tokens, learning rate 0.6e-4.
# Sequence length 2048; GPT-3's schedule: 300B tokens, 375M tokens of warmup, cosine decay to
# 10% over 260B.
#
# Layout for nodes of 8 x 80 GB GPUs (bf16, ZeRO-1, selective recompute): TP 8 (a whole node)
# with sequence parallelism, PP 16 (6 layers per stage), ZeRO-1 over DP, 128 nodes = 1024 GPUs
# (DP 8; Narayanan et al. 2021 trained it on 1536 GPUs, DP 12).
# NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE=3 interleaves 2 chunks per rank: bubble 7.2% -> 3.8%.
# Micro-batch 1, global batch 1536: 192 micro-batches per DP rank and iteration on 128 nodes.
#
#   bash examples/gpt3_175B.sh                # needs 128 GPUs at least: not one node
#   NNODES=128 NODE_RANK=<0..127> MASTER_ADDR=<node 0> bash examples/gpt3_175B.sh
#   sbatch --nodes 128 examples/slurm/sbatch.sh examples/gpt3_175B.sh
#   DRY_RUN=1 NNODES=128 bash examples/gpt3_175B.sh   # print the command; its flags after
#       pretrain_gpt.py, given to tools/plan.py with --world-size 1024, show memory per GPU
# Every size, path and switch can be set from the environment (examples/common.sh lists them);
# flags after the script's name are passed on to pretrain_gpt.py.
set -euo pipefail

# model (Table 2.1)
NUM_LAYERS=${NUM_LAYERS:-96}
HIDDEN_SIZE=${HIDDEN_SIZE:-12288}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-96}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

# batch and learning rate (3.2M tokens per batch)
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1536}   # sequences of SEQ_LENGTH tokens
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
LR=${LR:-0.6e-4}

# parallelism and memory
TP=${TP:-8}   # tensor parallel, within a node; sequence parallel follows (SEQUENCE_PARALLEL=auto)
PP=${PP:-16}   # pipeline stages
PRECISION=${PRECISION:-bf16}                               # bf16 | fp16 | fp32
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-1}   # ZeRO-1: optimizer state sharded over DP
RECOMPUTE=${RECOMPUTE:-selective}                          # none | selective | full

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"
