"""The GPT model built from tensor-parallel layers: its config, layout-invariant initialisation,
attention (GQA, RoPE, backends), transformer layers, the per-stage GPT chunk, and torch.compile of
the layers. Context-parallel attention is in megalite/context_parallel/."""
from .config import GPTConfig, pad_vocab_size
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel", "pad_vocab_size"]
