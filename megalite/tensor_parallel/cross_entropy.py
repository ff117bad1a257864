"""Cross entropy over vocabulary-parallel logits, without ever gathering the logits.

Megatron-LM paper (Shoeybi et al. 2019), Sec. 3: gathering [s, b, v] logits would cost
s·b·v words per rank; instead each rank reduces its [s, b, v/tp] shard to three [s, b]
quantities (max, sum of exp, the target's logit) and only those are all-reduced.

Columns past the true vocabulary size (the padding to a multiple of
`--make-vocab-size-divisible-by` x TP) are masked out of the softmax. The padding therefore
changes nothing: a layout with more padding computes the same loss and gradients (this is
where megalite deliberately differs from Megatron-LM, whose padded logits take part in the
softmax).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        # logits: [s, b, v/tp] (this rank's vocabulary columns), target: [s, b] global ids
        logits = logits.float()
        part = logits.size(-1)
        start = comm.group_rank(group) * part
        valid = max(0, min(part, vocab_size - start)) if vocab_size is not None else part
        if valid < part:
            logits = logits.clone()
            logits[..., valid:] = float("-inf")

        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)

        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logit_j = softmax_j - 1[j == target]
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [s, b] from logits [s, b, v/tp] and targets [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
