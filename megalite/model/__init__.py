"""The GPT model built from tensor-parallel layers."""
from .config import ExecutionConfig, GPTConfig, model_configs, pad_vocab_size
from .gpt import GPTModel

__all__ = ["ExecutionConfig", "GPTConfig", "GPTModel", "model_configs", "pad_vocab_size"]
