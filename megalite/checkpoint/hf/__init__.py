"""Hugging Face `transformers` interchange, both ways: configs, weights (GPT-2, Llama, Qwen3, the
MoE families, gpt-oss, DeepSeek-V3), the tokenizer, and sharded safetensors written tensor by tensor."""
