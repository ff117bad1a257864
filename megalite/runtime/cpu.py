"""What the host CPU computes fast: here, whether bf16 matrix multiplies are native.

Without AVX-512-BF16 or AMX, PyTorch's CPU kernels convert bf16 to fp32 element by element
inside the GEMM, while fp32 goes to the vendor BLAS: a 512x512 bf16 matrix multiply on one core
ran 70x slower than fp32 with the kernels limited to AVX2 (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2: 1.0 against 72 GFLOP/s) and 130x slower than fp32 with AVX-512, on a
Xeon that has AMX. --bf16 on such a CPU is correct but far too slow for more than tests, so
the run says so once at start-up.
"""
from __future__ import annotations

import functools

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (empty where there is none: not Linux, or no x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags=None) -> bool:
    flags = cpu_flags() if flags is None else flags
    if flags:
        return any(f in flags for f in NATIVE_BF16_FLAGS)
    # no cpuinfo: ask PyTorch which kernel set it dispatches to (AMX implies native bf16)
    return "AMX" in torch.backends.cpu.get_cpu_capability()


def slow_bf16_warning(device: torch.device, dtype: torch.dtype, flags=None) -> str | None:
    """The start-up warning for bf16 on a CPU without native bf16 arithmetic, or None."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16(flags):
        return None
    return ("> WARNING: --bf16 on a CPU without AVX512-BF16 or AMX (no avx512_bf16 / amx_bf16 in /proc/cpuinfo): "
            "bf16 matrix multiplies run tens to hundreds of times slower than fp32 here; train in fp32 on this CPU")
