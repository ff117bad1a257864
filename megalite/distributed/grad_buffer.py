"""A contiguous fp32 gradient buffer, split into buckets, reduced over data-parallel ranks.

Every parameter's `main_grad` is a view into one flat buffer. Autograd's per-parameter `.grad`
is added into it as soon as it is accumulated (post-accumulate hook) and then freed, so
gradients accumulate across micro-batches in fp32 whatever the parameter dtype, and the DP
reduction is a few large all-reduces (one per bucket) instead of one per parameter. Buckets
follow the reverse of the parameters' order, roughly the order backward produces them, which is
what lets a later bucket's reduction overlap the rest of backward.
"""
from __future__ import annotations

import torch

from .. import comm


class GradBuffer:
    def __init__(self, params: list[torch.nn.Parameter], dp_group, bucket_size: int = 40_000_000,
                 dtype: torch.dtype = torch.float32, pad_to: int = 1):
        """`pad_to`: each bucket's size is rounded up to a multiple of this (the DP size for the
        distributed optimizer, so every bucket splits into equal shards)."""
        self.params, self.dp_group = list(params), dp_group
        device = self.params[0].device
        self.buckets: list[tuple[int, int]] = []  # [start, end) in elements, padded
        self.param_index: dict[torch.nn.Parameter, tuple[int, int]] = {}
        offset, bucket_start = 0, 0
        for i, p in enumerate(reversed(self.params)):
            self.param_index[p] = (offset, offset + p.numel())
            offset += p.numel()
            if offset - bucket_start >= bucket_size or i == len(self.params) - 1:
                offset = bucket_start + -(-(offset - bucket_start) // pad_to) * pad_to
                self.buckets.append((bucket_start, offset))
                bucket_start = offset
        self.data = torch.zeros(offset, dtype=dtype, device=device)
        for p in self.params:
            start, end = self.param_index[p]
            p.main_grad = self.data[start:end].view(p.shape)
            p.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def zero(self) -> None:
        self.data.zero_()

    def scale(self, factor: float) -> None:
        self.data.mul_(factor)

    def all_reduce(self) -> None:
        """Sum every bucket over the DP group (the loss is already normalised by the global
        token count, so a sum, not a mean, is the gradient of the global-batch loss)."""
        for start, end in self.buckets:
            comm.all_reduce(self.data[start:end], self.dp_group)
