#!/usr/bin/env bash
# Build the bundled demo dataset: SentencePiece tokenizer + Megatron .bin/.idx, under
# DATA_BUILD_DIR (default: data/build/ of the checkout; a relative path is taken from the current
# directory). Nothing else is written (the dataset's index cache later goes to DATA_BUILD_DIR/cache).
# Re-running skips steps whose outputs are newer than their inputs.
#   bash data/prepare.sh                 # uses `python`
#   PYTHON=.venv/bin/python bash data/prepare.sh
#   DATA_BUILD_DIR=/tmp/demo/data bash data/prepare.sh
set -euo pipefail
PYTHON="${PYTHON:-python}"
VOCAB_SIZE="${VOCAB_SIZE:-1536}"   # the corpus has ~630 distinct words; BPE runs out of merges near 1860
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="${DATA_BUILD_DIR:-$ROOT/data/build}"
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
cd "$ROOT"

CORPUS=data/corpus.jsonl   # bundled; should it be missing, it is generated into $BUILD
TOKENIZER="$BUILD/tokenizer.model"
PREFIX="$BUILD/corpus"
DATASET="${PREFIX}_text_document"

if [ ! -f "$CORPUS" ]; then
    CORPUS="$BUILD/corpus.jsonl"
    if [ ! -f "$CORPUS" ]; then
        echo "== generating $CORPUS"
        "$PYTHON" data/generate_corpus.py --output "$CORPUS"
    fi
fi

if [ ! -f "$TOKENIZER" ] || [ "$CORPUS" -nt "$TOKENIZER" ]; then
    echo "== training tokenizer -> $TOKENIZER (vocab $VOCAB_SIZE)"
    rm -f "$TOKENIZER" "$BUILD/tokenizer.vocab"  # stale: the tools never overwrite an output
    "$PYTHON" tools/train_tokenizer.py --input "$CORPUS" --model-prefix "$BUILD/tokenizer" \
        --vocab-size "$VOCAB_SIZE" --model-type bpe
else
    echo "== $TOKENIZER is up to date"
fi

if [ ! -f "$DATASET.idx" ] || [ ! -f "$DATASET.bin" ] \
        || [ "$TOKENIZER" -nt "$DATASET.idx" ] || [ "$CORPUS" -nt "$DATASET.idx" ]; then
    echo "== preprocessing -> $DATASET.{bin,idx}"
    rm -f "$DATASET.bin" "$DATASET.idx"
    "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$PREFIX" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" --append-eod --workers 2
else
    echo "== $DATASET.{bin,idx} is up to date"
fi

echo "== ready: --data-path $DATASET --tokenizer-type SentencePieceTokenizer --tokenizer-model $TOKENIZER"
