"""Gradient-accumulation fusion (Megatron-LM's --gradient-accumulation-fusion, on by default there
and here; --no-gradient-accumulation-fusion turns it off): a linear layer's weight-gradient GEMM
writes straight into the parameter's view of the gradient buffer.

Without it, autograd makes dW = dYᵀ·X [out, in] as a new tensor in the parameter's dtype, and the
buffer's post-accumulate hook (distributed/grad_buffer.py) copies it into the fp32 buffer on a
step's first micro-batch and adds it on the others (ZeRO-2/3: adds it into the bucket's staging
buffer): one more pass over every weight per micro-batch (on a GPU, with 16-bit weights, a
cast-copy or cast-add at ~1.5 TB/s: ~5 ms per micro-batch at 1.3B, benchmarks/RESULTS_gpu.md). With it, the GEMM itself computes
main_grad = dYᵀ·X (β = 0) or main_grad += dYᵀ·X (β = 1), in the buffer's dtype; with 16-bit
operands and an fp32 buffer that is addmm's `out_dtype` (CUDA: the GEMM accumulates in fp32
anyway and now also rounds there, as Megatron-LM's fused_weight_gradient_mlp_cuda and Transformer
Engine's main_grad path do), elsewhere the same dtype in and out.

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


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    """out = a·b (overwrite: β = 0, whatever out held, NaN included) or out += a·b, in out's dtype."""
    beta = 0.0 if overwrite else 1.0
    if out.dtype == a.dtype:
        out.addmm_(a, b, beta=beta)
    else:
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)


def fusable(param_dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `gemm_into` can take weights of `param_dtype` into a buffer of `grad_dtype` here:
    the same dtype anywhere; 16-bit into fp32 where addmm has `out_dtype` (CUDA), checked once
    on the device against the unfused product, so a build without it falls back to the hook."""
    if param_dtype == grad_dtype:
        return True
    if device.type != "cuda" or grad_dtype != torch.float32 or param_dtype not in (torch.bfloat16, torch.float16):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(16, 32, generator=gen).to(device, param_dtype) for _ in range(2))
    out = torch.full((16, 16), float("nan"), device=device)
    try:
        gemm_into(out, a, b.t(), overwrite=True)
        gemm_into(out, a, b.t(), overwrite=False)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.allclose(out, 2 * (a.float() @ b.float().t()), rtol=1e-2, atol=1e-2))


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
