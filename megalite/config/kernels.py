"""Which kernels compute the model: the attention backend and the fused cross entropy. They change
speed and memory, never the function, so checkpoints do not record them (GPTConfig does)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


@dataclass
class KernelConfig:
    """kernels"""
    # core attention: auto | flash | fused | unfused | local (model/attention.py)
    attention_backend: str = flag(
        "--attention-backend", "auto",
        "core attention: auto (torch SDPA picks its kernel; flash-attn with --use-flash-attn), flash (SDPA's "
        "FlashAttention kernel, or the flash-attn package with --use-flash-attn), fused (SDPA's cuDNN / "
        "memory-efficient kernels; CUDA only), unfused (SDPA's math path), local (megalite's explicit "
        "softmax(QK^T/sqrt(d))V); a backend the device cannot run is refused at start-up", choices=ATTENTION_BACKENDS)
    attention_softmax_in_fp32: bool = flag(
        "--attention-softmax-in-fp32", False, "--attention-backend local with --bf16 / --fp16: the masked softmax in "
        "fp32 instead of the activations' dtype (Megatron-LM's; SDPA's kernels choose their own precision, fp32 in the "
        "fused ones, so the flag acts on the local backend only)", action="store_true")
    use_flash_attn: bool = flag("--use-flash-attn", False, "flash-attn kernels (needs the flash-attn package and "
                                "CUDA)", action="store_true")
    # the vocabulary-parallel cross entropy with its two sum all-reduces fused (tensor_parallel/cross_entropy.py)
    cross_entropy_loss_fusion: bool = flag(
        "--cross-entropy-loss-fusion", False, "the fused vocabulary-parallel cross entropy (one all-reduce of "
        "[target logit, sum of exp] instead of two; on a GPU with Triton its passes over 16-bit logits compiled, "
        "one kernel each; the same loss)", action="store_true")
    cross_entropy_fusion_impl: str = flag(
        "--cross-entropy-fusion-impl", "native", "the fused cross entropy's implementation: native (megalite's); te "
        "(Transformer Engine's, which megalite does not use: the native one runs, with a notice)",
        choices=["native", "te"])

    disable_bf16_reduced_precision_matmul: bool = flag(
        "--disable-bf16-reduced-precision-matmul", False, "CUDA bf16 GEMMs accumulate their split-K partial sums in "
        "fp32, never in bf16 (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False; no effect "
        "on the CPU)", action="store_true")

    # experts (model/moe/experts.py)
    moe_grouped_gemm: bool = flag(
        "--moe-grouped-gemm", False, "each MoE layer's local experts as one torch._grouped_mm per projection instead "
        "of a loop over experts (the same numbers; the loop where the shapes are not 16-byte aligned)",
        action="store_true")
    moe_pad_expert_input_to_capacity: bool = flag(
        "--moe-pad-expert-input-to-capacity", False, "with --moe-expert-capacity-factor: each expert's input padded "
        "to exactly its capacity with zero-weight rows (static shapes; the same function)", action="store_true")
    # Megatron-LM's fp16 overflow guard (DotProductAttention's coeff = layer number): the same function
    apply_query_key_layer_scaling: bool = flag(
        "--apply-query-key-layer-scaling", False, "Q·K^T scaled by 1/(sqrt(d) x layer number) in the activations' "
        "dtype, then upcast to fp32 and multiplied back before the softmax (Megatron-LM's fp16 overflow guard; "
        "turns on --attention-softmax-in-fp32). Acts on --attention-backend local, whose scores megalite computes; "
        "SDPA's kernels keep their scores in fp32 already", action="store_true")


__all__ = ["ATTENTION_BACKENDS", "KernelConfig"]
