"""Megatron-LM's checkpoints: torch_dist and legacy torch read as load indexes, torch_dist written
offline and by training, and torch_dist streamed to Hugging Face."""
