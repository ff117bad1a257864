#!/usr/bin/env bash
# A Qwen3-MoE-shaped GPT (Qwen3MoeForCausalLM), tiny, trained on the bundled corpus on CPU: Qwen3's
# attention (--qk-layernorm, grouped-query attention with its own head size, RoPE base 1e6,
# RMSNorm eps 1e-6, no biases, untied output layer) and an MoE MLP in every layer: 8 SwiGLU
# experts, top-2 with the probabilities renormalised over the chosen experts (norm_topk_prob:
# true, Megatron-LM's softmax after the top-k; NORM_TOPK_PROB=0 gives --moe-router-pre-softmax), the
# load-balancing loss with coefficient 1e-3 (router_aux_loss_coef), routing in fp32, no shared
# expert. 2 gloo processes: DP 2 with the experts split over EP 2 (all-to-all dispatch). The same
# launch path as the GPT-3 scripts (examples/common.sh). docs/models.md ("Qwen3-MoE") lists the
# flags and what converts to and from transformers' Qwen3MoeForCausalLM.
#
#   bash examples/qwen3/qwen3_moe_cpu.sh
#   EP=1 bash examples/qwen3/qwen3_moe_cpu.sh                     # every expert on every rank
#   DRY_RUN=1 bash examples/qwen3/qwen3_moe_cpu.sh                # print the command (for tools/plan.py)
#   OUTPUT_DIR=/tmp/qwen3moe bash examples/qwen3/qwen3_moe_cpu.sh # data and log under /tmp/qwen3moe
# Every size, path and switch can be set from the environment (examples/common.sh lists the
# shared ones; NUM_QUERY_GROUPS, KV_CHANNELS, ROTARY_BASE, NORM_EPSILON, NUM_EXPERTS, TOPK,
# MOE_FFN_HIDDEN_SIZE, MOE_AUX_LOSS_COEFF, NORM_TOPK_PROB, EP and DISPATCHER are this script's).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# Python, torchrun, threads and the bundled data (DATA_BUILD_DIR, built when missing)
source "$ROOT/examples/cpu_setup.sh"

# model: Qwen3-30B-A3B's (48 layers, hidden 2048, 32 heads of 128 in 4 query groups, 128 experts
# of 768, top-8) shrunk to 4 layers, hidden 64, 4 heads of 32 in 2 groups, 8 experts of 24, top-2
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-2}
KV_CHANNELS=${KV_CHANNELS:-32}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-192}
ROTARY_BASE=${ROTARY_BASE:-1000000}
NORM_EPSILON=${NORM_EPSILON:-1e-6}
NUM_EXPERTS=${NUM_EXPERTS:-8}
TOPK=${TOPK:-2}
MOE_FFN_HIDDEN_SIZE=${MOE_FFN_HIDDEN_SIZE:-24}
MOE_AUX_LOSS_COEFF=${MOE_AUX_LOSS_COEFF:-1e-3}
NORM_TOPK_PROB=${NORM_TOPK_PROB:-1}
EP=${EP:-2}                          # expert parallelism, taken from the DP ranks
DISPATCHER=${DISPATCHER:-alltoall}   # alltoall | allgather
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

# CPU: 2 gloo processes (DP 2, EP 2), fp32, no ZeRO, no recompute
GPUS_PER_NODE=${GPUS_PER_NODE:-2}   # processes

source "$ROOT/examples/common.sh"

QWEN3_ARGS=(
    --qk-layernorm
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --kv-channels "$KV_CHANNELS"
    --position-embedding-type rope --rotary-base "$ROTARY_BASE"
    --normalization RMSNorm --norm-epsilon "$NORM_EPSILON"
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --num-experts "$NUM_EXPERTS"
    --moe-router-topk "$TOPK"
    --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff "$MOE_AUX_LOSS_COEFF"
    --moe-router-dtype fp32
    --expert-model-parallel-size "$EP"
    --moe-token-dispatcher-type "$DISPATCHER"
)
[ "$NORM_TOPK_PROB" = 1 ] || QWEN3_ARGS+=(--moe-router-pre-softmax)
launch "${QWEN3_ARGS[@]}" "$@"
