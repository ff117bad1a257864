"""Gradient-accumulation fusion (Megatron-LM's --gradient-accumulation-fusion, on by default there
and here; --no-gradient-accumulation-fusion turns it off): a linear layer's weight-gradient GEMM
writes straight into the parameter's view of the gradient buffer.

Without it, autograd makes dW = dYᵀ·X [out, in] as a new tensor in the parameter's dtype, and the
buffer's post-accumulate hook (distributed/grad_buffer.py) copies it into the fp32 buffer on a
step's first micro-batch and adds it on the others (ZeRO-2/3: adds it into the bucket's staging
buffer): one more pass over every weight per micro-batch (on a GPU, with 16-bit weights, a
cast-copy or cast-add at ~1.5 TB/s: ~5 ms per micro-batch at 1.3B, benchmarks/RESULTS_gpu.md).
With it, the GEMM itself computes main_grad = dYᵀ·X (β = 0) or main_grad += dYᵀ·X (β = 1), in
the buffer's dtype; with 16-bit operands and an fp32 buffer that is addmm's `out_dtype` (CUDA:
the GEMM accumulates in fp32 anyway and now also rounds there, as Megatron-LM's
fused_weight_gradient_mlp_cuda and Transformer Engine's main_grad path do), elsewhere the same
dtype in and out. Which GEMM (`gemm_for`) is decided once per buffer and weight dtype, on the
buffer's device.

Autograd still receives a gradient for the weight: an uninitialised stand-in (torch.empty, no
kernel) that the buffer's hook recognises and drops (as Megatron-LM's `grad_added_to_main_grad`).
So the hook still runs once per weight and micro-batch, however many times the weight was used
(the output layer under MTP), and --overlap-grad-reduce counts arrivals as before. Hence the rule
of `attach`: every use of a weight with a sink must go through `linear` (or the sequence-parallel
gather's product, mappings.py) — a column- or row-parallel linear's own weight, the untied output
layer's, the experts' in their per-expert loop: the modules name them (`fusable_weights`) — else
autograd would add a real gradient to the stand-in.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

_SINK = "megalite_wgrad_sink"  # parameter attribute: a weak reference to the buffer taking its dW


def attach(params, buffer) -> None:
    """Route the weight gradients of `params` into `buffer` (which has `add_wgrad`). Weakly:
    a parameter must not keep a finished run's buffer alive (grad_buffer._Hooked)."""
    ref = weakref.ref(buffer)
    for p in params:
        setattr(p, _SINK, ref)


def detach(params) -> None:
    for p in params:
        if hasattr(p, _SINK):
            delattr(p, _SINK)


def sink_of(weight: torch.Tensor):
    """The buffer taking `weight`'s gradient in the GEMM, or None (autograd's own path): no
    sink, a dead one, grad mode off, or a weight that wants no gradient."""
    ref = getattr(weight, _SINK, None)
    if ref is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return None
    return ref()


def _gemm_same_dtype(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    """out = a·b (overwrite: β = 0, whatever out held, NaN included) or out += a·b."""
    out.addmm_(a, b, beta=0.0 if overwrite else 1.0)


def _gemm_out_dtype(out, a, b, overwrite: bool) -> None:
    """The same from 16-bit a, b into an fp32 out: addmm's `out_dtype` (CUDA), the product
    accumulated and rounded in fp32 (PyTorch builds whose addmm wants `self` in the inputs'
    dtype take `_gemm_out_dtype_mm`)."""
    torch.addmm(out, a, b, beta=0.0 if overwrite else 1.0, out_dtype=out.dtype, out=out)


def _gemm_out_dtype_mm(out, a, b, overwrite: bool) -> None:
    """mm's `out_dtype` only: written in place on a step's first micro-batch (one micro-batch:
    the whole saving), an fp32 product added after."""
    if overwrite:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(torch.mm(a, b, out_dtype=out.dtype))


def gemm_for(param_dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device):
    """The function `gemm(out, a, b, overwrite)` that takes weights of `param_dtype` into a
    buffer of `grad_dtype` on `device`, or None (the hook's way): the same dtype anywhere; 16-bit
    into fp32 where addmm or mm has `out_dtype` (CUDA), each form tried once on the device
    against the unfused product."""
    if param_dtype == grad_dtype:
        return _gemm_same_dtype
    if device.type != "cuda" or grad_dtype != torch.float32 or param_dtype not in (torch.bfloat16, torch.float16):
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(16, 32, generator=gen).to(device, param_dtype) for _ in range(2))
    want = 2 * (a.float() @ b.float().t())
    for gemm in (_gemm_out_dtype, _gemm_out_dtype_mm):
        out = torch.full((16, 16), float("nan"), device=device)
        try:
            gemm(out, a, b.t(), overwrite=True)
            gemm(out, a, b.t(), overwrite=False)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if torch.allclose(out, want, rtol=1e-2, atol=1e-2):
            return gemm
    return None


class _FusedLinear(torch.autograd.Function):
    """Y = X·Wᵀ + b ([*, in] -> [*, out]) whose dW = dYᵀ·X goes into `sink`'s buffer (dX and db as
    F.linear's backward computes them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.param, ctx.has_bias = sink, weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy_2d = dy.reshape(-1, dy.size(-1))  # [tokens, out]
        ctx.sink.add_wgrad(ctx.param, dy_2d.t(), x.reshape(-1, x.size(-1)))
        return dx, torch.empty_like(weight), (dy_2d.sum(0) if ctx.has_bias else None), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear with the weight gradient fused into its buffer; None when `weight` has no sink
    (the caller runs the plain product)."""
    sink = sink_of(weight)
    return None if sink is None else _FusedLinear.apply(x, weight, bias, sink)
