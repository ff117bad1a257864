"""What an FP8 run casts, to which format, and how scales are found: the flags as one record.

Each GEMM of a linear layer, Y = X·Wᵀ, has three FP8 operands (Micikevicius et al. 2022, "FP8
Formats for Deep Learning", Sec. 3): the input X and the weight W (forward, and W again for the
input gradient dX = dY·W) and the output gradient dY (both backward GEMMs, with X again for the
weight gradient dW = dYᵀ·X). `--fp8-format hybrid` casts X and W to E4M3 (3 mantissa bits, range
±448) and dY to E5M2 (2 mantissa bits, range ±57344: gradients need the range more than the
precision); `e4m3` casts all three to E4M3. A scale s maps a tensor into the format's range:
fp8 = saturate(x·s), x ≈ fp8 / s.

How s is found (`--fp8-recipe`):
  tensorwise  per tensor, from its own amax: s = max_fp8 / amax (Transformer Engine's
              Float8CurrentScaling, torchao's tensorwise recipe);
  delayed     per tensor, from the amaxes of earlier iterations (fp8/delayed.py; Transformer
              Engine's DelayedScaling): s = max_fp8 / amax_history / 2^margin;
  blockwise   per tile: 1x128 tiles of X and dY along the reduced dimension, 128x128 blocks of W
              (DeepSeek-V3 technical report, Sec. 3.3.2), fp8/blockwise.py.
`--no-fp8-wgrad` computes dW from the unscaled X and dY (Transformer Engine's
override_linear_precision's third entry)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..config.fp8 import FP8Config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Role(enum.Enum):
    """An operand's part in the three GEMMs of a linear layer."""
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


@dataclass(frozen=True)
class Recipe:
    scaling: str  # tensorwise | delayed | blockwise
    fp8_format: str  # e4m3 | hybrid
    wgrad: bool = True  # dW in FP8 (else from the unscaled operands)
    margin: int = 0  # delayed: scales divided by 2^margin
    history_len: int = 1  # delayed: iterations of amax history
    amax_compute_algo: str = "most_recent"  # delayed: max | most_recent
    emulate: bool = True  # no FP8 tensor cores here: the same casts, an fp32 product

    @classmethod
    def from_config(cls, config: FP8Config, emulate: bool) -> "Recipe":
        return cls(config.fp8_recipe, config.fp8_format, config.fp8_wgrad, config.fp8_margin,
                   config.fp8_amax_history_len, config.fp8_amax_compute_algo, emulate)

    def dtype(self, role: Role) -> torch.dtype:
        return E5M2 if role is Role.GRAD_OUTPUT and self.fp8_format == "hybrid" else E4M3

    @property
    def blockwise(self) -> bool:
        return self.scaling == "blockwise"

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    def describe(self) -> str:
        fmt = "E4M3 forward, E5M2 gradients" if self.fp8_format == "hybrid" else "E4M3 everywhere"
        how = {"tensorwise": "per-tensor current scaling", "blockwise": "1x128 / 128x128 block scaling",
               "delayed": f"delayed scaling (amax history {self.history_len}, {self.amax_compute_algo}, "
                          f"margin {self.margin})"}[self.scaling]
        extras = [] if self.wgrad else ["weight gradients unscaled"]
        gemm = "emulated (fp32 products of the FP8 values)" if self.emulate else "torch._scaled_mm"
        return f"{fmt}, {how}{''.join(', ' + e for e in extras)}; GEMMs {gemm}"


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


__all__ = ["E4M3", "E5M2", "Recipe", "Role", "fp8_max"]
