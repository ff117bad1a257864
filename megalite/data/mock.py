"""Random token sequences for runs without a dataset (--mock-data)."""
from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """Sample i is seq_length + 1 tokens drawn from a generator seeded by (seed, i): the same
    sample for the same index on every rank and every run."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, idx])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}
