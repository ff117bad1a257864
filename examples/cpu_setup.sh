# Shared start of the CPU example scripts (train_tiny_cpu.sh, moe/, qwen3/, deepseek_v3/):
# sourced after the script sets ROOT (the checkout), never run by itself.
#
# It picks the Python (PYTHON [the checkout's .venv, else python3]) and the launcher (TORCHRUN
# [$PYTHON -m torch.distributed.run]), one thread per rank (OMP_NUM_THREADS [1]), and the data:
# the bundled corpus and its SentencePiece tokenizer, built into DATA_BUILD_DIR [with OUTPUT_DIR
# set: $OUTPUT_DIR/data, so that the run writes nothing outside OUTPUT_DIR; else the checkout's
# data/build] when missing (not with DRY_RUN=1). DATA_PATH, TOKENIZER_TYPE, TOKENIZER_MODEL,
# SPLIT [98,2,0] and NUM_WORKERS [0] may be set from the environment instead.
#
# Then the CPU runs' defaults (examples/common.sh's knobs): gloo, fp32, no ZeRO, no overlap, no
# recompute, no dropout; output JSONL only unless asked (TENSORBOARD_DIR=..., WANDB_PROJECT=...,
# CHECKPOINT_PATH=...), a log line every 10 iterations, 5 validation batches every 100. The script
# sets its own process count (GPUS_PER_NODE), sizes and schedule.

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TORCHRUN=${TORCHRUN:-$PYTHON -m torch.distributed.run}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ -n "${OUTPUT_DIR:-}" ]; then DATA_BUILD_DIR=${DATA_BUILD_DIR:-$OUTPUT_DIR/data}; fi
DATA_BUILD_DIR=${DATA_BUILD_DIR:-$ROOT/data/build}
DATA_PATH=${DATA_PATH:-$DATA_BUILD_DIR/corpus_text_document}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$DATA_BUILD_DIR/tokenizer.model}
SPLIT=${SPLIT:-98,2,0}
NUM_WORKERS=${NUM_WORKERS:-0}
if [ "$DATA_PATH" = "$DATA_BUILD_DIR/corpus_text_document" ] && [ ! -f "$DATA_PATH.idx" ] &&
    [ "${DRY_RUN:-0}" != 1 ]; then
    DATA_BUILD_DIR="$DATA_BUILD_DIR" PYTHON="$PYTHON" bash "$ROOT/data/prepare.sh"
fi

HIDDEN_DROPOUT=${HIDDEN_DROPOUT:-0}
ATTENTION_DROPOUT=${ATTENTION_DROPOUT:-0}
DISTRIBUTED_BACKEND=${DISTRIBUTED_BACKEND:-gloo}
PRECISION=${PRECISION:-fp32}
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-0}
OVERLAP_COMM=${OVERLAP_COMM:-0}
RECOMPUTE=${RECOMPUTE:-none}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-5}
