"""Quantized Hugging Face checkpoints read as full-precision weights: the released DeepSeek-V3 /
V3.1 / V3.2 checkpoints (and others with transformers' FineGrainedFP8 format) store their linear
weights in FP8 with one fp32 scale per block of the weight, and training starts from the
dequantized values.

    config.json: "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                         "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    tensors:     <name>.weight            [n, k] float8_e4m3fn
                 <name>.weight_scale_inv  [ceil(n / 128), ceil(k / 128)] float32

    weight[i, j] = fp8[i, j] x scale_inv[i // 128, j // 128]

(DeepSeek-V3's inference/kernel.py `weight_dequant`: the last block of a side that 128 does not
divide is partial, e.g. the [576, 7168] kv_a_proj_with_mqa.) Activation scales are an inference
matter: only the dynamic scheme (none stored) is read. Other quantization methods are refused."""
from __future__ import annotations

import math

import torch

_SCALE = ".weight_scale_inv"


def dequantize_weights(hf: dict[str, torch.Tensor], quantization: dict | None, refuse) -> dict[str, torch.Tensor]:
    """`hf` (tensors by name, read as fp32: FP8 values convert exactly) with every block-scaled FP8
    weight multiplied out and its scale dropped; `quantization` is config.json's
    quantization_config (None: `hf` as it is). `refuse(what)` raises for what cannot be read."""
    if not quantization:
        if any(k.endswith(_SCALE) for k in hf):
            refuse(f"FP8 scales ({next(k for k in hf if k.endswith(_SCALE))}) without a quantization_config")
        return hf
    method = quantization.get("quant_method")
    if method != "fp8":
        refuse(f"quantization_config quant_method {method!r} (megalite reads block-scaled FP8, quant_method 'fp8')")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        refuse(f"FP8 activation_scheme {quantization['activation_scheme']!r} (only 'dynamic', no stored "
               "activation scales)")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        refuse(f"FP8 weight_block_size {block!r} (two positive integers expected: per-tensor scales are not read)")
    for key in [k for k in hf if k.endswith(_SCALE)]:
        name = key[:-len(_SCALE)] + ".weight"
        if name not in hf:
            refuse(f"{key} without its weight {name}")
        hf[name] = _dequantize(hf[name], hf.pop(key), block, name, refuse)
    return hf


def _dequantize(w: torch.Tensor, scale: torch.Tensor, block, name: str, refuse) -> torch.Tensor:
    """w [n, k] x scale [ceil(n / b0), ceil(k / b1)], each scale over its block (the last ones partial)."""
    if w.dim() != 2:
        refuse(f"FP8 weight {name} of shape {list(w.shape)} (2-D block-scaled weights expected)")
    grid = [math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])]
    if list(scale.shape) != grid:
        refuse(f"{name}'s scale of shape {list(scale.shape)} for a weight of shape {list(w.shape)} in blocks of "
               f"{list(block)} ({grid} expected)")
    full = scale.float().repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
    return w.float() * full


__all__ = ["dequantize_weights"]
