"""The precision-aware optimizer's dtypes (Megatron-LM's --use-precision-aware-optimizer family)
and --qk-clip: what they need and what they cannot be combined with."""
from __future__ import annotations

from ..config.run import RunConfig
from .errors import fail

PRECISION_FLAGS = {"main_grads_dtype": "--main-grads-dtype", "main_params_dtype": "--main-params-dtype",
                   "exp_avg_dtype": "--exp-avg-dtype", "exp_avg_sq_dtype": "--exp-avg-sq-dtype"}


def check_optimizer_precision(c: RunConfig) -> None:
    """Megatron-LM's rules (megatron/core/optimizer/optimizer_config.py): a dtype other than fp32
    only with --use-precision-aware-optimizer, which steps Adam (here Muon too: its momentum takes
    --exp-avg-dtype, its scalar Adam both moments' dtypes); its choice of fp8 moments runs
    Transformer Engine's scaled-fp8 kernels, which have no counterpart here, and so does its fp16 second moment
(unscaled, it underflows). Unlike Megatron-LM it
    works without the distributed optimizer too (every sharding strategy stores the same dtypes)."""
    o, d = c.optimizer, c.ddp
    if not o.use_precision_aware_optimizer:
        for key, name in PRECISION_FLAGS.items():
            if getattr(o, key) != "fp32":
                fail(f"{name} {getattr(o, key)} needs --use-precision-aware-optimizer ({name} can only be fp32 "
                     "without it)")
        return
    if o.optimizer == "sgd":
        fail("--use-precision-aware-optimizer is supported with --optimizer adam or muon (Megatron-LM: adam "
             "only; SGD's momentum has no dtype flag)")
    if o.optimizer == "muon" and o.muon_scalar_optimizer == "lion":
        fail("--use-precision-aware-optimizer with --muon-scalar-optimizer lion is not supported: Lion's moment has "
             "no dtype flag; use --muon-scalar-optimizer adam")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(o, key) == "fp8":
            fail(f"{PRECISION_FLAGS[key]} fp8 is not supported: Megatron-LM stores fp8 moments with Transformer "
                 "Engine's per-tensor-scaled kernels, which megalite does not have; use bf16 or fp16")
    if o.exp_avg_sq_dtype == "fp16":
        fail("--exp-avg-sq-dtype fp16 is not supported: Adam's second moment (1-beta2)*g^2 falls below fp16's "
             "smallest number (6e-8) for small gradients and the update m/(sqrt(v)+eps) then explodes; Megatron-LM's "
             "Transformer Engine kernel stores it scaled per tensor, which megalite does not; use bf16 (fp32's range)")
    if o.main_params_dtype == "fp16" and not (o.bf16 or o.fp16):
        fail("--main-params-dtype fp16 needs --bf16 or --fp16: fp32 parameters are their own master weights")
    if o.main_grads_dtype == "bf16" and not d.grad_reduce_in_bf16:
        fail("--main-grads-dtype bf16 needs --grad-reduce-in-bf16: the optimizer reads the reduced gradient buffer, "
             "which is fp32 without it (Megatron-LM: not with --accumulate-allreduce-grads-in-fp32)")


def check_qk_clip(c: RunConfig) -> None:
    o, m = c.optimizer, c.model
    if not o.qk_clip:
        for key, name in (("qk_clip_alpha", "--qk-clip-alpha"), ("qk_clip_threshold", "--qk-clip-threshold")):
            if f"optimizer.{key}" in c.explicit:
                fail(f"{name} needs --qk-clip")
        return
    if m.multi_latent_attention:
        fail("--qk-clip with --multi-latent-attention is not supported: clipping MLA's up-projections (Kimi K2's "
             "per-head form) is not implemented; use standard attention, or drop --qk-clip")
    ring_or_heads = sorted(set(c.parallel.cp_comm_type) - {"allgather"})
    if c.parallel.context_parallel_size > 1 and ring_or_heads:
        fail(f"--qk-clip with --cp-comm-type {' '.join(ring_or_heads)} is not supported: the largest logit is "
             "recomputed from each rank's queries against the whole sequence's keys, which only allgather holds "
             "(a2a splits the heads over CP, p2p never gathers the keys); use --cp-comm-type allgather")
    if m.qk_layernorm:
        fail("--qk-clip with --qk-layernorm would do nothing: the per-head norms undo any rescaling of the query "
             "and key projections; drop one of them")
