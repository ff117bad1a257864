#!/bin/bash
# Megatron-LM's two flagship launch scripts as of its 2026-08 main branch,
# examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh, run
# with megalite's pretrain_gpt.py: their flag sets as written there, with only model sizes, batch
# sizes and iteration counts shrunk so that each trains for a few iterations on a CPU, under
# torchrun with TP=2 (gloo). The Llama script runs in both of its branches: real data (a tokenizer
# and a data prefix given) and mock data (its default). The few other differences follow
# Megatron-LM's own validation or the device; each is marked "megalite:" and docs/megatron.md
# ("Megatron-LM's launch scripts") lists them.
#
#   bash examples/megatron/run_cpu.sh [WORK_DIR]    # data, checkpoints, logs under WORK_DIR (default:
#                                                   # $OUTPUT_DIR if set, else a new temp dir; never the checkout)
#   DRY_RUN=1 bash examples/megatron/run_cpu.sh     # print the three commands only
#   ONLY=gpt3 | ONLY=llama | ONLY=llama-mock        # run one of them
#
# Needs the hf extra (pip install -e '.[hf,tensorboard]'): the data is a byte-level BPE trained on
# the bundled corpus (make_tiny_data.py), read by GPT2BPETokenizer and HuggingFaceTokenizer as in
# the two scripts; the Llama script's FP8 needs the fp8 extra (torchao). About a minute on two CPU cores.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=${1:-${OUTPUT_DIR:-$(mktemp -d -t megalite-megatron-XXXXXX)}}
DATA=$WORK/data
mkdir -p "$WORK"
run() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
torchrun_() { run "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 "$@"; }

# Flags that another branch is adding; passed only once pretrain_gpt.py knows them.
HELP=$("$PYTHON" "$ROOT/pretrain_gpt.py" --help)
known() { grep -q -- "$1" <<<"$HELP"; }

if [[ "${DRY_RUN:-0}" != "1" && ! -f "$DATA/hf_text_document.idx" ]]; then
    "$PYTHON" "$ROOT/examples/megatron/make_tiny_data.py" "$DATA" --documents 1000
    "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$DATA/corpus.jsonl" --output-prefix "$DATA/gpt2" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/vocab.json" --merge-file "$DATA/merges.txt" --append-eod
    "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$DATA/corpus.jsonl" --output-prefix "$DATA/hf" \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/hf_tokenizer" --append-eod
fi

# -- examples/gpt3/train_gpt3_175b_distributed.sh ----------------------------------------------------
gpt3_175b() {
    CHECKPOINT_PATH=$WORK/gpt3/checkpoints
    TENSORBOARD_LOGS_PATH=$WORK/gpt3/tensorboard
    VOCAB_FILE=$DATA/vocab.json
    MERGE_FILE=$DATA/merges.txt
    DATA_PATH=$DATA/gpt2_text_document

    GPT_MODEL_ARGS=(
        --num-layers 2                  # 96
        --hidden-size 64                # 12288
        --num-attention-heads 4         # 96
        --seq-length 64                 # 2048
        --max-position-embeddings 64    # 2048
        --attention-backend auto
    )
    TRAINING_ARGS=(
        --micro-batch-size 1
        # megalite: --global-batch-size 1536 dropped: Megatron-LM refuses it beside the schedule,
        # whose last batch is the global batch
        --step-batch-size-schedule "0:2 256:4 768:6"   # token thresholds (seq 64: samples 0, 4, 12)
        --train-iters 18                # 500000 (fp16 skips the first ~13 while the loss scale
                                        # falls from 2^32, as it would on GPUs)
        --weight-decay 0.1
        --adam-beta1 0.9
        --adam-beta2 0.95
        --init-method-std 0.006
        --clip-grad 1.0
        --fp16
        --lr 6.0e-5
        --lr-decay-style cosine
        --min-lr 6.0e-6
        --lr-warmup-fraction .001
        --lr-decay-iters 16             # 430000
    )
    MODEL_PARALLEL_ARGS=(
        --tensor-model-parallel-size 2      # 8
        --pipeline-model-parallel-size 1    # 16
    )
    DATA_ARGS=(
        --data-path $DATA_PATH
        --vocab-file $VOCAB_FILE
        --merge-file $MERGE_FILE
        --split 949,50,1
        # megalite: the script names no tokenizer; Megatron-LM stops at "None tokenizer is not
        # implemented" and megalite asks for --tokenizer-type too. GPT-2's BPE, as its files say
        --tokenizer-type GPT2BPETokenizer
    )
    EVAL_AND_LOGGING_ARGS=(
        --log-interval 1                # 100
        --save-interval 3               # 10000
        --eval-interval 3               # 1000
        --save $CHECKPOINT_PATH
        --load $CHECKPOINT_PATH
        --eval-iters 1                  # 10
        --tensorboard-dir $TENSORBOARD_LOGS_PATH
    )
    torchrun_ "$ROOT/pretrain_gpt.py" \
        ${GPT_MODEL_ARGS[@]} \
        "${TRAINING_ARGS[@]}" \
        ${MODEL_PARALLEL_ARGS[@]} \
        ${DATA_ARGS[@]} \
        ${EVAL_AND_LOGGING_ARGS[@]} \
        --log-jsonl $WORK/gpt3/metrics.jsonl
}

# -- examples/llama/train_llama3_8b_h100_fp8.sh --------------------------------------------------------
# llama3_8b NAME TOKENIZER_ARG DATA_ARG: the script's $3 and $4 ("MOCK" selects its mock-data branch)
llama3_8b() {
    NAME=$1
    CHECKPOINT_PATH=$WORK/$NAME/checkpoints
    TENSORBOARD_LOGS_PATH=$WORK/$NAME/tensorboard
    TOKENIZER_ARG=$2
    DATA_ARG=$3
    TP_SIZE=2                       # 1 (its --sequence-parallel comment assumes 2)
    CP_SIZE=1
    MICRO_BATCH_SIZE=1
    GLOBAL_BATCH_SIZE=8             # 128
    NUM_LAYERS=2                    # 32
    # FP8 as the script has it: through torchao (pip install 'megalite[fp8]'), emulated on a CPU
    # (the same casts, fp32 products); DTYPE=bf16 is the script's other branch, without torchao
    DTYPE=${DTYPE:-fp8}
    SEQ_LENGTH=64                   # 8192
    MAX_POSITION_EMBEDDINGS=64      # 8192
    DATA_CACHE_PATH=$WORK/$NAME/cache
    # megalite: a CPU cannot run SDPA's fused (cuDNN / memory-efficient) kernels and megalite refuses
    # them there; its math path is the nearest
    ATTENTION_BACKEND=$("$PYTHON" -c "import torch; print('fused' if torch.cuda.is_available() else 'unfused')")

    MODEL_ARGS=(
        --use-mcore-models
        --num-layers $NUM_LAYERS
        --hidden-size 64                # 4096
        --ffn-hidden-size 224           # 14336
        --num-attention-heads 4         # 32
        --group-query-attention
        --num-query-groups 2            # 8
        --kv-channels 16                # 128
        --seq-length $SEQ_LENGTH
        --max-position-embeddings $MAX_POSITION_EMBEDDINGS
        --position-embedding-type rope
        --rotary-base 1000000
        --rotary-percent 1.0
        --attention-dropout 0.0
        --hidden-dropout 0.0
        --swiglu
        --init-method-std 0.0134
        --attention-backend $ATTENTION_BACKEND
        --apply-layernorm-1p
        --untie-embeddings-and-output-weights
        --disable-bias-linear
    )
    TRAINING_ARGS=(
        --micro-batch-size $MICRO_BATCH_SIZE
        --global-batch-size $GLOBAL_BATCH_SIZE
        --train-samples 32              # 1953125000
        --lr-decay-samples 31           # 1949218748
        --lr-warmup-samples 8           # 3906252
        --lr 0.00015
        --min-lr 0.00001
        --decoupled-lr 5.0e-4
        --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine
        --clip-grad 1.0
        --weight-decay 0.1
        --adam-beta1 0.9
        --adam-beta2 0.95
        --bf16
        --grad-reduce-in-bf16
        --cross-entropy-loss-fusion
        --calculate-per-token-loss
        $(known --manual-gc && echo --manual-gc || true)
        --empty-unused-memory-level 1
        --exit-duration-in-mins 235
    )
    DTYPE_ARGS=()
    if [[ "$DTYPE" == "fp8" ]]; then
        DTYPE_ARGS+=(
            "--fp8-format hybrid"
            "--fp8-amax-history-len 1024"
            "--fp8-amax-compute-algo max"
            "--fp8-param-gather"
        )
    fi
    MODEL_PARALLEL_ARGS=(
        --tensor-model-parallel-size $TP_SIZE
        --context-parallel-size $CP_SIZE
        --sequence-parallel
    )
    DDP_ARGS=(
        --use-distributed-optimizer
        --overlap-grad-reduce
        --overlap-param-gather
    )
    TRAINING_ARGS+=("${DDP_ARGS[@]}")
    DATA_ARGS_LIST=()
    if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
        # megalite: --tiktoken-pattern (with NullTokenizer), --split, --data-cache-path and
        # --no-mmap-bin-files (with --mock-data) act on nothing here; Megatron-LM accepts and ignores
        # them, megalite too, with a one-line notice each
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
            "--vocab-size 1024"         # 128256
        )
    fi
    EVAL_AND_LOGGING_ARGS=(
        --log-interval 1
        --eval-iters 1                  # 32
        --eval-interval 3               # 100
        --save-interval 3               # 1000
        --log-throughput
        --profile
        --profile-step-start 1          # 4
        --profile-step-end 3            # 6
        # megalite: --ckpt-format torch_dist left out: it writes Megatron-LM's format (docs/checkpoints.md)
        # without the optimizer state or RNG, where megalite's own format resumes exactly
        $(known --distributed-timeout-minutes && echo --distributed-timeout-minutes 60 || true)
        --save "$CHECKPOINT_PATH"
        --load "$CHECKPOINT_PATH"
        --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    )
    torchrun_ "$ROOT/pretrain_gpt.py" \
        ${MODEL_ARGS[@]} \
        ${TRAINING_ARGS[@]} \
        ${DTYPE_ARGS[@]} \
        ${MODEL_PARALLEL_ARGS[@]} \
        ${DATA_ARGS_LIST[@]} \
        ${EVAL_AND_LOGGING_ARGS[@]} \
        --log-jsonl $WORK/$NAME/metrics.jsonl
}

wanted() { [[ -z "${ONLY:-}" || "${ONLY}" == "$1" ]]; }
if wanted gpt3; then (cd "$WORK" && gpt3_175b); fi
if wanted llama; then (cd "$WORK" && llama3_8b llama "$DATA/hf_tokenizer" "$DATA/hf_text_document"); fi
if wanted llama-mock; then (cd "$WORK" && llama3_8b llama-mock MOCK MOCK); fi
[[ "${DRY_RUN:-0}" == "1" ]] || echo "logs, checkpoints and traces: $WORK"
