"""Quantized Hugging Face checkpoints read as full-precision weights: training starts from the
dequantized values. Two released formats:

FP8 with block scales: DeepSeek-V3 / V3.1 / V3.2 (and others in transformers' FineGrainedFP8
format) store their linear weights in FP8 with one fp32 scale per block of the weight.

    config.json: "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                         "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    tensors:     <name>.weight            [n, k] float8_e4m3fn
                 <name>.weight_scale_inv  [ceil(n / 128), ceil(k / 128)] float32

    weight[i, j] = fp8[i, j] x scale_inv[i // 128, j // 128]

(DeepSeek-V3's inference/kernel.py `weight_dequant`: the last block of a side that 128 does not
divide is partial, e.g. the [576, 7168] kv_a_proj_with_mqa.) Activation scales are an inference
matter: only the dynamic scheme (none stored) is read.

MXFP4 (OCP microscaling; gpt-oss's routed experts): 32 FP4 (e2m1) values per block share one
power-of-two scale.

    config.json: "quantization_config": {"quant_method": "mxfp4", ...}
    tensors:     <name>_blocks [..., rows, k / 32, 16] uint8  (two e2m1 values a byte, the low nibble first)
                 <name>_scales [..., rows, k / 32]     uint8  (e8m0: the scale is 2^(byte - 127))

    <name> = (e2m1 values x 2^(scale - 127)) [..., rows, k], transposed to [..., k, rows]: the
    [experts, in, out] layout of transformers' GptOssExperts (and of megalite's gpt_oss.py table).

Other quantization methods are refused."""
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
    if method == "mxfp4":
        return _mxfp4_weights(hf, refuse)
    if method != "fp8":
        refuse(f"quantization_config quant_method {method!r} (megalite reads block-scaled FP8, quant_method 'fp8', "
               "and MXFP4, 'mxfp4')")
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


# e2m1's sixteen values: sign, two exponent bits, one mantissa bit (OCP MX spec, Table 5)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4_weights(hf: dict[str, torch.Tensor], refuse) -> dict[str, torch.Tensor]:
    for key in [k for k in hf if k.endswith("_blocks")]:
        name = key[:-len("_blocks")]
        scales = hf.pop(name + "_scales", None)
        if scales is None:
            refuse(f"{key} without its scales {name}_scales")
        hf[name] = _dequantize_mxfp4(hf.pop(key), scales, name, refuse)
    if any(k.endswith("_scales") for k in hf):
        refuse(f"{next(k for k in hf if k.endswith('_scales'))} without its blocks")
    return hf


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str, refuse) -> torch.Tensor:
    """blocks [..., rows, g, 16] (bytes, read as floats) and scales [..., rows, g] -> [..., g * 32, rows]."""
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        refuse(f"MXFP4 {name}_blocks of shape {list(blocks.shape)} with scales of shape {list(scales.shape)} "
               "([..., rows, k / 32, 16] and [..., rows, k / 32] expected)")
    codes = blocks.to(torch.uint8).long()
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # [..., rows, g, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous()


__all__ = ["dequantize_weights"]
