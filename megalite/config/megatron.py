"""Megatron-LM flags that megalite accepts as no-ops or refuses. They are parsed, so that a
Megatron-LM launch script gets one line saying why instead of argparse's "unrecognized arguments";
validation refuses each one set to a value megalite cannot honour (`REFUSED` says why)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag

_NOOP = "accepted, changes nothing: "
_KD = "knowledge distillation (Megatron-LM's ModelOpt teacher and KD losses) is not built"
_MUP = ("the Maximal Update Parametrization (µP: width-scaled initialisation, learning rates, Adam epsilon, 1/d "
        "attention and output logits) is not built")


@dataclass
class MegatronCompatConfig:
    """Megatron-LM flags megalite accepts as no-ops or refuses (docs/megatron.md)"""
    use_mcore_models: bool = flag("--use-mcore-models", False, _NOOP + "megalite has one model implementation, laid "
                                  "out and named as Megatron Core's GPTModel", action="store_true")
    log_validation_ppl_to_tensorboard: bool = flag(
        "--log-validation-ppl-to-tensorboard", False, _NOOP + "megalite always logs the validation perplexity",
        action="store_true")
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
    ckpt_format: str | None = flag(
        "--ckpt-format", None, "the format --save writes: megalite's own (the default: per-rank shards, loadable on "
        "any layout, optimizer state included) or torch_dist, Megatron-LM's (weights, iteration, consumed samples, "
        "LR schedule; megatron-core's dist_checkpointing.load reads it). --load reads either whatever this flag says; "
        "torch, zarr, torch_dcp and fsdp_dtensor are refused",
        choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])
    # ModelOpt knowledge distillation: not built
    export_te_mcore_model: bool = flag("--export-te-mcore-model", False, "refused: " + _KD, action="store_true")
    export_kd_teacher_load: str | None = flag("--export-kd-teacher-load", None, "refused: " + _KD, type=str)
    export_kd_cfg: str | None = flag("--export-kd-cfg", None, "refused: " + _KD, type=str)
    use_mup: bool = flag("--use-mup", False, "refused: " + _MUP, action="store_true")
    mup_base_hidden_size: int | None = flag("--mup-base-hidden-size", None, "refused: " + _MUP, type=int)
    # Megatron-LM's GPU kernels, overlaps, CUDA graphs and backends: one notice each (NOTICES)
    tp_comm_overlap: bool = flag("--tp-comm-overlap", False, "Transformer Engine's TP communication overlapped with "
                                 "the GEMMs (megalite's TP collectives run unoverlapped: a notice)", action="store_true")
    tp_comm_overlap_cfg: str | None = flag("--tp-comm-overlap-cfg", None, "--tp-comm-overlap's configuration file "
                                           "(a notice: nothing reads it here)", type=str)
    cuda_graph_impl: str = flag("--cuda-graph-impl", "none", "CUDA graph capture (megalite launches its kernels "
                                "eagerly: a notice)", choices=["none", "local", "transformer_engine", "full_iteration"])
    cuda_graph_modules: list | None = flag("--cuda-graph-modules", None, "what --cuda-graph-impl captures (a notice)",
                                           type=str, nargs="+")
    cuda_graph_warmup_steps: int | None = flag("--cuda-graph-warmup-steps", None, "iterations before CUDA graph "
                                               "capture (a notice)", type=int)
    te_rng_tracker: bool = flag("--te-rng-tracker", False, "Transformer Engine's RNG tracker, for CUDA graphs "
                                "(megalite's tracker runs: a notice)", action="store_true")
    use_transformer_engine_op_fuser: bool = flag("--use-transformer-engine-op-fuser", False, "Transformer Engine's "
                                                 "operation fuser (a notice)", action="store_true")
    persist_layer_norm: bool = flag("--no-persist-layer-norm", True, "apex's persistent layer norm kernel off "
                                    "(megalite never uses it: a notice)", action="store_false")
    overlap_p2p_comm_warmup_flush: bool = flag(
        "--overlap-p2p-communication-warmup-flush", False, "pipeline sends and receives overlapped with compute in "
        "the warm-up and flush (megalite's are batched and waited for: a notice)", action="store_true")
    overlap_moe_expert_parallel_comm: bool = flag(
        "--overlap-moe-expert-parallel-comm", False, "expert-parallel all-to-alls overlapped with another "
        "micro-batch's compute (megalite runs them in turn: a notice)", action="store_true")
    defer_embedding_wgrad_compute: bool = flag(
        "--defer-embedding-wgrad-compute", False, "the output layer's weight gradients deferred to the pipeline "
        "flush (megalite computes them in each backward: a notice)", action="store_true")
    wgrad_deferral_limit: int | None = flag("--wgrad-deferral-limit", None, "micro-batches whose weight gradients "
                                            "--defer-embedding-wgrad-compute defers (a notice)", type=int)
    overlap_param_gather_with_optimizer_step: bool = flag(
        "--overlap-param-gather-with-optimizer-step", False, "the first bucket's parameter all-gather overlapped "
        "with the optimizer step (megalite gathers after the step: a notice)", action="store_true")
    disable_gloo_process_groups: bool = flag(
        "--disable-gloo-process-groups", False, "no auxiliary gloo groups beside NCCL's (megalite creates none; on "
        "CPU gloo is the backend itself: a notice)", action="store_true")
    use_layer_wise_param_layout: bool = flag(
        "--no-use-layer-wise-param-layout", True, "distributed Muon's precomputed parameter layout off (megalite's "
        "Muon assembles each matrix at its owner: a notice)", action="store_false")
    # Megatron-LM's checkpoint machinery that megalite's saves make moot: a notice each
    use_persistent_ckpt_worker: bool = flag(
        "--use-persistent-ckpt-worker", False, "a persistent worker for --async-save (megalite's writes from a "
        "background thread of the training process: a notice)", action="store_true")
    async_strategy: str | None = flag("--async-strategy", None, "which --async-save implementation (nvrx, mcore; "
                                      "megalite's background thread runs: a notice)", choices=["nvrx", "mcore"])
    async_ckpt_use_cpu_shm: bool = flag(
        "--async-ckpt-use-cpu-shm", False, "tensors copied to CPU shared memory for the async worker (megalite's "
        "background thread writes host copies: a notice)", action="store_true")
    ckpt_assume_constant_structure: bool = flag(
        "--ckpt-assume-constant-structure", False, "reuse the first save's plan for later ones (megalite plans a "
        "save from the run's layout, no collective to cache: a notice)", action="store_true")


# kernel choices with no counterpart here: field -> (its flag as given, what runs instead); each set
# one gets a notice line (arguments/validation.py), none changes the function
KERNEL_NOTICES = {
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", "megalite's attention softmax is never fused"),
    "bias_gelu_fusion": ("--no-bias-gelu-fusion", "megalite adds biases and applies the activation unfused"),
    "bias_dropout_fusion": ("--no-bias-dropout-fusion", "megalite adds bias, dropout and residual unfused"),
    "export_force_local_attention": ("--export-force-local-attention", "megalite's own attention runs"),
    "moe_permute_fusion": ("--moe-permute-fusion", "megalite permutes tokens with PyTorch index_select / index_add"),
    "moe_router_fusion": ("--moe-router-fusion", "megalite's PyTorch router (the same top-k and losses) runs"),
    "persist_layer_norm": ("--no-persist-layer-norm", "megalite's norms are PyTorch's own"),
    "use_transformer_engine_op_fuser": ("--use-transformer-engine-op-fuser", "megalite's own layers run unfused"),
    "te_rng_tracker": ("--te-rng-tracker", "megalite's RNG tracker gives the dropout masks"),
}
# overlaps, CUDA graphs and backends with no counterpart here: field -> (flag, what happens instead);
# a notice each when set, none changes the function (as KERNEL_NOTICES)
SCHEDULE_NOTICES = {
    "tp_comm_overlap": ("--tp-comm-overlap", "megalite's tensor-parallel collectives run between the GEMMs"),
    "tp_comm_overlap_cfg": ("--tp-comm-overlap-cfg", "nothing reads it (no --tp-comm-overlap here)"),
    "cuda_graph_impl": ("--cuda-graph-impl", "megalite launches its kernels eagerly, without CUDA graphs"),
    "cuda_graph_modules": ("--cuda-graph-modules", "nothing is captured (no CUDA graphs here)"),
    "cuda_graph_warmup_steps": ("--cuda-graph-warmup-steps", "nothing is captured (no CUDA graphs here)"),
    "overlap_p2p_comm_warmup_flush": ("--overlap-p2p-communication-warmup-flush",
                                      "pipeline sends and receives are batched and waited for in each phase"),
    "overlap_moe_expert_parallel_comm": ("--overlap-moe-expert-parallel-comm",
                                         "the expert-parallel all-to-alls run in turn with the compute"),
    "defer_embedding_wgrad_compute": ("--defer-embedding-wgrad-compute",
                                      "the output layer's weight gradient is computed in each backward"),
    "wgrad_deferral_limit": ("--wgrad-deferral-limit", "nothing is deferred (see --defer-embedding-wgrad-compute)"),
    "overlap_param_gather_with_optimizer_step": ("--overlap-param-gather-with-optimizer-step",
                                                 "the parameter all-gather follows the optimizer step"),
    "disable_gloo_process_groups": ("--disable-gloo-process-groups",
                                    "megalite creates no auxiliary gloo groups (on CPU gloo is the backend)"),
    "use_layer_wise_param_layout": ("--no-use-layer-wise-param-layout",
                                    "megalite's Muon assembles each matrix at the rank that owns it"),
    "use_persistent_ckpt_worker": ("--use-persistent-ckpt-worker",
                                   "megalite's --async-save writes from a background thread of the training process"),
    "async_strategy": ("--async-strategy", "megalite's --async-save writes from a background thread"),
    "async_ckpt_use_cpu_shm": ("--async-ckpt-use-cpu-shm", "megalite's background thread writes host copies"),
    "ckpt_assume_constant_structure": ("--ckpt-assume-constant-structure",
                                       "megalite plans each save from the run's layout, with no collective to cache"),
}

# the fields refused whenever they are set (to anything but their default): field -> what is
# missing (the capability other work builds, or that megalite does not have)
PENDING = {
    **dict.fromkeys(("export_te_mcore_model", "export_kd_teacher_load", "export_kd_cfg"), _KD),
    **dict.fromkeys(("use_mup", "mup_base_hidden_size"), _MUP),
}

__all__ = ["MegatronCompatConfig", "KERNEL_NOTICES", "SCHEDULE_NOTICES", "PENDING"]
