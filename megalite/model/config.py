"""What a GPT model is built from: its architecture (`GPTConfig`, the part checkpoints record)
and how it executes (`ExecutionConfig`: dtype, sequence parallelism, activation recompute,
kernels), which changes speed and memory but never the function it computes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.model import GPTConfig, pad_vocab_size


@dataclass(frozen=True)
class ExecutionConfig:
    """Gathered from the sections that own each setting: OptimizerConfig (params_dtype),
    ParallelConfig (sequence_parallel), RecomputeConfig and KernelConfig (`from_configs`)."""
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    # activation recompute: None | "full" | "selective"; method "uniform" | "block"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple = ("core_attn",)  # with "selective" (model/transformer.py)
    offload_modules: tuple = ()  # --fine-grained-activation-offloading (model/offload.py)
    attention_backend: str = "auto"  # auto | flash | fused | unfused | local (model/attention.py)
    use_flash_attn: bool = False
    attention_softmax_in_fp32: bool = False  # --attention-backend local's softmax with 16-bit activations
    apply_query_key_layer_scaling: bool = False  # --attention-backend local: scores / layer number, back in fp32
    cross_entropy_loss_fusion: bool = False
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall (model/moe/dispatcher.py)
    moe_grouped_gemm: bool = False  # model/moe/experts.py
    moe_pad_expert_input_to_capacity: bool = False  # model/moe/router.py
    # --cp-comm-type: one name, or one per decoder layer (MTP layers take the last layer's);
    # context_parallel/__init__.py
    cp_comm_type: tuple = ("allgather",)

    def __post_init__(self):
        from ..config.parallel import RecomputeConfig  # the recompute fields' own checks
        RecomputeConfig(self.recompute_granularity, self.recompute_method, self.recompute_num_layers).check()

    @classmethod
    def from_configs(cls, optimizer, parallel, recompute, kernels) -> "ExecutionConfig":
        return cls(params_dtype=getattr(torch, optimizer.params_dtype), sequence_parallel=parallel.sequence_parallel,
                   recompute_granularity=recompute.recompute_granularity,
                   recompute_method=recompute.recompute_method, recompute_num_layers=recompute.recompute_num_layers,
                   recompute_modules=tuple(recompute.recompute_modules),
                   offload_modules=tuple(recompute.offload_modules)
                   if recompute.fine_grained_activation_offloading else (),
                   attention_backend=kernels.attention_backend, use_flash_attn=kernels.use_flash_attn,
                   attention_softmax_in_fp32=kernels.attention_softmax_in_fp32,
                   apply_query_key_layer_scaling=kernels.apply_query_key_layer_scaling,
                   cross_entropy_loss_fusion=kernels.cross_entropy_loss_fusion,
                   moe_token_dispatcher_type=parallel.moe_token_dispatcher_type,
                   moe_grouped_gemm=kernels.moe_grouped_gemm,
                   moe_pad_expert_input_to_capacity=kernels.moe_pad_expert_input_to_capacity,
                   cp_comm_type=tuple(parallel.cp_comm_type))

    def cp_comm_type_of(self, layer_number: int) -> str:
        """--cp-comm-type of 0-based layer `layer_number` (MTP layers, past the decoder's, take the last's)."""
        types = self.cp_comm_type
        return types[min(layer_number, len(types) - 1)] if len(types) > 1 else types[0]


def model_configs(**settings) -> tuple[GPTConfig, ExecutionConfig]:
    """(GPTConfig, ExecutionConfig) of keyword settings of either, for models built in code
    (tests, benchmarks): each setting goes to the config that has the field."""
    from dataclasses import fields
    arch = {f.name for f in fields(GPTConfig)}
    execution = {f.name for f in fields(ExecutionConfig)}
    unknown = set(settings) - arch - execution
    if unknown:
        raise TypeError(f"no GPTConfig or ExecutionConfig field named {', '.join(sorted(unknown))}")
    return (GPTConfig(**{k: v for k, v in settings.items() if k in arch}),
            ExecutionConfig(**{k: v for k, v in settings.items() if k in execution}))


__all__ = ["ExecutionConfig", "GPTConfig", "model_configs", "pad_vocab_size"]
