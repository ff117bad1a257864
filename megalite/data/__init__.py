"""Data: Megatron-LM's .bin/.idx indexed dataset, GPT and blended datasets with cached indices,
mock data, building the splits from --data-path/--split, samplers, tokenizers, and the
micro-batches each model chunk consumes."""
