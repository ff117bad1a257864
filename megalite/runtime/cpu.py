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


# -- lean host memory ------------------------------------------------------------------------------
# glibc serves a freed block below its mmap threshold from the heap and keeps it there, and the
# threshold grows (up to 32 MiB on 64-bit) each time a larger mapped block is freed: after a few
# steps most freed tensors stay in the heap, counted in RSS (~115 MiB of a rank's peak in the
# memory-wall run, docs/zero.md). With a fixed threshold of 256 KiB every larger tensor is mapped
# and unmapped, so its memory returns to the system when it is freed. What glibc's own
# MALLOC_MMAP_THRESHOLD_ sets is left alone.
MMAP_THRESHOLD_BYTES = 256 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def _mallopt(device: torch.device, settings: list[tuple[int, int]], env: tuple[str, ...]) -> bool:
    """Set glibc's malloc parameters on a CPU run (once per process: glibc has no way back to its
    sliding thresholds, and none is needed); False where nothing was set (CUDA, another C library,
    the environment already sets one of `env`)."""
    import ctypes
    import os
    if torch.device(device).type != "cpu" or any(name in os.environ for name in env):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) for param, value in settings)
    except (OSError, AttributeError):  # not glibc
        return False


def lean_malloc(device: torch.device) -> str | None:
    """On a CPU run with glibc (setup asks for runs with a sharded strategy), fix the mmap
    threshold; returns what it did for the start-up line, or None where it did nothing."""
    if not _mallopt(device, [(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)], ("MALLOC_MMAP_THRESHOLD_",)):
        return None
    return f"freed tensors over {MMAP_THRESHOLD_BYTES // 1024} KiB go back to the system at once (glibc mallopt)"


# -- steady host memory for the zero-bubble schedules -----------------------------------------------
# A split backward (tensor_parallel/wgrad.py) keeps each linear's input and output gradient from B
# until W and frees them together; glibc then trims the top of its heap (its trim threshold slides
# with the mmap threshold, at most 64 MiB) and the next micro-batch maps the same memory again:
# 20-50 thousand minor page faults per iteration on each rank of the zero-bubble benchmark's PP2
# model, against none under 1F1B, whose backward frees each gradient as it goes
# (benchmarks/RESULTS_zero_bubble.md). Blocks under 32 MiB (glibc's largest mmap threshold) come
# from the heap and freed heap memory (up to 2 GiB at the top) is kept for reuse, as a caching allocator keeps a GPU's:
# the host memory held stays at the run's peak. What the environment sets is left alone.
STEADY_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
STEADY_TRIM_THRESHOLD_BYTES = 2 ** 31 - 1  # mallopt takes a C int: the largest, ~2 GiB


def steady_malloc(device: torch.device) -> str | None:
    """On a CPU run with glibc (setup asks for unsharded zero-bubble runs), keep freed heap memory
    for reuse; returns what it did for the start-up line, or None where it did nothing."""
    if not _mallopt(device, [(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD_BYTES),
                             (_M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD_BYTES)],
                    ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return None
    return (f"freed tensors under {STEADY_MMAP_THRESHOLD_BYTES // 2 ** 20} MiB stay in the heap for reuse "
            "(glibc mallopt; the split backward frees in bursts)")
