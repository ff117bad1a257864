"""Checkpoints: save and load on any layout (per-rank shards, an index of who holds what,
resharding reads), the tensor file format, and Hugging Face conversion."""
