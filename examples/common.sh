# Shared part of the launch scripts in examples/: sourced, never run by itself.
#
# A size script (gpt3_125M.sh ... gpt3_175B.sh, train_tiny_cpu.sh) sets its defaults, each one
# overridable from the environment (NUM_LAYERS=${NUM_LAYERS:-24}), then sources this file, which
# fills in everything else the same way, builds Megatron-style argument arrays
#     DISTRIBUTED_ARGS  MODEL_ARGS  MODEL_PARALLEL_ARGS  TRAINING_ARGS  DATA_ARGS  OUTPUT_ARGS
# and defines `launch`, which runs
#     torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py <the arrays> "$@"
# Flags after the script's name are passed on to pretrain_gpt.py and win over the arrays.
#
# Where it runs (all from the environment):
#   one node            bash examples/gpt3_1.3B.sh                   (torchrun --standalone)
#   several nodes       on every node: NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0's address> \
#                           bash examples/gpt3_13B.sh
#   SLURM               sbatch --nodes 4 examples/slurm/sbatch.sh examples/gpt3_13B.sh
#   print, do not run   DRY_RUN=1 bash examples/gpt3_175B.sh   (feed the flags to tools/plan.py)
#
# Knobs (defaults in brackets; a size script may change the default):
#   cluster    GPUS_PER_NODE [8] NNODES [1] NODE_RANK [0] MASTER_ADDR MASTER_PORT [6000]
#              TORCHRUN [torchrun] DISTRIBUTED_BACKEND [nccl with CUDA, else gloo]
#              MAX_RESTARTS [0] (torchrun --max-restarts: a failed worker group is restarted and
#              resumes from the latest checkpoint; needs CHECKPOINT_PATH)
#   parallel   TP [1] PP [1] NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE [unset: no interleaving]
#              SEQUENCE_PARALLEL [auto: on when TP > 1]
#   memory     PRECISION [bf16] (bf16|fp16|fp32)  USE_DISTRIBUTED_OPTIMIZER [1]  OVERLAP_COMM [1]
#              RECOMPUTE [selective] (none|selective|full)  RECOMPUTE_METHOD [uniform]
#              RECOMPUTE_NUM_LAYERS [1]  USE_FLASH_ATTN [0]
#   model      NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS FFN_HIDDEN_SIZE [4h] SEQ_LENGTH [2048]
#              MAX_POSITION_EMBEDDINGS [SEQ_LENGTH] HIDDEN_DROPOUT [0.1] ATTENTION_DROPOUT [0.1]
#              INIT_METHOD_STD [0.02]
#   training   MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE LR MIN_LR [LR/10] TRAIN_TOKENS [300e9]
#              TRAIN_ITERS [TRAIN_TOKENS / tokens per iteration] LR_DECAY_ITERS [260/300 of it]
#              LR_WARMUP_ITERS [375M tokens' worth, at most LR_DECAY_ITERS] LR_DECAY_STYLE [cosine]
#              WEIGHT_DECAY [0.1] CLIP_GRAD [1.0] SEED [1234]  (GPT-3 paper, Sec. 2.3 / App. B)
#   data       DATA_PATH (prefix, several, or "w1 p1 w2 p2"; unset: mock data) SPLIT [969,30,1]
#              TOKENIZER_TYPE [GPT2BPETokenizer] VOCAB_FILE MERGE_FILE TOKENIZER_MODEL
#              VOCAB_SIZE [50257 with mock data] DATA_CACHE_PATH NUM_WORKERS [2]
#   output     RUN_NAME [script name] OUTPUT_DIR [runs/$RUN_NAME, from the current directory: every
#              output below goes there unless set apart] LOG_JSONL [$OUTPUT_DIR/metrics.jsonl]
#              TENSORBOARD_DIR [$OUTPUT_DIR/tensorboard; empty: off] WANDB_PROJECT [unset: off]
#              WANDB_EXP_NAME [$RUN_NAME] WANDB_SAVE_DIR [$OUTPUT_DIR] WANDB_ENTITY
#              LOG_INTERVAL [10] EVAL_INTERVAL [1000] EVAL_ITERS [10]
#              CHECKPOINT_PATH [$OUTPUT_DIR/checkpoints; empty: off] (--save and --load: a rerun
#              resumes from the latest checkpoint) SAVE_INTERVAL [1000]

EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MEGALITE_ROOT=${MEGALITE_ROOT:-$(cd "$EXAMPLES_DIR/.." && pwd)}
SCRIPT_NAME=$(basename "${0%.sh}")

_fail() { echo "$SCRIPT_NAME: $*" >&2; exit 2; }

