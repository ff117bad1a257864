"""Forward/backward over the micro-batches of one iteration.

A schedule calls `forward_step(data_iterator, model_chunk)`, which returns, on the last stage,
(loss_sum, num_tokens) for one micro-batch: the loss summed over its tokens and the number of
tokens with loss. Backward runs on loss_sum x `backward_scale` (1 / the nominal number of
tokens in the global batch), so gradients summed over micro-batches and DP ranks are those of
the global-batch mean loss. The schedule returns the per-micro-batch (loss_sum, num_tokens).
"""
from __future__ import annotations

import torch


def forward_backward_no_pipelining(forward_step, data_iterator, model, num_microbatches: int,
                                   backward_scale: float, forward_only: bool = False, **_):
    """Gradient accumulation on one stage: forward and backward each micro-batch in turn."""
    (chunk,) = model
    stats = []
    for _ in range(num_microbatches):
        with torch.set_grad_enabled(not forward_only):
            loss_sum, num_tokens = forward_step(data_iterator, chunk)
        if not forward_only:
            (loss_sum * backward_scale).backward()
        stats.append((loss_sum.detach(), num_tokens.detach()))
    return stats


def get_forward_backward_func(pp_size: int, vpp_size: int = 1):
    if pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline parallelism is not available in this build")
