#!/usr/bin/env bash
# A DeepSeek-V3.2-shaped MoE GPT, tiny: examples/deepseek_v3/deepseek_v3_cpu.sh's model (MLA with
# query compression, DeepSeek-V3's MoE) with DeepSeek Sparse Attention in every layer: a lightning
# indexer (4 heads of 16; DeepSeek-V3.2: 64 of 128) picks each query's top 32 keys of 128 (2048),
# attention runs over those only, and the indexer trains by its own KL loss against the dense
# attention, weighted 0.01 (--dsa-indexer-loss-coeff; logged as "indexer loss"). One MTP module, as
# DeepSeek-V3.2's (MLA + DSA like the decoder's layers; its indexer loss in the logged one). 2 gloo
# processes, EP 2. Its checkpoints convert to Hugging Face's DeepseekV32ForCausalLM, MTP as
# model.layers.{L+k}.* (tools/checkpoint/convert.py --saver hf). docs/models.md ("DeepSeek Sparse Attention").
#
#   bash examples/deepseek_v32/deepseek_v32_cpu.sh
#   MTP_NUM_LAYERS= bash examples/deepseek_v32/deepseek_v32_cpu.sh   # no multi-token prediction
#   DRY_RUN=1 bash examples/deepseek_v32/deepseek_v32_cpu.sh
set -euo pipefail
DSA_TOPK=${DSA_TOPK:-32}
MTP_NUM_LAYERS=${MTP_NUM_LAYERS-1} exec bash "$(dirname "${BASH_SOURCE[0]}")/../deepseek_v3/deepseek_v3_cpu.sh" \
    --experimental-attention-variant dsa --dsa-indexer-n-heads 4 --dsa-indexer-head-dim 16 \
    --dsa-indexer-topk "$DSA_TOPK" --dsa-indexer-loss-coeff 0.01 "$@"
