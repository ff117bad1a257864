"""The dense MLP of a transformer layer (and the shared expert of an MoE layer)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .config import ExecutionConfig, GPTConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·sigmoid(1.702·x): GeLU's sigmoid approximation (Hendrycks & Gimpel 2016, Sec. 2;
    Megatron-LM's quick_gelu, gpt-oss's alpha 1.702)."""
    return x * torch.sigmoid(1.702 * x)


def glu(y: torch.Tensor, activation, offset: float = 0.0, clamp: float | None = None) -> torch.Tensor:
    """A gated linear unit of fc1's output [gate; up] (Shazeer 2020): activation(gate) · (up + offset),
    as Megatron-LM's gated MLP; with `clamp` (gpt-oss's limit) the gate is first clamped to at most
    `clamp` and up to [-clamp, clamp] (transformers' GptOssExperts), bounding the product."""
    gate, up = y.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return activation(gate) * (up + offset) if offset else activation(gate) * up


def activation(config: GPTConfig):
    """fc1's output -> fc2's input for `config`'s MLP: SwiGLU, quick-GeGLU, squared ReLU or GeLU
    (--openai-gelu: the tanh approximation). Gated ones expect fc1's output as [gate; up] (2 x ffn wide)."""
    if config.swiglu:
        return lambda y: glu(y, F.silu, config.glu_linear_offset)
    if config.quick_geglu:
        return lambda y: glu(y, quick_gelu, config.glu_linear_offset, config.activation_func_clamp_value)
    if config.squared_relu:  # Megatron-LM's activations.squared_relu
        return lambda y: torch.pow(F.relu(y), 2)
    approximate = "tanh" if config.openai_gelu else "none"
    return lambda y: F.gelu(y, approximate=approximate)


class MLP(nn.Module):
    """h -> ffn -> h. fc1 is column-parallel, fc2 row-parallel; a gated MLP (SwiGLU, Shazeer 2020,
    Eq. 6, or quick-GeGLU) fuses [gate; up] into fc1 with stride 2, so each rank holds its slice of
    both halves and applies the elementwise gate to its own columns."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, device=None):
        super().__init__()
        gated = config.gated_linear_unit
        self.activation = activation(config)
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=execution.sequence_parallel,
                      dtype=execution.params_dtype, device=device)
        fc1_out = config.ffn_hidden_size * (2 if gated else 1)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_out, init_std=std,
                                               stride=2 if gated else 1, **common)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, init_std=out_std, **common)

    def forward(self, x):
        return self.linear_fc2(self.activation(self.linear_fc1(x)))