# ---- cluster ----------------------------------------------------------------------------------
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-6000}
TORCHRUN=${TORCHRUN:-torchrun}
MAX_RESTARTS=${MAX_RESTARTS:-0}
DISTRIBUTED_BACKEND=${DISTRIBUTED_BACKEND:-}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

# ---- parallelism and memory -------------------------------------------------------------------
TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE=${NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE:-}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-auto}
PRECISION=${PRECISION:-bf16}
USE_DISTRIBUTED_OPTIMIZER=${USE_DISTRIBUTED_OPTIMIZER:-1}
OVERLAP_COMM=${OVERLAP_COMM:-1}
RECOMPUTE=${RECOMPUTE:-selective}
RECOMPUTE_METHOD=${RECOMPUTE_METHOD:-uniform}
RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS:-1}
USE_FLASH_ATTN=${USE_FLASH_ATTN:-0}

# ---- model ------------------------------------------------------------------------------------
: "${NUM_LAYERS:?the size script sets NUM_LAYERS}" "${HIDDEN_SIZE:?}" "${NUM_ATTENTION_HEADS:?}"
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-$((4 * HIDDEN_SIZE))}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-$SEQ_LENGTH}
HIDDEN_DROPOUT=${HIDDEN_DROPOUT:-0.1}
ATTENTION_DROPOUT=${ATTENTION_DROPOUT:-0.1}
INIT_METHOD_STD=${INIT_METHOD_STD:-0.02}

# ---- training: GPT-3's schedule in tokens (300B trained, cosine to 10% over 260B, 375M warmup) --
: "${MICRO_BATCH_SIZE:?}" "${GLOBAL_BATCH_SIZE:?}" "${LR:?}"
MIN_LR=${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%.3g", lr / 10 }')}
TOKENS_PER_ITER=$((GLOBAL_BATCH_SIZE * SEQ_LENGTH))
TRAIN_TOKENS=${TRAIN_TOKENS:-300000000000}
TRAIN_ITERS=${TRAIN_ITERS:-$((TRAIN_TOKENS / TOKENS_PER_ITER))}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$((TRAIN_ITERS * 260 / 300 > 0 ? TRAIN_ITERS * 260 / 300 : 1))}
_warmup=$(((375000000 + TOKENS_PER_ITER - 1) / TOKENS_PER_ITER))
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((_warmup < LR_DECAY_ITERS ? _warmup : LR_DECAY_ITERS))}
LR_DECAY_STYLE=${LR_DECAY_STYLE:-cosine}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.1}
CLIP_GRAD=${CLIP_GRAD:-1.0}
SEED=${SEED:-1234}

# ---- data -------------------------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-}
SPLIT=${SPLIT:-969,30,1}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_SIZE=${VOCAB_SIZE:-}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-}
NUM_WORKERS=${NUM_WORKERS:-2}

# ---- output -----------------------------------------------------------------------------------
RUN_NAME=${RUN_NAME:-$SCRIPT_NAME}
OUTPUT_DIR=${OUTPUT_DIR:-runs/$RUN_NAME}
LOG_JSONL=${LOG_JSONL:-$OUTPUT_DIR/metrics.jsonl}
TENSORBOARD_DIR=${TENSORBOARD_DIR-$OUTPUT_DIR/tensorboard}
WANDB_PROJECT=${WANDB_PROJECT:-}
WANDB_EXP_NAME=${WANDB_EXP_NAME:-$RUN_NAME}
WANDB_SAVE_DIR=${WANDB_SAVE_DIR:-$OUTPUT_DIR}
WANDB_ENTITY=${WANDB_ENTITY:-}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
CHECKPOINT_PATH=${CHECKPOINT_PATH-$OUTPUT_DIR/checkpoints}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

# ---- the argument arrays ----------------------------------------------------------------------
if [ "$NNODES" -gt 1 ]; then
    [ -n "$MASTER_ADDR" ] || _fail "NNODES=$NNODES needs MASTER_ADDR (the address of the node with NODE_RANK=0)"
    DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                      --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
    DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
fi
if [ "$MAX_RESTARTS" != 0 ]; then
    [ -n "$CHECKPOINT_PATH" ] || _fail "MAX_RESTARTS=$MAX_RESTARTS needs CHECKPOINT_PATH: a restart resumes from a checkpoint"
    DISTRIBUTED_ARGS+=(--max-restarts "$MAX_RESTARTS")
fi

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS"
    --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$MAX_POSITION_EMBEDDINGS"
    --hidden-dropout "$HIDDEN_DROPOUT"
    --attention-dropout "$ATTENTION_DROPOUT"
    --init-method-std "$INIT_METHOD_STD"
)
[ "$USE_FLASH_ATTN" = 1 ] && MODEL_ARGS+=(--use-flash-attn)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)
[ -n "$NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE" ] &&
    MODEL_PARALLEL_ARGS+=(--num-layers-per-virtual-pipeline-stage "$NUM_LAYERS_PER_VIRTUAL_PIPELINE_STAGE")
