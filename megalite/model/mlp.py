"""The dense MLP of a transformer layer (and the shared expert of an MoE layer)."""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .config import ExecutionConfig, GPTConfig


class MLP(nn.Module):
    """h -> ffn -> h. fc1 is column-parallel, fc2 row-parallel; SwiGLU (Shazeer 2020, Eq. 6)
    fuses [gate; up] into fc1 with stride 2, so each rank holds its slice of both halves."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, device=None):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=execution.sequence_parallel,
                      dtype=execution.params_dtype, device=device)
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_out, init_std=std,
                                               stride=2 if self.swiglu else 1, **common)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, init_std=out_std, **common)

    def forward(self, x):
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.linear_fc2(y)
