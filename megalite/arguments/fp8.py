"""The --fp8-* flags (config/fp8.py): what they need and what they cannot be combined with.

FP8 runs through torchao, an optional dependency (megalite[fp8]): a run that asks for FP8
without it is refused naming the package. Megatron-LM's own rules come first (delayed scaling
keeps no layer in bf16, the bf16 layer counts fit a pipeline stage, --fp8-param-gather needs the
distributed optimizer, --fp8-output-proj needs mxfp8); then what megalite has no path for
(mxfp8, custom quantizers, FP8 all-gather of block-scaled weights), each refused in one line; a
recipe's own flags given to another recipe are refused, not ignored."""
from __future__ import annotations

import importlib.util

from ..config.fp8 import FP8Config
from ..config.run import RunConfig
from ..config.sharding import get_strategy
from .errors import fail, flag

TORCHAO_PIN = "torchao==0.18.0"  # the version setup.cfg's fp8 extra pins
DELAYED_ONLY = ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_fp8(c: RunConfig) -> None:
    f = c.fp8
    given = [name for name in _fields() if f"fp8.{name}" in c.explicit]
    if not f.enabled:
        if given:
            fail(f"{flag(given[0])} needs --fp8-format (FP8 training is off without it)")
        return
    if not torchao_installed():
        fail(f"--fp8-format needs torchao, which is not installed (pip install 'megalite[fp8]', i.e. {TORCHAO_PIN}); "
             f"drop the --fp8-* flags to train in bf16")
    recipe = f.fp8_recipe
    if recipe == "mxfp8":
        fail("--fp8-recipe mxfp8 is not supported: MXFP8's 32-element block scales need Blackwell GPUs (compute "
             "capability 10), and megalite has no MXFP8 path; use --fp8-recipe tensorwise, delayed or blockwise")
    if recipe == "custom":
        fail("--fp8-recipe custom is not supported: it loads a Transformer Engine quantizer factory "
             "(--fp8-quantizer-factory), which has no counterpart here; use tensorwise, delayed or blockwise")
    if f.fp8_quantizer_factory is not None:
        fail("--fp8-quantizer-factory is read by --fp8-recipe custom only (refused here); drop it")
    if f.fp8_output_proj:
        fail("--fp8-output-proj needs --fp8-recipe mxfp8 (Megatron-LM's rule), which megalite does not support; "
             "the output layer stays in bf16")
    if recipe != "delayed":
        for name in DELAYED_ONLY:
            if getattr(f, name) != getattr(FP8Config(), name):
                fail(f"{flag(name)} sets delayed scaling, not --fp8-recipe {recipe}; drop it or use --fp8-recipe "
                     f"delayed")
    _check_bf16_layers(c)
    if f.fp8_interval != 1:
        c.notices.append(f"--fp8-interval {f.fp8_interval}: deprecated in Megatron-LM and ignored by Transformer "
                         f"Engine 1.8 and later; megalite updates FP8 scales every iteration too")
    if f.fp8_param_gather:
        if not get_strategy(c.ddp.data_parallel_sharding_strategy).shards_optimizer:
            fail("--fp8-param-gather needs --use-distributed-optimizer (or a --data-parallel-sharding-strategy other "
                 "than no_shard): it all-gathers FP8 weights after the sharded optimizer step, as in Megatron-LM")
        # Megatron-LM's flag moves the gathered weights as FP8 bytes, cast from the fp32 masters;
        # here the gather carries the 16-bit weights and each GEMM casts them with the same recipe
        c.notices.append("--fp8-param-gather: the sharded optimizer's all-gather carries the 16-bit weights (an FP8 "
                         "all-gather is not built here); each GEMM casts them to FP8 with the same recipe")
    if c.model.num_experts and c.kernels.moe_grouped_gemm:
        c.notices.append("--moe-grouped-gemm with --fp8-format: the experts' FP8 GEMMs run one expert at a time "
                         "(a kernel choice: the same function)")


def _check_bf16_layers(c: RunConfig) -> None:
    f = c.fp8
    if not f.first_last_layers_bf16:
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if f"fp8.{name}" in c.explicit:
                fail(f"{flag(name)} needs --first-last-layers-bf16")
        return
    if f.fp8_recipe == "delayed":
        fail("--first-last-layers-bf16 is not supported with --fp8-recipe delayed (Megatron-LM's rule: delayed "
             "scaling keeps every layer in FP8); use --fp8-recipe tensorwise or blockwise")
    per_stage = c.model.num_layers // c.parallel.pipeline_model_parallel_size
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        n = getattr(f, name)
        if not 0 <= n <= per_stage:
            fail(f"{flag(name)} ({n}) must be between 0 and the layers per pipeline stage ({per_stage})")


def _fields() -> list[str]:
    from dataclasses import fields
    return [fl.name for fl in fields(FP8Config) if fl.name != "fp8_format"]


__all__ = ["TORCHAO_PIN", "check_fp8", "torchao_installed"]
