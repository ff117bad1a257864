"""FP8 training: Megatron-LM's --fp8-* flags (its TransformerConfig's fp8 fields), run through
torchao's float8 casts instead of Transformer Engine (megalite/fp8/). FP8 changes the function a
little (every GEMM operand rounded to 3 or 2 mantissa bits), so these flags are a section of their
own, recorded in checkpoints with the rest; the checkpoints themselves hold the bf16/fp32 masters
only, so a run of either precision resumes the other's."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")


@dataclass
class FP8Config:
    """fp8 (docs/fp8.md)"""
    fp8_format: str | None = flag(
        "--fp8-format", None, "FP8 GEMMs in the transformer layers' linears and experts (through torchao): e4m3 for "
        "every operand, or hybrid (E4M3 activations and weights, E5M2 gradients); needs torchao (pip install "
        "megalite[fp8])", choices=FP8_FORMATS)
    fp8_recipe: str = flag(
        "--fp8-recipe", "delayed", "how each FP8 operand is scaled: tensorwise (one scale per tensor from its own "
        "amax), delayed (one scale per tensor from the amax history of earlier iterations), blockwise (DeepSeek-V3's "
        "1x128 activation and gradient tiles, 128x128 weight blocks); mxfp8 needs Blackwell GPUs and custom a "
        "quantizer factory, both refused", choices=FP8_RECIPES)
    fp8_param_gather: bool = flag(
        "--fp8-param-gather", False, "Megatron-LM's all-gather of FP8 weights after the sharded optimizer step; here "
        "the gather carries the 16-bit weights and each GEMM casts them (a notice); needs --use-distributed-optimizer "
        "or a sharded --data-parallel-sharding-strategy", action="store_true")
    fp8_margin: int = flag("--fp8-margin", 0, "--fp8-recipe delayed: scales divided by 2^margin (headroom for "
                           "amaxes that grow)", check=(lambda v: v >= 0, "at least 0"))
    fp8_interval: int = flag("--fp8-interval", 1, "deprecated in Megatron-LM and ignored by Transformer Engine 1.8 "
                             "and later: scales are updated every iteration (a notice)",
                             check=(lambda v: v >= 1, "at least 1"))
    fp8_amax_history_len: int = flag("--fp8-amax-history-len", 1, "--fp8-recipe delayed: how many iterations' "
                                     "amaxes each scale is computed from", check=(lambda v: v >= 1, "at least 1"))
    fp8_amax_compute_algo: str = flag("--fp8-amax-compute-algo", "most_recent", "--fp8-recipe delayed: the amax a "
                                      "scale is computed from: the history's largest (max) or its latest "
                                      "(most_recent)", choices=AMAX_COMPUTE_ALGOS)
    fp8_wgrad: bool = flag("--no-fp8-wgrad", True, "weight gradients in the activations' precision instead of FP8 "
                           "(forward and input gradients stay FP8)", action="store_false")
    fp8_output_proj: bool = flag("--fp8-output-proj", False, "the output layer in FP8 too: Megatron-LM's "
                                 "--fp8-recipe mxfp8 only, so refused with it", action="store_true")
    fp8_quantizer_factory: str | None = flag("--fp8-quantizer-factory", None, "--fp8-recipe custom's Python "
                                             "quantizer factory: refused with it")
    first_last_layers_bf16: bool = flag(
        "--first-last-layers-bf16", False, "keep the first --num-layers-at-start-in-bf16 and the last "
        "--num-layers-at-end-in-bf16 transformer layers out of FP8", action="store_true")
    num_layers_at_start_in_bf16: int = flag("--num-layers-at-start-in-bf16", 1, "with --first-last-layers-bf16: "
                                            "transformer layers kept out of FP8 at the start")
    num_layers_at_end_in_bf16: int = flag("--num-layers-at-end-in-bf16", 1, "with --first-last-layers-bf16: "
                                          "transformer layers kept out of FP8 at the end")

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    def layer_in_fp8(self, layer_number: int, num_layers: int) -> bool:
        """Whether 0-based decoder layer `layer_number` of `num_layers` computes in FP8: all of them
        but, with --first-last-layers-bf16, the first and last few (Megatron-LM's
        is_first_last_bf16_layer). Multi-token prediction runs in FP8 whenever FP8 is on (its
        MTP block takes the global FP8 context)."""
        if not self.enabled:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 <= layer_number < num_layers - self.num_layers_at_end_in_bf16


__all__ = ["AMAX_COMPUTE_ALGOS", "FP8_FORMATS", "FP8_RECIPES", "FP8Config"]
