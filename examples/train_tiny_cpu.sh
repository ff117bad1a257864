#!/usr/bin/env bash
# A 1M-parameter GPT trained on the bundled corpus, on CPU, with 2 gloo processes (DP 2), in
# about a minute: the same launch path as the GPT-3 scripts (examples/common.sh), small enough
# for a laptop. Builds the bundled data first when it is missing (bash data/prepare.sh, ~2 s).
#
#   bash examples/train_tiny_cpu.sh
#   TP=2 bash examples/train_tiny_cpu.sh                      # tensor parallel instead of DP
#   TRAIN_ITERS=20 OUTPUT_DIR=/tmp/tiny bash examples/train_tiny_cpu.sh   # data and log under /tmp/tiny
#   python tools/plot_metrics.py runs/train_tiny_cpu/metrics.jsonl --output tiny.png
# Output: OUTPUT_DIR [runs/train_tiny_cpu, from the current directory] holds the run's log (and
# checkpoints, TensorBoard, W&B when asked); with OUTPUT_DIR set, the bundled data is built into
# $OUTPUT_DIR/data too (DATA_BUILD_DIR), so nothing is written into the checkout.
# Every size, path and switch can be set from the environment (examples/common.sh lists them).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Python, torchrun, threads and the bundled data (DATA_BUILD_DIR, built when missing)
source "$ROOT/examples/cpu_setup.sh"

# model: 4 layers, hidden 128, 4 heads, 128 tokens
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}

# training: 200 iterations of 32 sequences, cosine from 2e-3 to 2e-4 after 20 of warmup
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-16}
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
launch "$@"
