"""--experimental-attention-variant: which layers replace softmax attention, and with what.

gated_delta_net (Megatron-LM's; "gdn" is its newer name, accepted as the same): gated DeltaNet
layers (Yang et al. 2024, "Gated Delta Networks"; Qwen3-Next, Qwen3.5) interleaved with softmax
attention by --linear-attention-freq, counted as Megatron-LM's get_linear_attention_pattern does:
an int N is N-1 linear layers then one softmax layer, repeated (layer i, from 0, is softmax when
(i + 1) % N == 0); a Python list of 0/1 per layer gives each layer (1 linear, 0 softmax), parsed,
never evaluated (config/moe.py's syntax).

dsa: DeepSeek Sparse Attention (DeepSeek-V3.2) in every layer: multi-latent attention whose
queries attend only to the top-k keys a lightweight indexer picks (model/dsa.py).

Only the standard library is imported here: validation reads it before torch."""
from __future__ import annotations

from .moe import every_nth_pattern

LINEAR_VARIANTS = ("gated_delta_net", "gdn")
VARIANTS = LINEAR_VARIANTS + ("dsa",)


def linear_attention_pattern(freq, num_layers: int) -> list[bool]:
    """Per layer, whether it is a linear-attention (gated DeltaNet) layer. Raises ValueError (with
    why) for a bad --linear-attention-freq."""
    return every_nth_pattern(freq, num_layers)
