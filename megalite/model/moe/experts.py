"""The experts one rank holds: E/EP SwiGLU or GeLU MLPs, each split over the expert-tensor-
parallel group (ETP ranks, --expert-tensor-parallel-size; by default the TP group) like the
dense MLP over TP (fc1 column-parallel, [gate; up] with stride 2 for SwiGLU; fc2 row-parallel),
but without the collectives of the tensor-parallel linears: the dispatcher has already gathered
the ETP group's tokens, and the partial fc2 outputs are summed by its reduce-scatter. Each
weight records its (ETP rank, ETP) as `ParamInfo.split`, so initialisation and checkpoints cut
and reshard it over ETP, not TP.

Each expert's weights are parameters of their own, named by the global expert index
(`experts.local_experts.{e}.linear_fc1.weight`, Megatron-LM's SequentialMLP names), so
initialisation, checkpoints (resharding over EP included) and the Hugging Face conversion treat
them like any other weight. --moe-grouped-gemm stacks the local experts' weights and runs one
`torch._grouped_mm` per projection over the tokens sorted by expert; the loop computes the same
products one expert at a time. Every local expert runs, with zero tokens too, so each has a
gradient every micro-batch (gradient buckets count arrivals).

The grouped kernel serves where it is a kernel of its own (`GROUPED_MM_DEVICES`: CUDA). On the
CPU torch._grouped_mm is a loop of GEMMs itself, and slower than this module's (its backward
concatenates per-group gradients, the stacking copies every expert's weights each micro-batch:
a MoE layer's forward and backward took ~30% longer than the loop's for the benchmark's model,
benchmarks/RESULTS_moe.md), so there --moe-grouped-gemm runs the loop: the same products, the
same function."""
from __future__ import annotations

import math

import torch
from torch import nn

from ... import comm
from ...recompute import recompute
from ...tensor_parallel import set_init
from ...tensor_parallel.layers import set_tp_attributes
from ...tensor_parallel.param_info import param_info
from ...tensor_parallel.wgrad import grouped_mm, linear
from ..config import ExecutionConfig, GPTConfig
from ..mlp import activation


class Expert(nn.Module):
    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp: int, device=None):
        super().__init__()
        h, ffn = config.hidden_size, config.expert_ffn_hidden_size // tp
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        dtype, gated = execution.params_dtype, config.gated_linear_unit
        self.linear_fc1, self.linear_fc2 = nn.Module(), nn.Module()
        self.linear_fc1.weight = nn.Parameter(torch.empty(ffn * (2 if gated else 1), h, dtype=dtype, device=device))
        set_tp_attributes(self.linear_fc1.weight, 0, stride=2 if gated else 1)
        set_init(self.linear_fc1.weight, "normal", std)
        self.linear_fc2.weight = nn.Parameter(torch.empty(h, ffn, dtype=dtype, device=device))
        set_tp_attributes(self.linear_fc2.weight, 1)
        set_init(self.linear_fc2.weight, "normal", out_std)
        # biases unless --disable-bias-linear (Megatron-LM's experts, gpt-oss's): fc1's split over
        # TP with its output rows; fc2's whole, added by TP rank 0 alone (LocalExperts.forward) so
        # that the TP sum of the partial outputs counts it once; each TP rank's gradient is then a
        # partial sum (rank 0's the whole, the others' zero): summed over TP like a
        # sequence-parallel parameter's
        self.linear_fc1.bias = self.linear_fc2.bias = None
        if config.add_bias_linear:
            self.linear_fc1.bias = nn.Parameter(torch.empty(ffn * (2 if gated else 1), dtype=dtype, device=device))
            set_tp_attributes(self.linear_fc1.bias, 0, stride=2 if gated else 1)
            self.linear_fc2.bias = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
            param_info(self.linear_fc2.bias).sequence_parallel = tp > 1
            for b in (self.linear_fc1.bias, self.linear_fc2.bias):
                set_init(b, "zeros")
        for w in self.parameters():
            param_info(w).expert_parallel = True


# devices where torch._grouped_mm is a grouped kernel (elsewhere the loop is faster: see above)
GROUPED_MM_DEVICES = frozenset({"cuda"})


def grouped_mm_fits(*dims_and_dtype) -> bool:
    """torch._grouped_mm exists and its operands' rows are 16-byte aligned."""
    *dims, dtype = dims_and_dtype
    size = torch.empty((), dtype=dtype).element_size()
    return hasattr(torch, "_grouped_mm") and all(d * size % 16 == 0 for d in dims)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    y = torch._grouped_mm(x, w, offs=offs)
    if y.requires_grad:  # the kernel's backward refuses a broadcast (stride-0) gradient
        y.register_hook(lambda g: g.contiguous())
    return y


