#!/usr/bin/env bash
# A DeepSeek-V3-shaped Mixture-of-Experts GPT, tiny, trained on the bundled corpus on CPU
# (DeepSeek-AI 2024's architecture at 1/112 of its width): multi-latent attention with query and
# key/value compression and QK-norm on the latents (--multi-latent-attention, docs/models.md), the
# first layer dense and the rest MoE, 8 routed SwiGLU experts with sigmoid scores, top-2 chosen
# within the best of 4 groups (node-limited routing), aux-loss-free balancing by an expert bias,
# the routing weights scaled by 2.5, one shared expert, DeepSeek-V3's small sequence-wise balance
# loss, and one multi-token-prediction module (MTP depth 1, its loss weighted 0.3; DeepSeek-V3
# Sec. 2.2). 2 gloo processes: DP 2 with the experts split over EP 2 (each rank holds 4 of the 8
# experts of every MoE layer). The same launch path as the GPT-3 scripts (examples/common.sh).
# Builds the bundled data first when it is missing (bash data/prepare.sh, ~2 s).
#
#   bash examples/deepseek_v3/deepseek_v3_cpu.sh
#   EP=1 bash examples/deepseek_v3/deepseek_v3_cpu.sh            # every expert on every rank
#   Q_LORA_RANK= bash examples/deepseek_v3/deepseek_v3_cpu.sh    # no query compression (DeepSeek-V2-Lite's)
#   MTP_NUM_LAYERS= bash examples/deepseek_v3/deepseek_v3_cpu.sh # no multi-token prediction
#   DRY_RUN=1 bash examples/deepseek_v3/deepseek_v3_cpu.sh       # print the command (for tools/plan.py)
#   OUTPUT_DIR=/tmp/ds bash examples/deepseek_v3/deepseek_v3_cpu.sh   # data and log under /tmp/ds
# Output: OUTPUT_DIR [runs/deepseek_v3_cpu, from the current directory] holds the run's log (and
# checkpoints, TensorBoard, W&B when asked); with OUTPUT_DIR set, the bundled data is built into
# $OUTPUT_DIR/data too (DATA_BUILD_DIR), so nothing is written into the checkout.
# Every size, path and switch can be set from the environment (examples/common.sh lists the
# shared ones; the MLA ranks and head sizes, NUM_EXPERTS, TOPK, ROUTER_GROUPS, GROUP_TOPK, EP,
# MOE_FFN_HIDDEN_SIZE, SHARED_EXPERT_SIZE, MTP_NUM_LAYERS and MTP_LOSS_SCALING_FACTOR are this
# script's). Its checkpoints convert to Hugging Face's DeepseekV3ForCausalLM with
# tools/checkpoint/convert.py (--saver hf), the MTP modules as DeepSeek-V3 stores them
# (model.layers.{num_layers + k}.*, num_nextn_predict_layers; docs/models.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# Python, torchrun, threads and the bundled data (DATA_BUILD_DIR, built when missing)
source "$ROOT/examples/cpu_setup.sh"

# model: DeepSeek-V3's shape (61 layers, hidden 7168, 128 heads; q_lora_rank 1536, kv_lora_rank
# 512, head sizes 128 + 64 RoPE, values 128; the first 3 layers dense) shrunk to 4 layers, hidden
# 64, 4 heads, ranks 48 and 32, head sizes 16 + 8 RoPE, values 16; the first layer dense
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-176}
SEQ_LENGTH=${SEQ_LENGTH:-128}
Q_LORA_RANK=${Q_LORA_RANK-48}        # empty: no query compression
KV_LORA_RANK=${KV_LORA_RANK:-32}
QK_HEAD_DIM=${QK_HEAD_DIM:-16}
QK_POS_EMB_HEAD_DIM=${QK_POS_EMB_HEAD_DIM:-8}
V_HEAD_DIM=${V_HEAD_DIM:-16}
ROPE_TYPE=${ROPE_TYPE:-rope}         # rope | yarn (with --rotary-scaling-factor and the --yarn-* flags)

# multi-token prediction: DeepSeek-V3's depth 1, its loss weighted 0.3 (0.1 for its last 4.8T tokens);
# empty: none
MTP_NUM_LAYERS=${MTP_NUM_LAYERS-1}
MTP_LOSS_SCALING_FACTOR=${MTP_LOSS_SCALING_FACTOR:-0.3}

# experts: 8 routed (DeepSeek-V3: 256) of 32 each, top-2 (8) within the best 1 (4) of 4 (8) groups,
# sigmoid scores, expert bias, weights x 2.5, one shared expert; layer 0 dense
NUM_EXPERTS=${NUM_EXPERTS:-8}
TOPK=${TOPK:-2}
ROUTER_GROUPS=${ROUTER_GROUPS:-4}
GROUP_TOPK=${GROUP_TOPK:-1}
MOE_FFN_HIDDEN_SIZE=${MOE_FFN_HIDDEN_SIZE:-32}
SHARED_EXPERT_SIZE=${SHARED_EXPERT_SIZE:-32}
MOE_LAYER_FREQ=${MOE_LAYER_FREQ:-[0]+[1]*3}
EP=${EP:-2}                          # expert parallelism, taken from the DP ranks

# training: 200 iterations of 32 sequences, cosine from 2e-3 to 2e-4 after 20 of warmup
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-32}
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-2e-3}
MIN_LR=${MIN_LR:-2e-4}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS / 10))}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}

# CPU: 2 gloo processes, fp32, no ZeRO, no recompute
GPUS_PER_NODE=${GPUS_PER_NODE:-2}   # processes

source "$ROOT/examples/common.sh"

Q_ARGS=()
if [ -n "$Q_LORA_RANK" ]; then Q_ARGS=(--q-lora-rank "$Q_LORA_RANK"); fi
MTP_ARGS=()
if [ -n "$MTP_NUM_LAYERS" ]; then
    MTP_ARGS=(--mtp-num-layers "$MTP_NUM_LAYERS" --mtp-loss-scaling-factor "$MTP_LOSS_SCALING_FACTOR")
fi
DEEPSEEK_ARGS=(
    --position-embedding-type rope
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --multi-latent-attention
    "${Q_ARGS[@]}"
    --kv-lora-rank "$KV_LORA_RANK"
    --qk-head-dim "$QK_HEAD_DIM"
    --qk-pos-emb-head-dim "$QK_POS_EMB_HEAD_DIM"
    --v-head-dim "$V_HEAD_DIM"
    --rope-type "$ROPE_TYPE"
    --qk-layernorm
    "${MTP_ARGS[@]}"
    --num-experts "$NUM_EXPERTS"
    --moe-router-topk "$TOPK"
    --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-layer-freq "$MOE_LAYER_FREQ"
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-num-groups "$ROUTER_GROUPS"
    --moe-router-group-topk "$GROUP_TOPK"
    --moe-router-topk-scaling-factor 2.5
    --moe-shared-expert-intermediate-size "$SHARED_EXPERT_SIZE"
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --expert-model-parallel-size "$EP"
    --moe-token-dispatcher-type alltoall
)
launch "${DEEPSEEK_ARGS[@]}" "$@"