if [ "$SEQUENCE_PARALLEL" = 1 ] || { [ "$SEQUENCE_PARALLEL" = auto ] && [ "$TP" -gt 1 ]; }; then
    MODEL_PARALLEL_ARGS+=(--sequence-parallel)
fi
[ -n "$DISTRIBUTED_BACKEND" ] && MODEL_PARALLEL_ARGS+=(--distributed-backend "$DISTRIBUTED_BACKEND")

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE"
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style "$LR_DECAY_STYLE"
    --lr-decay-iters "$LR_DECAY_ITERS"
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --weight-decay "$WEIGHT_DECAY"
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad "$CLIP_GRAD"
    --seed "$SEED"
)
case "$PRECISION" in
    bf16) TRAINING_ARGS+=(--bf16) ;;
    fp16) TRAINING_ARGS+=(--fp16) ;;
    fp32) ;;
    *) _fail "PRECISION must be bf16, fp16 or fp32, not '$PRECISION'" ;;
esac
if [ "$USE_DISTRIBUTED_OPTIMIZER" = 1 ]; then
    TRAINING_ARGS+=(--use-distributed-optimizer)
    [ "$OVERLAP_COMM" = 1 ] && TRAINING_ARGS+=(--overlap-grad-reduce --overlap-param-gather)
elif [ "$OVERLAP_COMM" = 1 ]; then
    TRAINING_ARGS+=(--overlap-grad-reduce)
fi
case "$RECOMPUTE" in
    none) ;;
    selective) TRAINING_ARGS+=(--recompute-activations) ;;
    full) TRAINING_ARGS+=(--recompute-granularity full --recompute-method "$RECOMPUTE_METHOD"
                          --recompute-num-layers "$RECOMPUTE_NUM_LAYERS") ;;
    *) _fail "RECOMPUTE must be none, selective or full, not '$RECOMPUTE'" ;;
esac

if [ -n "$DATA_PATH" ]; then
    read -ra _paths <<< "$DATA_PATH"
    DATA_ARGS=(--data-path "${_paths[@]}" --split "$SPLIT" --tokenizer-type "$TOKENIZER_TYPE")
    [ -n "$VOCAB_FILE" ] && DATA_ARGS+=(--vocab-file "$VOCAB_FILE")
    [ -n "$MERGE_FILE" ] && DATA_ARGS+=(--merge-file "$MERGE_FILE")
    [ -n "$TOKENIZER_MODEL" ] && DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    [ -n "$VOCAB_SIZE" ] && DATA_ARGS+=(--vocab-size "$VOCAB_SIZE")
    [ -n "$DATA_CACHE_PATH" ] && DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH")
else
    echo "$SCRIPT_NAME: DATA_PATH is not set: training on mock data (random tokens)" >&2
    DATA_ARGS=(--mock-data --vocab-size "${VOCAB_SIZE:-50257}")  # no index cache: pretrain_gpt.py refuses one
fi
DATA_ARGS+=(--num-workers "$NUM_WORKERS")

OUTPUT_ARGS=(
    --log-interval "$LOG_INTERVAL"
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
    --log-jsonl "$LOG_JSONL"
)
[ -n "$CHECKPOINT_PATH" ] &&
    OUTPUT_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL")
[ -n "$TENSORBOARD_DIR" ] && OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
if [ -n "$WANDB_PROJECT" ]; then
    OUTPUT_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "$WANDB_EXP_NAME" --wandb-save-dir "$WANDB_SAVE_DIR")
    [ -n "$WANDB_ENTITY" ] && OUTPUT_ARGS+=(--wandb-entity "$WANDB_ENTITY")
fi

# launch [extra pretrain_gpt.py flags...]: run (or, with DRY_RUN=1, print) the training command
launch() {
    local -a torchrun_cmd
    read -ra torchrun_cmd <<< "$TORCHRUN"
    local -a cmd=("${torchrun_cmd[@]}" "${DISTRIBUTED_ARGS[@]}" "$MEGALITE_ROOT/pretrain_gpt.py"
                  "${MODEL_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
                  "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf '%q ' "${cmd[@]}"
        echo
        return 0
    fi
    mkdir -p "$OUTPUT_DIR"
    echo "$SCRIPT_NAME: $WORLD_SIZE GPUs ($NNODES x $GPUS_PER_NODE), TP $TP, PP $PP, node $NODE_RANK" >&2
    exec "${cmd[@]}"
}
