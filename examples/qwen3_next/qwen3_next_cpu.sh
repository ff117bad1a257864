#!/usr/bin/env bash
# A Qwen3-Next-shaped hybrid GPT, tiny, trained on the bundled corpus on CPU: three of every four
# layers gated DeltaNet (linear attention with a delta-rule state, a causal short convolution and an
# output gate; --experimental-attention-variant gated_delta_net, --linear-attention-freq 4 as
# Megatron-LM counts it), the fourth gated softmax attention (--attention-output-gate, QK-norm, GQA,
# RoPE on a quarter of each head), zero-centred RMSNorms, and MoE MLPs (8 experts top-2, a gated
# shared expert; Qwen3-Next: 512 experts top-10). 2 gloo processes: TP 2 with sequence parallelism
# (the DeltaNet key heads, the attention heads and the experts' width split over TP).
# docs/models.md ("Gated DeltaNet hybrids"). Builds the bundled data first when it is missing.
#
#   bash examples/qwen3_next/qwen3_next_cpu.sh
#   DRY_RUN=1 bash examples/qwen3_next/qwen3_next_cpu.sh          # print the command (for tools/plan.py)
#   MOE_LAYER_FREQ='[1]*8' bash examples/qwen3_next/qwen3_next_cpu.sh   # (the default: every layer MoE)
#   MTP_NUM_LAYERS=1 bash examples/qwen3_next/qwen3_next_cpu.sh   # with Qwen3-Next's MTP module (a gated
#                                                                  # softmax-attention layer; exports as mtp.*)
# Its checkpoints convert to Hugging Face's Qwen3NextForCausalLM with tools/checkpoint/convert.py
# (--saver hf; --hf-architecture qwen3_5_moe_text for Qwen3_5MoeForCausalLM, examples/qwen3_next/
# qwen3_5_moe_cpu.sh). Every size can be set from the environment (examples/common.sh lists the shared ones).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$ROOT/examples/cpu_setup.sh"

# model: Qwen3-Next-80B-A3B's shape (48 layers, hidden 2048, 16 heads of 256 in 2 groups, DeltaNet
# 16 key heads and 32 value heads of 128) shrunk to 8 layers, hidden 64, 4 heads of 16 in 2 groups,
# DeltaNet 2 key heads and 4 value heads of 16
NUM_LAYERS=${NUM_LAYERS:-8}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-128}
SEQ_LENGTH=${SEQ_LENGTH:-128}
LINEAR_ATTENTION_FREQ=${LINEAR_ATTENTION_FREQ:-4}
NUM_EXPERTS=${NUM_EXPERTS:-8}
MOE_LAYER_FREQ=${MOE_LAYER_FREQ:-1}
TP=${TP:-2}
MTP_NUM_LAYERS=${MTP_NUM_LAYERS:-}   # empty: no multi-token prediction

MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-2e-3}
MIN_LR=${MIN_LR:-2e-4}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS / 10))}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}   # processes
source "$ROOT/examples/common.sh"

MOE_ARGS=()
if [ "$NUM_EXPERTS" != "0" ]; then
    MOE_ARGS=(--num-experts "$NUM_EXPERTS" --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq "$MOE_LAYER_FREQ"
              --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-aux-loss-coeff 1e-3)
fi
MTP_ARGS=()
if [ -n "$MTP_NUM_LAYERS" ]; then
    MTP_ARGS=(--mtp-num-layers "$MTP_NUM_LAYERS")
fi
QWEN3_NEXT_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --position-embedding-type rope --rotary-percent 0.25 --rotary-base 10000
    --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --group-query-attention --num-query-groups 2 --kv-channels 16 --qk-layernorm --attention-output-gate
    --experimental-attention-variant gated_delta_net --linear-attention-freq "$LINEAR_ATTENTION_FREQ"
    --linear-conv-kernel-dim 4 --linear-key-head-dim 16 --linear-value-head-dim 16
    --linear-num-key-heads 2 --linear-num-value-heads 4
    "${MOE_ARGS[@]}" "${MTP_ARGS[@]}"
)
launch "${QWEN3_NEXT_ARGS[@]}" "$@"
