"""torchao, imported only when FP8 is asked for, and which GEMM runs on this device.

torchao (pytorch/ao) provides the FP8 casts and the scaled GEMM: `torchao.float8`'s
Float8TrainingTensor holds FP8 data and its scale, and `torch.mm` of two of them calls
`torch._scaled_mm` on a GPU with FP8 tensor cores (compute capability 8.9 and later: Ada, Hopper,
Blackwell) or, with `emulate=True`, computes the same casts' product in fp32 (dequantize, then
mm): the CPU path, on which every FP8 layout of megalite is tested. Its import logs warnings on a
CPU-only build (compiled kernels it cannot load there, an Enum registration); they are silenced
for the import."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings

import torch

# the loggers torchao's import writes to on a CPU-only torch: its own (".so" files it cannot load)
# and torch's pytree (an Enum registered twice)
_NOISY = ("torchao", "torch.utils._pytree")


def available() -> bool:
    """Whether torchao is installed (`pip install megalite[fp8]`)."""
    return importlib.util.find_spec("torchao") is not None


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def float8():
    """The torchao.float8 modules megalite uses, as a namespace: `tensor` (Float8TrainingTensor,
    GemmInputRole, LinearMMConfig, ScaledMMConfig, hp_tensor_and_scale_to_float8) and `utils`
    (amax_to_scale)."""
    with _quiet():
        from torchao.float8 import float8_training_tensor as tensor, float8_utils as utils
    return _Float8(tensor, utils)


class _Float8:
    def __init__(self, tensor, utils):
        self.tensor, self.utils = tensor, utils


def version() -> str:
    with _quiet():
        import torchao
    return torchao.__version__


def has_fp8_gemm(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs in hardware (torch._scaled_mm): CUDA compute capability
    8.9 or later. Elsewhere the casts are emulated (the same FP8 values, an fp32 product)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def is_blackwell(device: torch.device) -> bool:
    """Compute capability 10 or later: MX block scales (--fp8-recipe mxfp8) in the tensor cores."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 10


__all__ = ["available", "float8", "has_fp8_gemm", "is_blackwell", "version"]
