#!/usr/bin/env bash
# A Qwen3.5-shaped dense hybrid, tiny: qwen3_next_cpu.sh's layers (three gated DeltaNet layers, then
# gated softmax attention) with a dense SwiGLU MLP in every layer. Its checkpoints convert to Hugging
# Face's Qwen3_5ForCausalLM (tools/checkpoint/convert.py --saver hf). docs/models.md.
#
#   bash examples/qwen3_next/qwen3_5_cpu.sh
#   DRY_RUN=1 bash examples/qwen3_next/qwen3_5_cpu.sh
set -euo pipefail
NUM_EXPERTS=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen3_next_cpu.sh" "$@"
