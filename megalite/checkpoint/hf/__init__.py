"""Hugging Face `transformers` interchange, both ways: configs, weights (GPT-2, Llama, Qwen3, the
MoE families, gpt-oss, DeepSeek-V3), the tokenizer, and sharded safetensors written tensor by tensor."""
from .config import HF_CLASSES, ConversionError, hf_architecture, pretrain_flags
from .conversion import from_hf, to_hf
from .shards import parse_size

__all__ = ["HF_CLASSES", "ConversionError", "hf_architecture", "pretrain_flags", "from_hf", "to_hf", "parse_size"]
