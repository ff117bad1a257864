"""Datasets, samplers, tokenizers and batch construction."""
