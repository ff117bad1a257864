"""Checkpoints: save and load on any layout and sharding strategy (per-rank shards, an index of
who holds what, resharding reads), the tensor file format, up-front checks of a checkpoint's
files, and Hugging Face conversion."""
