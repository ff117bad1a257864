"""An FP8 GEMM operand (FP8 values and the scale they were cast with) and the GEMM of two.

A cast is torchao's: fp8 = saturate(x·s) in fp32 (`to_fp8_saturated`), and x ≈ fp8 / s. The
scale `s` broadcasts against the values: a scalar (tensorwise), one per row ([R, 1]: the expert
rows of one micro-batch, fp8/experts.py) or one per element ([R, C], expanded from a tile grid:
fp8/blockwise.py). `gemm(a, b)` is a·b: operands whose scales torch._scaled_mm takes (scalar or
per row of a, scalar or per column of b) go to torchao's Float8TrainingTensor and `torch.mm`,
which runs `torch._scaled_mm` on FP8 tensor cores or, emulated, mm(a_fp8 / s_a, b_fp8 / s_b) in
fp32; other scales (varying along the reduced dimension: tiles, experts' weight gradients) take
the same emulated product, and on a GPU the product of the dequantized 16-bit values (the same
casts; torchao's block-scaled kernel is not wired in yet, docs/fp8.md)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import backend
from .recipe import Role


@dataclass
class Operand:
    data: torch.Tensor  # FP8 values [R, C]
    scale: torch.Tensor  # fp32, broadcastable to data: [], [R, 1], [1, C] or [R, C]
    role: Role
    orig_dtype: torch.dtype  # the unscaled tensor's dtype: the GEMM's output dtype

    @property
    def shape(self):
        return self.data.shape

    def t(self) -> "Operand":
        scale = self.scale.t() if self.scale.dim() == 2 else self.scale
        return Operand(self.data.t(), scale, self.role, self.orig_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() / self.scale).to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x·s) in fp32, as torchao casts (`to_fp8_saturated`). Eagerly that is four passes
    over x with fp32 copies between them (the upcast, the product, the clamp, the cast)."""
    return backend.float8().utils.to_fp8_saturated(x.float() * scale, dtype)


@functools.cache
def compiled_scaled_cast():
    """`_scaled_cast` compiled: one pass, reading x and writing the FP8 bytes, with the same fp32
    arithmetic (so the same bytes: tests/test_fp8.py). Shapes vary (every linear's X, W and dY, the
    experts' row counts), so Dynamo's automatic dynamic shapes take over after the first recompile.
    Built once per process: Dynamo keeps its compiled code per function anyway."""
    return torch.compile(_scaled_cast, dynamic=None)


def cast_kernel(device: torch.device):
    """The cast a device runs: compiled where Inductor generates GPU kernels (CUDA with Triton),
    as Transformer Engine's casts are fused kernels; eager elsewhere (on the CPU Inductor would
    build C++ for the emulated path, where the casts are not what costs)."""
    if device.type != "cuda":
        return _scaled_cast
    from torch.utils._triton import has_triton
    return compiled_scaled_cast() if has_triton() else _scaled_cast


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, role: Role) -> Operand:
    """x cast to FP8 `dtype` with `scale` (broadcastable to x), as torchao casts: saturated."""
    data = cast_kernel(x.device)(x.detach(), scale, dtype)
    return Operand(data, scale, role, x.dtype)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """max_fp8 / amax (torchao's amax_to_scale: in fp64, amax floored at 1e-12), divided by
    2^margin (Transformer Engine's delayed scaling headroom)."""
    scale = backend.float8().utils.amax_to_scale(amax, dtype)
    return scale / (2 ** margin) if margin else scale


def _torchao_axis(scale: torch.Tensor, rows: int, cols: int, along_rows: bool):
    """The axiswise_dim torchao gives an operand whose scale is `scale`, or False when
    torch._scaled_mm cannot take it: scalar (None), one per row of a ([R, 1]: -1), one per
    column of b ([1, C]: 0)."""
    if scale.dim() == 0 or scale.numel() == 1:
        return None
    if along_rows and tuple(scale.shape) == (rows, 1):
        return -1
    if not along_rows and tuple(scale.shape) == (1, cols):
        return 0
    return False


def _to_torchao(op: Operand, mm_config, axis):
    f8 = backend.float8()
    role = {Role.INPUT: f8.tensor.GemmInputRole.INPUT, Role.WEIGHT: f8.tensor.GemmInputRole.WEIGHT,
            Role.GRAD_OUTPUT: f8.tensor.GemmInputRole.GRAD_OUTPUT}[op.role]
    scale = op.scale.reshape(()) if axis is None else op.scale
    return f8.tensor.Float8TrainingTensor(op.data, scale, op.orig_dtype, mm_config, role, axis)


def gemm(a: Operand, b: Operand, mm_config, emulate: bool) -> torch.Tensor:
    """a [M, K] · b [K, N] in a's original dtype. `mm_config`: torchao's LinearMMConfig."""
    out_dtype = a.orig_dtype
    if a.data.size(0) == 0 or b.data.size(1) == 0 or a.data.size(1) == 0:
        return torch.zeros(a.data.size(0), b.data.size(1), dtype=out_dtype, device=a.data.device)
    axis_a = _torchao_axis(a.scale, *a.shape, along_rows=True)
    axis_b = _torchao_axis(b.scale, *b.shape, along_rows=False)
    if not emulate and (axis_a is None) != (axis_b is None) and False not in (axis_a, axis_b):
        # torch._scaled_mm takes two scalar scales or two vectors (rowwise): a scalar beside a
        # vector (the experts' row scales against a weight's) is spread to a vector of its value
        if axis_a is None:
            a, axis_a = Operand(a.data, a.scale.reshape(1, 1).expand(a.shape[0], 1), a.role, a.orig_dtype), -1
        else:
            b, axis_b = Operand(b.data, b.scale.reshape(1, 1).expand(1, b.shape[1]), b.role, b.orig_dtype), 0
    if axis_a is not False and axis_b is not False:
        return torch.mm(_to_torchao(a, mm_config, axis_a), _to_torchao(b, mm_config, axis_b))
    # scales along the reduced dimension: the dequantized product (torchao's emulation formula)
    work = torch.float32 if emulate else out_dtype
    return torch.mm(a.dequantize(work), b.dequantize(work)).to(out_dtype)


def mm_config(emulate: bool):
    """torchao's LinearMMConfig for the three GEMMs of a linear layer: the forward with fast
    accumulation, the two backward GEMMs without (torchao's Float8Linear defaults); inner
    dimensions padded to 16 for torch._scaled_mm where they are not."""
    t = backend.float8().tensor
    return t.LinearMMConfig(t.ScaledMMConfig(emulate, True, False, not emulate),
                            t.ScaledMMConfig(emulate, False, False, not emulate),
                            t.ScaledMMConfig(emulate, False, False, not emulate))


__all__ = ["Operand", "amax_to_scale", "cast", "cast_kernel", "compiled_scaled_cast", "gemm", "mm_config"]
