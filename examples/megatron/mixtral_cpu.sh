#!/bin/bash
# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (its main branch's), run with
# megalite's pretrain_gpt.py on 2 CPU processes (gloo): the flag set as written there, with only
# sizes (model, batch, iterations, intervals, parallel sizes) shrunk and paths given; the original
# value is in the comment beside each changed line. Like Megatron-LM's script it takes
# CHECKPOINT_PATH, TOKENIZER_MODEL (a SentencePiece .model with bos and eos: Llama2Tokenizer) and
# DATA_PATH (a dataset prefix preprocessed with --tokenizer-type Llama2Tokenizer) as arguments.
#
#   bash examples/megatron/mixtral_cpu.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH
#   DRY_RUN=1 bash examples/megatron/mixtral_cpu.sh ...     # print the command only
#
# tests/test_megatron_mixtral_example.py builds such data from the bundled corpus and trains with
# this command line. Megatron-LM's --no-masked-softmax-fusion gets a notice (a kernel switch
# megalite has nothing for); --no-position-embedding changes nothing with RoPE, as there.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2                     # 8
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 32                     # 4096
    --max-position-embeddings 256       # 32768
    --num-layers 2                      # 32
    --hidden-size 64                    # 4096
    --ffn-hidden-size 224               # 14336
    --num-attention-heads 4             # 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2                # 8
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8               # 256
    --lr 1e-4
    --train-iters 4                     # 500000
    --lr-decay-iters 3                  # 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1                 # 500
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1    # 4
    --expert-model-parallel-size 2      # 8
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 2 \
    --eval-interval 2 \
    --eval-iters 1 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi

run() { if [[ "${DRY_RUN:-0}" == "1" ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }
# megalite: torchrun as Python's module (the same launcher), pretrain_gpt.py from this checkout
run "$PYTHON" -m torch.distributed.run ${DISTRIBUTED_ARGS[@]} "$ROOT/pretrain_gpt.py" \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
