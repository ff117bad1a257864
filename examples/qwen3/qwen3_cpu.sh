#!/usr/bin/env bash
# A Qwen3-shaped dense GPT (Qwen3ForCausalLM), tiny, trained on the bundled corpus on CPU: QK-norm
# (--qk-layernorm: RMSNorm of each head's queries and keys before RoPE), grouped-query attention
# with a head size of its own (--kv-channels, twice hidden / heads as in Qwen3-0.6B), SwiGLU,
# RMSNorm (eps 1e-6), RoPE with base 1e6, no biases, untied output layer (Qwen3-8B's; the 0.6B to 4B
# models tie it: UNTIE=0). 2 gloo processes with TP 2 and sequence parallelism. The same launch
# path as the GPT-3 scripts (examples/common.sh). Builds the bundled data first when it is missing
# (bash data/prepare.sh, ~2 s). docs/models.md ("Qwen3") lists the flags and what converts to and
# from transformers' Qwen3ForCausalLM (tools/checkpoint/convert.py).
#
#   bash examples/qwen3/qwen3_cpu.sh
#   TP=1 bash examples/qwen3/qwen3_cpu.sh                     # DP 2
#   DRY_RUN=1 bash examples/qwen3/qwen3_cpu.sh                # print the command (for tools/plan.py)
#   OUTPUT_DIR=/tmp/qwen3 bash examples/qwen3/qwen3_cpu.sh    # data and log under /tmp/qwen3
# Every size, path and switch can be set from the environment (examples/common.sh lists the
# shared ones; NUM_QUERY_GROUPS, KV_CHANNELS, ROTARY_BASE, NORM_EPSILON and UNTIE are this script's).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# Python, torchrun, threads and the bundled data (DATA_BUILD_DIR, built when missing)
source "$ROOT/examples/cpu_setup.sh"

# model: Qwen3-0.6B's proportions (28 layers, hidden 1024, 16 heads of 128 in 8 query groups,
# MLP 3072) shrunk to 4 layers, hidden 64, 4 heads of 32 in 2 groups, MLP 192
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-2}
KV_CHANNELS=${KV_CHANNELS:-32}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-192}
ROTARY_BASE=${ROTARY_BASE:-1000000}
NORM_EPSILON=${NORM_EPSILON:-1e-6}
UNTIE=${UNTIE:-1}
SEQ_LENGTH=${SEQ_LENGTH:-128}

# training: 200 iterations of 32 sequences, cosine from 2e-3 to 2e-4 after 20 of warmup
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-32}
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-2e-3}
MIN_LR=${MIN_LR:-2e-4}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS / 10))}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.1}

# CPU: 2 gloo processes, TP 2 (sequence parallel), fp32, no ZeRO, no recompute
GPUS_PER_NODE=${GPUS_PER_NODE:-2}   # processes
TP=${TP:-2}

source "$ROOT/examples/common.sh"

QWEN3_ARGS=(
    --qk-layernorm
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --kv-channels "$KV_CHANNELS"
    --position-embedding-type rope --rotary-base "$ROTARY_BASE"
    --normalization RMSNorm --norm-epsilon "$NORM_EPSILON"
    --swiglu
    --disable-bias-linear
)
[ "$UNTIE" = 1 ] && QWEN3_ARGS+=(--untie-embeddings-and-output-weights)
launch "${QWEN3_ARGS[@]}" "$@"
