#!/bin/bash
# Megatron-LM's examples/gptoss/02_train.sh (gpt-oss, its main branch of 2026-08) run with
# megalite's pretrain_gpt.py on a CPU: its flag set as written there, with only model sizes, batch
# sizes, sample counts and intervals shrunk (each marked with the script's value) and the choices a
# CPU cannot make dropped (marked "megalite:"): --use-flash-attn (CUDA; gpt-oss's sinks run
# megalite's explicit softmax anyway). Its FP8 runs through torchao (the fp8 extra), emulated on a
# CPU. Its kernel-only
# choices (--transformer-impl transformer_engine, --moe-permute-fusion, --no-*-fusion,
# --export-force-local-attention) get one notice line each saying what runs instead.
# PP = the world size (2 gloo ranks), as the script sets it. The model is gpt-oss's: learned
# attention sinks, a sliding window on every other layer, the clamped GLU (quick-GeGLU, up + 1,
# clamp 7), YaRN (--enable-gpt-oss), 4 experts top-2 with the aux and z losses.
#
#   bash examples/gptoss/gpt_oss_cpu.sh [--checkpoint-path DIR] [--tokenizer PATH|MOCK] [--data PREFIX|MOCK]
#   DRY_RUN=1 bash examples/gptoss/gpt_oss_cpu.sh ...   # print the command only
#
# As in 02_train.sh, --tokenizer and --data default to MOCK (mock data, NullTokenizer); a Hugging
# Face tokenizer directory and a data prefix made with it (tools/preprocess_data.py
# --tokenizer-type HuggingFaceTokenizer) train on text. docs/models.md ("gpt-oss") has the flags.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CHECKPOINT_PATH=""
TOKENIZER_ARG="MOCK"
DATA_ARG="MOCK"
while [[ $# -gt 0 ]]; do
    case $1 in
        --checkpoint-path) CHECKPOINT_PATH="$2"; shift 2 ;;
        --tokenizer) TOKENIZER_ARG="$2"; shift 2 ;;
        --data) DATA_ARG="$2"; shift 2 ;;
        *) echo "Unknown option: $1" >&2; exit 1 ;;
    esac
done
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$(mktemp -d -t megalite-gpt-oss-XXXXXX)}
mkdir -p "$CHECKPOINT_PATH"
DATA_CACHE_PATH="$CHECKPOINT_PATH/cache"
run() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

WORLD_SIZE=2                    # GPUS_PER_NODE 8 x NUM_NODES 1
TP_SIZE=1
EP_SIZE=1
PP_SIZE=${WORLD_SIZE}
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8             # 128
NUM_LAYERS=4                    # 12
SEQ_LENGTH=64                   # 8192
MAX_POSITION_EMBEDDINGS=64      # 8192

MODEL_ARGS=(
    --no-masked-softmax-fusion
    --transformer-impl transformer_engine
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --no-rope-fusion
    --normalization RMSNorm
    --num-layers ${NUM_LAYERS}
    --hidden-size 64                # 512
    --ffn-hidden-size 128           # 2048
    --num-attention-heads 8         # 64
    --group-query-attention
    --num-query-groups 2            # 8
    --seq-length ${SEQ_LENGTH}
    --max-position-embeddings ${MAX_POSITION_EMBEDDINGS}
    --use-mcore-models
    --rotary-percent 1.0
    --rope-type rope
    --position-embedding-type rope
    --rotary-base 10000
    --no-bias-gelu-fusion
    --export-force-local-attention
    --no-bias-dropout-fusion
    --quick-geglu
    --glu-linear-offset 1.0
    --softmax-type learnable
    --window-attn-skip-freq 2
    --activation-func-clamp-value 7.0
    --window-size 16,0              # 128,0
    --enable-gpt-oss
)
MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
    --moe-ffn-hidden-size 128       # 2048
    --moe-router-dtype fp32
    --moe-z-loss-coeff 1e-3
    --moe-permute-fusion
)
DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=(
        "--mock-data"
        "--tokenizer-type NullTokenizer"
        "--vocab-size 1024"         # 128256
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--tiktoken-pattern v2"
        "--split '99,1,0'"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
    )
else
    DATA_ARGS_LIST+=(
        "--data-path $DATA_ARG"
        "--tokenizer-type HuggingFaceTokenizer"
        "--tokenizer-model $TOKENIZER_ARG"
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--split '99,1,0'"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
        "--vocab-size 512"          # 128256: the tokenizer's
    )
fi
TRAINING_ARGS=(
    --micro-batch-size ${MICRO_BATCH_SIZE}
    --global-batch-size ${GLOBAL_BATCH_SIZE}
    --lr 1.0e-5
    --train-samples 32              # 1953125000
    --lr-decay-samples 30           # 1949218748
    --lr-decay-style cosine
    --min-lr 1.0e-6
    --weight-decay 0.1
    --lr-warmup-fraction 0.05
    --clip-grad 1.0
    --bf16
    # megalite: --use-flash-attn dropped (the flash-attn package runs on CUDA only)
    --attention-softmax-in-fp32
    --accumulate-allreduce-grads-in-fp32
    --disable-bf16-reduced-precision-matmul
    --recompute-activations
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size ${TP_SIZE}
    --pipeline-model-parallel-size ${PP_SIZE}
    --expert-model-parallel-size ${EP_SIZE}
    --sequence-parallel
    --context-parallel-size 1
    --use-distributed-optimizer
    --fp8-format hybrid
    --fp8-param-gather
    --fp8-amax-compute-algo max
    --fp8-amax-history-len 1024
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval 4               # 10000
    --eval-interval 50000000
    --eval-iters 0
    --save $CHECKPOINT_PATH
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --moe-per-layer-logging
    --no-load-optim
    --no-load-rng
    --log-throughput
)

run "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node ${WORLD_SIZE} "$ROOT/pretrain_gpt.py" \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS_LIST[@]} \
    "${TRAINING_ARGS[@]}" \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
