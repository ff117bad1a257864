"""Megatron-LM flags that megalite accepts as no-ops or refuses. They are parsed, so that a
Megatron-LM launch script gets one line saying why instead of argparse's "unrecognized arguments";
validation refuses each one set to a value megalite cannot honour (`REFUSED` says why)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag

_NOOP = "accepted, changes nothing: "


@dataclass
class MegatronCompatConfig:
    """Megatron-LM flags megalite accepts as no-ops or refuses (docs/megatron.md)"""
    use_mcore_models: bool = flag("--use-mcore-models", False, _NOOP + "megalite has one model implementation, laid "
                                  "out and named as Megatron Core's GPTModel", action="store_true")
    log_validation_ppl_to_tensorboard: bool = flag(
        "--log-validation-ppl-to-tensorboard", False, _NOOP + "megalite always logs the validation perplexity",
        action="store_true")
    gradient_accumulation_fusion: bool = flag(
        "--no-gradient-accumulation-fusion", True, _NOOP + "megalite never fuses weight-gradient accumulation into "
        "the GEMM (Megatron-LM does with apex / Transformer Engine)", action="store_false")
    apply_rope_fusion: bool = flag("--no-rope-fusion", True, _NOOP + "megalite's RoPE is plain PyTorch, never a "
                                   "fused kernel", action="store_false")
    add_position_embedding: bool = flag(
        "--no-position-embedding", True, "accepted with --position-embedding-type rope, where it changes nothing (a "
        "RoPE model has no learned position table); refused otherwise, as Megatron-LM (deprecated: use "
        "--position-embedding-type)", action="store_false")
    transformer_impl: str | None = flag("--transformer-impl", None, "local is megalite's own layers; "
                                        "transformer_engine: megalite's own layers run instead, with a notice (its "
                                        "FP8: --fp8-*, through torchao)", choices=["local", "transformer_engine"])
    # Megatron-LM's kernel choices with no counterpart here: a notice says what runs (KERNEL_NOTICES)
    masked_softmax_fusion: bool = flag("--no-masked-softmax-fusion", True, "Megatron-LM's fused masked softmax off "
                                       "(megalite never fuses it: a notice)", action="store_false")
    bias_gelu_fusion: bool = flag("--no-bias-gelu-fusion", True, "Megatron-LM's fused bias + GeLU off (megalite "
                                  "never fuses it: a notice)", action="store_false")
    bias_dropout_fusion: bool = flag("--no-bias-dropout-fusion", True, "Megatron-LM's fused bias + dropout + add "
                                     "off (megalite never fuses it: a notice)", action="store_false")
    export_force_local_attention: bool = flag(
        "--export-force-local-attention", False, "Megatron-LM's local attention instead of Transformer Engine's for "
        "export (megalite's attention is its own: a notice)", action="store_true")
    moe_permute_fusion: bool = flag("--moe-permute-fusion", False, "Transformer Engine's fused token permutation "
                                    "(megalite's index_select / index_add runs: a notice)", action="store_true")
    moe_router_fusion: bool = flag("--moe-router-fusion", False, "Transformer Engine's fused router top-k and "
                                   "losses (megalite's PyTorch router runs: a notice)", action="store_true")
    moe_flex_dispatcher_backend: str | None = flag(
        "--moe-flex-dispatcher-backend", None, "--moe-token-dispatcher-type flex's backend (DeepEP or HybridEP "
        "kernels; megalite's alltoall dispatcher runs instead: a notice)", choices=["deepep", "hybridep"])
    accumulate_allreduce_grads_in_fp32: bool = flag(
        "--accumulate-allreduce-grads-in-fp32", False, _NOOP + "megalite accumulates and reduces gradients in fp32 "
        "already (unless --grad-reduce-in-bf16, which it contradicts)", action="store_true")
    moe_per_layer_logging: bool = flag(
        "--moe-per-layer-logging", False, _NOOP + "megalite always logs each MoE layer's losses and loads (the "
        "JSONL moe event, the trackers' moe section)", action="store_true")
    auto_detect_ckpt_format: bool = flag(
        "--auto-detect-ckpt-format", False, _NOOP + "megalite always detects the format of --load: its own and "
        "Megatron-LM's torch_dist are read, Megatron-LM's torch and zarr checkpoints are named and refused",
        action="store_true")
    rerun_mode: str | None = flag("--rerun-mode", None, "disabled is accepted; megalite has no re-run state machine, "
                                  "so the others are refused", choices=["disabled", "validate_results",
                                                                        "report_stats"])
    apply_query_key_layer_scaling: bool = flag(
        "--apply-query-key-layer-scaling", False, "refused: not implemented (an fp16 overflow guard that scales "
        "Q·K^T by 1/layer and back)", action="store_true")
    squared_relu: bool = flag("--squared-relu", False, "refused: megalite's MLP is GeLU or SwiGLU",
                              action="store_true")
    save_retain_interval: int | None = flag("--save-retain-interval", None, "refused: megalite keeps every "
                                            "checkpoint it saves", type=int)
    dist_ckpt_strictness: str | None = flag("--dist-ckpt-strictness", None, "refused: how Megatron-LM's torch_dist "
                                            "loader treats missing or unexpected keys; megalite's refuses missing ones",
                                            type=str)
    dist_ckpt_optim_fully_reshardable: bool = flag(
        "--dist-ckpt-optim-fully-reshardable", False, "refused: an option of torch_dist checkpoints; megalite's are "
        "always reshardable over TP, PP and DP, optimizer state included", action="store_true")
    use_persistent_ckpt_worker: bool = flag(
        "--use-persistent-ckpt-worker", False, "refused: megalite's --async-save writes from a thread, not a worker "
        "process", action="store_true")
    ckpt_format: str | None = flag(
        "--ckpt-format", None, "the format --save writes: megalite's own (the default: per-rank shards, loadable on "
        "any layout, optimizer state included) or torch_dist, Megatron-LM's (weights, iteration, consumed samples, "
        "LR schedule; megatron-core's dist_checkpointing.load reads it). --load reads either whatever this flag says; "
        "torch, zarr, torch_dcp and fsdp_dtensor are refused",
        choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])


# kernel choices with no counterpart here: field -> (its flag as given, what runs instead); each set
# one gets a notice line (arguments/validation.py), none changes the function
KERNEL_NOTICES = {
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", "megalite's attention softmax is never fused"),
    "bias_gelu_fusion": ("--no-bias-gelu-fusion", "megalite adds biases and applies the activation unfused"),
    "bias_dropout_fusion": ("--no-bias-dropout-fusion", "megalite adds bias, dropout and residual unfused"),
    "export_force_local_attention": ("--export-force-local-attention", "megalite's own attention runs"),
    "moe_permute_fusion": ("--moe-permute-fusion", "megalite permutes tokens with PyTorch index_select / index_add"),
    "moe_router_fusion": ("--moe-router-fusion", "megalite's PyTorch router (the same top-k and losses) runs"),
}

# the fields refused whenever they are set (to anything but their default); each flag's help says why
REFUSED_FLAGS = ("apply_query_key_layer_scaling", "squared_relu", "save_retain_interval", "dist_ckpt_strictness",
                 "dist_ckpt_optim_fully_reshardable", "use_persistent_ckpt_worker")

__all__ = ["MegatronCompatConfig", "KERNEL_NOTICES", "REFUSED_FLAGS"]
