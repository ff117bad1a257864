#!/usr/bin/env bash
# A Qwen3.5-MoE-shaped hybrid, tiny: qwen3_next_cpu.sh with every layer MoE and the top-k probabilities
# renormalised (megalite's default), which Qwen3_5MoeForCausalLM computes. Its checkpoints convert with
# tools/checkpoint/convert.py --saver hf --hf-architecture qwen3_5_moe_text (without it: Qwen3-Next).
#
#   bash examples/qwen3_next/qwen3_5_moe_cpu.sh
#   DRY_RUN=1 bash examples/qwen3_next/qwen3_5_moe_cpu.sh
set -euo pipefail
MOE_LAYER_FREQ=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen3_next_cpu.sh" "$@"
