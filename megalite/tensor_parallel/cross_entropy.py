"""Cross entropy over vocabulary-parallel logits, without ever gathering the logits.

Megatron-LM paper (Shoeybi et al. 2019), Sec. 3: gathering [s, b, v] logits would cost
s·b·v words per rank; instead each rank reduces its [s, b, v/tp] shard to three [s, b]
quantities (max, sum of exp, the target's logit) and only those are all-reduced.

Columns past the true vocabulary size (the padding to a multiple of
`--make-vocab-size-divisible-by` x TP) are masked out of the softmax. The padding therefore
changes nothing: a layout with more padding computes the same loss and gradients (this is
where megalite deliberately differs from Megatron-LM, whose padded logits take part in the
softmax).

Memory (Megatron-LM's --cross-entropy-loss-fusion serves the same end): the logits are the
largest activation of a GPT step (s·b·v/tp, e.g. 2048 x 8 x 50k = 0.8G elements), so backward
keeps exactly one logits-sized tensor. fp32 logits: their softmax, computed into one new buffer
that also becomes the gradient (the logits themselves can then be freed), or with
`overwrite_logits` (the model's own loss, whose logits nothing else reads) the logits' own
storage turned into their softmax in place: no second logits-sized tensor exists even at the
forward's peak, and no fresh pages are touched (on a CPU in benchmarks/RESULTS_throughput.md, writing 2048 x 32000 new fp32 values
took ~200 of the loss's ~470 ms, mostly in page faults). 16-bit logits: the
logits, in their dtype, plus [s, b] row statistics; backward recomputes the softmax in fp32 on
slices of at most `CHUNK_ELEMENTS` logits. In bf16 that keeps 2 instead of 4 bytes per logit
for backward and holds about 2 instead of 10 bytes per logit at the forward's peak (the unfused
form made an fp32 copy, shifted it into a second one and kept that as the softmax), for one
more exp pass in backward. Padded columns are sliced off, never copied.

--cross-entropy-loss-fusion (`fused_vocab_parallel_cross_entropy`) also fuses the two sum
all-reduces, as Megatron-LM's native fused cross entropy does: the target logit and the sum of
exponentials do not depend on each other, so they travel as one [2, s·b] tensor, two collectives
per micro-batch (max, sums) instead of three. The loss and gradients are the same.
On a GPU it also runs the two passes below compiled without --compile (`fused_loss_kernels`).
(--cross-entropy-fusion-impl te names Transformer Engine's kernel, which megalite does not use:
this one runs, with a notice.)

Kernels (`LossKernels`): the two passes over 16-bit logits, the sum of exponentials (forward) and
the softmax gradient (backward), are plain functions. Eager, each is a few element-wise kernels on
a slice of rows with an fp32 scratch slice (PyTorch's softmax kernels read bf16 only after an fp32
copy of their input, which measured slower on an H200: benchmarks/RESULTS_gpu.md), so the slice
size is chosen by device in one place (`chunk_elements`: 64 MiB of scratch on the CPU, where
fresh pages cost page faults, 256 MiB on a GPU, where each slice costs kernel launches). Under
--compile (model/compile.py) Inductor fuses each pass into one kernel that reads the 16-bit logits
once and makes no fp32 scratch, so the whole [s·b, v] runs as one slice: one reduction forward,
one element-wise kernel backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm


def chunk_elements(device: torch.device) -> int:
    """fp32 scratch elements per slice of rows of the eager 16-bit path (module docstring)."""
    return 1 << (26 if device.type == "cuda" else 24)


def _sum_exp(rows: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sum_j exp(x_j - max) per row of rows [n, v] (16-bit), fp32 by promotion; `row_max` the max
    over every rank's columns."""
    return (rows - row_max.unsqueeze(-1)).exp_().sum(dim=-1)


def _sum_exp_pointwise(rows, row_max) -> torch.Tensor:
    """The same as one reduction for Inductor to fuse (no fp32 scratch)."""
    return (rows.float() - row_max.unsqueeze(-1)).exp().sum(dim=-1)


def _softmax_grad(rows, lse, local_target, inside, grad_loss, out=None) -> torch.Tensor:
    """(softmax(x) - onehot(target) for targets inside this rank's columns) x dloss into `out`
    (16-bit [n, v]; a new tensor when None); `lse` [n, 1] the log-sum-exp over every rank's columns."""
    g = (rows - lse).exp_()  # fp32 softmax by promotion
    g.scatter_add_(-1, local_target.unsqueeze(-1), -inside)
    g.mul_(grad_loss)
    return g.to(rows.dtype) if out is None else out.copy_(g)


