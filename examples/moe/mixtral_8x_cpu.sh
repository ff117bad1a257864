#!/usr/bin/env bash
# A Mixtral-style Mixture-of-Experts GPT, tiny, trained on the bundled corpus on CPU: 8 SwiGLU
# experts per layer, top-2 routing with the load-balancing loss, RMSNorm, RoPE, grouped-query
# attention, untied output layer (Jiang et al. 2024's architecture at 1/64 of its width). 4 gloo
# processes: DP 4, with the experts split over EP 2 (each rank holds 4 of the 8 experts of every
# layer; tokens travel to their experts by all-to-all; each expert has 2 replicas, its expert-DP
# group). The same launch path as the GPT-3 scripts (examples/common.sh). Builds the bundled data
# first when it is missing (bash data/prepare.sh, ~2 s).
#
#   bash examples/moe/mixtral_8x_cpu.sh
#   EP=4 bash examples/moe/mixtral_8x_cpu.sh                  # 2 experts per rank
#   EP=1 bash examples/moe/mixtral_8x_cpu.sh                  # every expert on every rank (plain DP)
#   DISPATCHER=allgather TRAIN_ITERS=20 bash examples/moe/mixtral_8x_cpu.sh
#   DRY_RUN=1 bash examples/moe/mixtral_8x_cpu.sh             # print the command (for tools/plan.py)
#   OUTPUT_DIR=/tmp/moe bash examples/moe/mixtral_8x_cpu.sh   # data and log under /tmp/moe
# Output: OUTPUT_DIR [runs/mixtral_8x_cpu, from the current directory] holds the run's log (and
# checkpoints, TensorBoard, W&B when asked); with OUTPUT_DIR set, the bundled data is built into
# $OUTPUT_DIR/data too (DATA_BUILD_DIR), so nothing is written into the checkout.
# Every size, path and switch can be set from the environment (examples/common.sh lists the
# shared ones; NUM_EXPERTS, TOPK, EP, DISPATCHER, MOE_FFN_HIDDEN_SIZE, NUM_QUERY_GROUPS and
# MOE_AUX_LOSS_COEFF are this script's). docs/moe.md explains the flags and the layout.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# Python, torchrun, threads and the bundled data (DATA_BUILD_DIR, built when missing)
source "$ROOT/examples/cpu_setup.sh"

# model: Mixtral 8x7B's shape (32 layers, hidden 4096, 32 heads in 8 query groups, experts of
# 14336) shrunk to 4 layers, hidden 64, 4 heads in 2 groups, experts of 224 (3.5 h, as Mixtral)
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-2}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-224}
SEQ_LENGTH=${SEQ_LENGTH:-128}

# experts: 8 per layer, top-2 (Mixtral's router: softmax over the two chosen logits), dropless
NUM_EXPERTS=${NUM_EXPERTS:-8}
TOPK=${TOPK:-2}
MOE_FFN_HIDDEN_SIZE=${MOE_FFN_HIDDEN_SIZE:-$FFN_HIDDEN_SIZE}
MOE_AUX_LOSS_COEFF=${MOE_AUX_LOSS_COEFF:-1e-2}
EP=${EP:-2}                          # expert parallelism, taken from the DP ranks
DISPATCHER=${DISPATCHER:-alltoall}   # alltoall | allgather

# training: 200 iterations of 32 sequences, cosine from 2e-3 to 2e-4 after 20 of warmup
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-32}
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-2e-3}
MIN_LR=${MIN_LR:-2e-4}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS / 10))}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}

# CPU: 4 gloo processes, fp32, no ZeRO, no recompute
GPUS_PER_NODE=${GPUS_PER_NODE:-4}   # processes

source "$ROOT/examples/common.sh"

MOE_ARGS=(
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --num-experts "$NUM_EXPERTS"
    --moe-router-topk "$TOPK"
    --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff "$MOE_AUX_LOSS_COEFF"
    --expert-model-parallel-size "$EP"
    --moe-token-dispatcher-type "$DISPATCHER"
)
launch "${MOE_ARGS[@]}" "$@"
