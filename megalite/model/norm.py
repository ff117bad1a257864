"""LayerNorm and RMSNorm (--normalization): the pre-norms of every layer, the final norm, and
--qk-layernorm's norms over each attention head's query and key."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import set_init
from ..tensor_parallel.param_info import param_info
from .config import ExecutionConfig, GPTConfig


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension (`size`, default the hidden size), with
    PyTorch's fused kernels. Its parameters are replicated across TP; their gradient is a partial
    sum on each TP rank, marked for a TP all-reduce (ParamInfo.sequence_parallel), when the rank
    sees only part of what the norm normalises: a slice of the sequence under sequence
    parallelism, or (`head_sharded`, --qk-layernorm's q/k norms) this rank's attention heads.

    --apply-layernorm-1p (Megatron-LM's LayerNorm1P, Transformer Engine's zero_centered_gamma):
    the weight is stored as w - 1, initialised to 0, and applied as 1 + w. The function and its
    gradients are the same; a weight near 0 keeps more precision in bf16 than one near 1."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, device=None, size: int | None = None,
                 head_sharded: bool = False):
        super().__init__()
        h, dtype = config.hidden_size if size is None else size, execution.params_dtype
        self.kind, self.eps = config.normalization, config.norm_epsilon
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {self.kind!r}")
        self.zero_centered = config.apply_layernorm_1p
        # a TP all-reduce of a replicated weight's gradient (free at TP 1: comm skips size-one groups)
        partial_grad = execution.sequence_parallel or head_sharded
        self.weight = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
        set_init(self.weight, "zeros" if self.zero_centered else "ones")
        param_info(self.weight).sequence_parallel = partial_grad
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
            set_init(self.bias, "zeros")
            param_info(self.bias).sequence_parallel = partial_grad
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (x.size(-1),), weight, self.bias, self.eps)
        return F.rms_norm(x, (x.size(-1),), weight, self.eps)