def _softmax_grad_pointwise(rows, lse, local_target, inside, grad_loss) -> torch.Tensor:
    """_softmax_grad as one element-wise expression (the one-hot as a comparison, no scatter), for
    Inductor to fuse into one kernel that writes the logits' dtype."""
    cols = torch.arange(rows.size(-1), device=rows.device)
    onehot = (cols == local_target.unsqueeze(-1)).float() * inside
    return ((torch.exp(rows.float() - lse) - onehot) * grad_loss).to(rows.dtype)


def _compiled_grad(fn):
    def grad(rows, lse, local_target, inside, grad_loss, out=None):
        result = fn(rows, lse, local_target, inside, grad_loss)
        return result if out is None else out.copy_(result)
    return grad


@dataclass(frozen=True)
class LossKernels:
    """The two passes over 16-bit logits and how many rows each call takes (`whole`: all of them)."""
    sum_exp: Callable = _sum_exp
    softmax_grad: Callable = _softmax_grad
    whole: bool = False

    def chunks(self, n_rows: int, row_len: int, device: torch.device):
        step = n_rows if self.whole else max(1, chunk_elements(device) // max(row_len, 1))
        return [(i, min(i + step, n_rows)) for i in range(0, n_rows, max(step, 1))]


EAGER = LossKernels()


def compiled_loss_kernels(backend: str = "inductor") -> LossKernels:
    """The same passes compiled (--compile, or --cross-entropy-loss-fusion on a GPU): one fused
    kernel each, whole logits at once."""
    return LossKernels(torch.compile(_sum_exp_pointwise, backend=backend, dynamic=False),
                       _compiled_grad(torch.compile(_softmax_grad_pointwise, backend=backend, dynamic=False)),
                       whole=True)


def fused_loss_kernels(device: torch.device) -> LossKernels:
    """--cross-entropy-loss-fusion's passes over 16-bit logits without --compile: compiled where
    Inductor generates GPU kernels (CUDA with Triton), as Megatron-LM's native fused cross entropy
    compiles its pieces (jit_fuser); eager elsewhere (on the CPU Inductor would build C++ for
    no measured gain). On an H200 the eager passes took 7.2 ms of a 31 ms GPT-2 125M step, the
    compiled ones are one read of the logits forward and one read and write backward
    (benchmarks/RESULTS_gpu.md)."""
    if device.type != "cuda":
        return EAGER
    from torch.utils._triton import has_triton
    return compiled_loss_kernels() if has_triton() else EAGER


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, fuse_sums=False, overwrite=False, kernels=EAGER):
        # logits: [s, b, v/tp] (this rank's vocabulary columns), target: [s, b] global ids.
        # Returns (loss, the logits when they were overwritten by their softmax, else None)
        ctx.set_materialize_grads(False)  # the overwritten logits get no gradient: none is made
        part = logits.size(-1)
        start = comm.group_rank(group) * part
        valid = max(0, min(part, vocab_size - start)) if vocab_size is not None else part
        rows = logits.reshape(-1, part)[:, :valid]  # a view: padded columns are left out, not masked
        n = rows.size(0)

        if valid:
            logits_max = rows.amax(dim=-1).float()  # exact in any dtype; amax: no indices (5x faster)
        else:  # this rank holds padding only
            logits_max = torch.full((n,), float("-inf"), device=logits.device)
        comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)

        outside = (target < start) | (target >= start + valid)
        local_target = (target - start).masked_fill(outside, 0).reshape(-1)
        target_logit = torch.zeros(n, dtype=torch.float32, device=logits.device)
        if valid:
            target_logit = rows.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
            target_logit.masked_fill_(outside.reshape(-1), 0.0)
        if not fuse_sums:
            comm.all_reduce(target_logit, group)

        # fp32 logits: the softmax replaces them for backward (same bytes, no recompute); 16-bit
        # logits: they are kept and the softmax is recomputed, slice by slice, in backward
        keep_softmax = logits.dtype == torch.float32
        overwrite = overwrite and keep_softmax
        if keep_softmax:
            if overwrite:  # the softmax in the logits' own storage
                softmax = logits.view(n, part)
                exp_logits = rows.sub_(logits_max.unsqueeze(-1)).exp_()
            else:
                softmax = torch.empty(n, part, dtype=torch.float32, device=logits.device)
                exp_logits = torch.sub(rows, logits_max.unsqueeze(-1), out=softmax[:, :valid]).exp_()
            softmax[:, valid:] = 0.0  # padded columns took no part in the softmax
            sum_exp = exp_logits.sum(dim=-1)
        else:
            chunks = kernels.chunks(n, valid, logits.device) if valid else []
            if len(chunks) == 1:
                sum_exp = kernels.sum_exp(rows, logits_max)
            else:
                sum_exp = torch.zeros(n, dtype=torch.float32, device=logits.device)
                for lo, hi in chunks:
                    sum_exp[lo:hi] = kernels.sum_exp(rows[lo:hi], logits_max[lo:hi])
        if fuse_sums:  # one all-reduce for both sums
            sums = torch.stack([target_logit, sum_exp])
            comm.all_reduce(sums, group)
            target_logit, sum_exp = sums[0], sums[1]
        else:
            comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        ctx.valid, ctx.keep_softmax, ctx.logits_shape, ctx.kernels = valid, keep_softmax, logits.shape, kernels
        if keep_softmax:
            exp_logits.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(logits if overwrite else softmax, outside, local_target)
        else:
            ctx.save_for_backward(logits, (logits_max + sum_exp.log()).unsqueeze(-1), outside, local_target)
        if overwrite:
            ctx.mark_dirty(logits)
            return loss.view(target.shape), logits
        return loss.view(target.shape), None

    @staticmethod
    def backward(ctx, grad_loss, _grad_softmax=None):
        # d loss / d logit_j = softmax_j - 1[j == target]
        inside = (~ctx.saved_tensors[-2]).reshape(-1, 1).float()
        grad_loss = grad_loss.reshape(-1, 1).float()
        if ctx.keep_softmax:  # the saved fp32 softmax becomes the gradient in place
            softmax, _, local_target = ctx.saved_tensors
            softmax = softmax.view(-1, softmax.size(-1))
            softmax.scatter_add_(-1, local_target.unsqueeze(-1), -inside)
            return softmax.mul_(grad_loss).view(ctx.logits_shape), None, None, None, None, None, None
        logits, lse, _, local_target = ctx.saved_tensors
        valid, part, kernels = ctx.valid, logits.size(-1), ctx.kernels
        rows = logits.reshape(-1, part)[:, :valid]
        chunks = kernels.chunks(rows.size(0), valid, logits.device) if valid else []
        if valid == part and len(chunks) == 1:  # the kernel's output is the gradient: no copy
            grad = kernels.softmax_grad(rows, lse, local_target, inside, grad_loss)
            return grad.view(ctx.logits_shape), None, None, None, None, None, None
        grad = torch.empty_like(logits)
        grad_rows = grad.view(-1, part)
        if valid < part:
            grad_rows[:, valid:] = 0
        for lo, hi in chunks:
            kernels.softmax_grad(rows[lo:hi], lse[lo:hi], local_target[lo:hi], inside[lo:hi], grad_loss[lo:hi],
                                 out=grad_rows[lo:hi, :valid])
        return grad, None, None, None, None, None, None


def _overwritable(logits: torch.Tensor) -> bool:
    """Logits autograd lets a function change in place: contiguous, neither a leaf that requires
    a gradient nor a view (whose base would need its history rewritten too)."""
    return logits.is_contiguous() and not logits._is_view() and not (logits.requires_grad and logits.is_leaf)

def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int | None = None, overwrite_logits: bool = False,
                                 kernels: LossKernels = EAGER) -> torch.Tensor:
    """Per-token loss [s, b] from logits [s, b, v/tp] and targets [s, b]. `overwrite_logits`:
    the caller reads the logits no more, so fp32 ones may hold their softmax afterwards (where
    autograd allows it: `_overwritable`). `kernels`: the passes over 16-bit logits (LossKernels)."""
    overwrite = overwrite_logits and _overwritable(logits)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, False, overwrite, kernels)[0]


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                       vocab_size: int | None = None, overwrite_logits: bool = False,
                                       kernels: LossKernels = EAGER) -> torch.Tensor:
    """The same, with the two sum all-reduces fused into one (--cross-entropy-loss-fusion)."""
    overwrite = overwrite_logits and _overwritable(logits)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, True, overwrite, kernels)[0]
