"""The GPT model built from tensor-parallel layers: what it is built from (the architecture,
config.GPTConfig, and how it executes, ExecutionConfig), layout-invariant initialisation,
attention (GQA, RoPE, backends), transformer layers, the per-stage GPT chunk, and torch.compile of
the layers. Context-parallel attention is in megalite/context_parallel/."""
from .config import ExecutionConfig, GPTConfig, model_configs, pad_vocab_size
from .gpt import GPTModel

__all__ = ["ExecutionConfig", "GPTConfig", "GPTModel", "model_configs", "pad_vocab_size"]
