"""Megatron-LM's checkpoints: torch_dist and legacy torch read as load indexes (checkpoint/load.py
opens them), torch_dist written offline and by training, and torch_dist streamed to Hugging Face."""
from .export import write_megatron_checkpoint
from .saver import MegatronSaver
from .to_hf import megatron_to_hf

__all__ = ["write_megatron_checkpoint", "MegatronSaver", "megatron_to_hf"]
