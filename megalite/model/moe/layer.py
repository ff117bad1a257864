"""The Mixture-of-Experts MLP (Shazeer et al. 2017; Fedus et al. 2021; Jiang et al. 2024,
Mixtral): y = Σ_{e in top-k(x)} p_e(x) · Expert_e(x) [+ shared expert(x)], in place of a layer's
dense MLP. x: [s, b, h] ([s/tp, b, h] under sequence parallelism).

The forward is four phases, each a method: `route` (router.py: each token's experts and
weights, and the router's losses), `dispatch` (dispatcher.py: the routed rows to the ranks
holding their experts), `run_experts` (experts.py) and `combine` (dispatcher.py: the outputs
back, weighted, summed per token); the shared expert runs beside them."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ...recompute import recompute
from ...tensor_parallel import set_init
from ...tensor_parallel.param_info import param_info
from ..config import ExecutionConfig, GPTConfig
from ..mlp import MLP
from .dispatcher import DISPATCHERS
from .experts import LocalExperts
from .router import Routing, TopKRouter


class AttachLoss(torch.autograd.Function):
    """The identity on the layer's output whose backward also starts a side loss with gradient
    `scale` (Megatron-LM's MoEAuxLossAutoScaler; DSA's indexer loss uses it too, model/dsa.py): the
    loss trains the router on every pipeline stage without travelling to the last one."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class MoELayer(nn.Module):
    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, ep_group=None, token_group=None,
                 device=None, etp_group="tp"):
        """`ep_group`: the expert-parallel ranks (each holds num_experts / EP experts);
        `token_group`: the ranks holding the rest of each micro-batch's tokens (TP under sequence
        parallelism, x CP), over which the router's load statistics are summed; `etp_group`: the
        expert-tensor-parallel ranks splitting each expert (--expert-tensor-parallel-size;
        "tp": `tp_group`, ETP = TP; None is a group of one rank, as everywhere). The shared expert
        is a dense MLP: split over TP."""
        super().__init__()
        self.token_group = token_group
        self.router = TopKRouter(config, execution, device)
        etp_group = tp_group if isinstance(etp_group, str) and etp_group == "tp" else etp_group
        self.experts = LocalExperts(config, execution, etp_group, ep_group, device)
        self.dispatcher = DISPATCHERS[execution.moe_token_dispatcher_type](
            config.num_experts, self.experts.first, self.experts.num_local, etp_group, ep_group)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = MLP(shared, execution, tp_group, device)
            if config.moe_shared_expert_gate:  # Qwen2-MoE: sigmoid(x · w) scales the shared output
                self.shared_experts.gate_weight = nn.Parameter(
                    torch.empty(1, config.hidden_size, dtype=execution.params_dtype, device=device))
                set_init(self.shared_experts.gate_weight, "normal", config.init_method_std)
                param_info(self.shared_experts.gate_weight).sequence_parallel = execution.sequence_parallel
        # d(objective)/d(router loss) of each micro-batch, set by the trainer every iteration
        self.aux_loss_scale = 1.0
        self.recompute_shared = False  # --recompute-modules shared_experts

    def route(self, tokens: torch.Tensor, seq_shape: tuple[int, int]) -> Routing:
        """tokens [T, h] in [s, b] order -> each token's experts, weights and the router's losses."""
        return self.router(tokens, self.token_group, seq_shape)

    def dispatch(self, tokens: torch.Tensor, routing: Routing):
        """-> (rows [N, h] for this rank's experts, sorted by local expert; counts; handle)."""
        return self.dispatcher.dispatch(tokens, routing)

    def run_experts(self, rows: torch.Tensor, counts: list[int], handle=None) -> torch.Tensor:
        """`handle` (dispatch's): FP8 experts read each row's source rank from it (per-micro-batch scales)."""
        sources = self.dispatcher.row_sources(handle) if self.experts.fp8 is not None and handle is not None else None
        return self.experts(rows, counts, sources)

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        """The experts' outputs -> [T, h] each token's weighted sum of its experts' outputs."""
        return self.dispatcher.combine(y, handle)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared_experts(x)
        gate = getattr(self.shared_experts, "gate_weight", None)
        return y if gate is None else torch.sigmoid(F.linear(x, gate)) * y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.route(tokens, (s, b))
        rows, counts, handle = self.dispatch(tokens, routing)
        out = self.combine(self.run_experts(rows, counts, handle), handle).view(s, b, h)
        if self.shared_experts is not None:
            if self.recompute_shared and self.training and torch.is_grad_enabled():
                out = out + recompute(self.shared_expert, x)
            else:
                out = out + self.shared_expert(x)
        if routing.loss is not None and torch.is_grad_enabled():
            out = AttachLoss.apply(out, routing.loss, self.aux_loss_scale)
        return out
