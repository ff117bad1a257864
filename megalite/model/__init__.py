"""The GPT model built from tensor-parallel layers."""
from .config import GPTConfig, pad_vocab_size
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel", "pad_vocab_size"]