class LocalExperts(nn.Module):
    wgrad_store = None  # --delay-wgrad-compute: the weight gradients wait for W (tensor_parallel/wgrad.py)
    fp8 = None  # --fp8-format: the experts' FP8 GEMMs (model/moe/fp8_experts.py, attached by model/fp8.py)

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, etp_group, ep_group, device=None):
        super().__init__()
        ep, ep_rank, tp = comm.group_size(ep_group), comm.group_rank(ep_group), comm.group_size(etp_group)
        self.add_fc2_bias = comm.group_rank(etp_group) == 0  # fc2's bias once per ETP sum (Expert)
        self.num_experts, self.num_local, self.etp_group = config.num_experts, config.num_experts // ep, etp_group
        self.first = ep_rank * self.num_local  # global index of the first local expert
        self._act = activation(config)  # the dense MLP's: SwiGLU, quick-GeGLU or GeLU
        self.recompute_activation = False  # --recompute-modules moe_act: only its input is kept
        self.local_experts = nn.ModuleDict(
            {str(self.first + i): Expert(config, execution, tp, device) for i in range(self.num_local)})
        split = (comm.group_rank(etp_group), tp)
        for p in self.local_experts.parameters():  # cut over ETP, not TP; with ETP 1 each rank's whole
            info = param_info(p)
            if info.tensor_parallel or tp == 1:
                info.tensor_parallel, info.split = True, split
        ffn = config.expert_ffn_hidden_size // tp
        self.grouped = execution.moe_grouped_gemm and grouped_mm_fits(config.hidden_size, ffn,
                                                                      execution.params_dtype)

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            return recompute(self._act, y)
        return self._act(y)

    def _runs_grouped(self, device: torch.device) -> bool:
        return self.grouped and device.type in GROUPED_MM_DEVICES

    def fusable_weights(self, device: torch.device) -> list:
        """The weights whose every use is a product of tensor_parallel/grad_fusion.py's
        (--gradient-accumulation-fusion): the experts' in the per-expert loop; the grouped GEMM
        has no form that writes into per-expert buffers, and FP8's GEMMs are torchao's."""
        if self.fp8 is not None or self._runs_grouped(device):
            return []
        return [w for e in self.local_experts.values() for w in (e.linear_fc1.weight, e.linear_fc2.weight)]

    def forward(self, x: torch.Tensor, counts: list[int], sources: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, h]: tokens sorted by local expert, counts[i] of them for expert i -> [N, h]
        (a partial sum over TP). `sources`: each row's EP rank, for FP8's per-micro-batch scales."""
        if self.fp8 is not None:
            return self.fp8.forward(x, counts, sources)
        experts = list(self.local_experts.values())
        if self._runs_grouped(x.device):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            # [E_local, h, fc1_out] and [E_local, ffn, h]
            y = self._add_biases(self._grouped(x, [e.linear_fc1.weight for e in experts], offs),
                                 [e.linear_fc1.bias for e in experts], counts)
            y = self._grouped(self._activation(y), [e.linear_fc2.weight for e in experts], offs)
            return self._add_biases(y, [e.linear_fc2.bias for e in experts], counts) if self.add_fc2_bias else y
        store = self.wgrad_store  # --delay-wgrad-compute: each expert's weight gradients wait for W
        outs = [linear(self._activation(linear(part, e.linear_fc1.weight, e.linear_fc1.bias, store)),
                       e.linear_fc2.weight, e.linear_fc2.bias if self.add_fc2_bias else None, store)
                for part, e in zip(x.split(counts), experts)]
        return torch.cat(outs) if outs else x[:0]

    def _grouped(self, x: torch.Tensor, weights: list, offs: torch.Tensor) -> torch.Tensor:
        """One grouped product of x's expert groups with each expert's weight (transposed), its
        weight gradients deferred under --delay-wgrad-compute."""
        y = grouped_mm(x, weights, offs, self.wgrad_store)
        return y if y is not None else _grouped_mm(x, torch.stack([w.t() for w in weights]), offs)

    @staticmethod
    def _add_biases(y: torch.Tensor, biases: list, counts: list[int]) -> torch.Tensor:
        """y [N, out] grouped by local expert (counts[i] rows of expert i) + each row's expert's bias."""
        if biases[0] is None:
            return y
        rows = torch.tensor(counts, device=y.device)
        return y + torch.stack(biases).repeat_interleave(rows, dim=0, output_size=y.size(0))
