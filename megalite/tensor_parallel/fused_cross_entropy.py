"""--cross-entropy-loss-fusion: the vocabulary-parallel cross entropy with its two sum
all-reduces fused into one, as Megatron-LM's native fused_vocab_parallel_cross_entropy
(megatron/core/fusions/fused_cross_entropy.py).

The plain version (cross_entropy.py) all-reduces three [s, b] statistics one after another: the
row maximum (MAX), the target's logit (SUM) and the sum of exponentials (SUM). The last two do
not depend on each other, so here they travel as one [2, s, b] tensor: two collectives per
micro-batch instead of three, which is what matters when TP spans nodes. The loss and the
gradient are the same (padded vocabulary columns masked out, as in cross_entropy.py).

Note: a fused kernel for the element-wise part is being written for cross_entropy.py; when it
lands, --cross-entropy-loss-fusion should select it, keeping the single all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
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
        exp_logits = logits.exp()
        stats = torch.stack([logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0),
                             exp_logits.sum(dim=-1)])  # [2, s, b]: target logit, sum of exp
        comm.all_reduce(stats, group)  # the one fused sum
        target_logit, sum_exp = stats[0], stats[1]
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logit_j = softmax_j - 1[j == target]
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                       vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [s, b] from logits [s, b, v/tp] and targets [s, b]."""
    return _FusedVocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
