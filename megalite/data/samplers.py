"""The pretraining sampler: which sample indices each DP rank reads, driven by consumed_samples.

Global batch i is samples [i·G, (i+1)·G) whatever the data-parallel size: the stream is cut
into chunks of micro x DP samples and DP rank r takes slice r of each chunk (as Megatron-LM's
MegatronPretrainingSampler). A run resumed at consumed_samples = k reads exactly what an
uninterrupted run reads from k on.
"""
from __future__ import annotations


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) >= total_samples ({total_samples})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.chunk = micro_batch_size * dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.chunk

    def __iter__(self):
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.chunk + 1, self.chunk):
            yield list(range(first + start, first + start + self.micro_batch_size))
