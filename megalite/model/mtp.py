"""Multi-token prediction (DeepSeek-V3, Sec. 2.2; Megatron-LM's MultiTokenPredictionBlock).

Module k = 1..D predicts token i+k+1 at position i. It sees h_{k-1} (the main model's final-normed
output for k = 1, module k-1's output after) and the embedding of token i+k, the input ids rolled
left k times:

    h_k = final_layernorm(TransformerLayer(eh_proj([enorm(Emb(ids >> k)); hnorm(h_{k-1})])))
    L_k = sum_i mask_k[i] · CE(h_k[i] · Wᵀ, labels_k[i]) / sum_i mask_k[i]

with eh_proj [h, 2h] column-parallel (no bias), the concatenation embedding first, and labels_k /
mask_k the labels and loss mask rolled left k times (zeros enter at the end: the last k
positions have no target). The embedding and the output layer W are the main model's. The
objective adds (--mtp-loss-scaling-factor / D) · sum_k L_k to the LM loss (Megatron-LM's
process_mtp_loss); the layer's transformer layer is MoE when the main model's last layer is.

Under context parallelism each rank holds chunks r and 2c-1-r of the sequence: the data to roll
is gathered over the CP group, rolled whole and cut again (every rank holds the micro-batch's
tokens anyway), so the rolled sequence is the single-process one.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..context_parallel.sharding import chunk_positions, gathered_positions
from ..recompute import recompute
from ..tensor_parallel import ColumnParallelLinear, scatter_to_sp
from .config import ExecutionConfig, GPTConfig
from .norm import Norm
from .transformer import TransformerLayer


def _whole(t: torch.Tensor, cp_group) -> torch.Tensor:
    """[b, s/c] of this CP rank -> [b, s] in sequence order."""
    cp = comm.group_size(cp_group)
    if cp == 1:
        return t
    gathered = comm.all_gather(t, cp_group, dim=1)  # the ranks' chunks in rank order
    whole = torch.empty_like(gathered)
    whole[:, gathered_positions(gathered.size(1), cp, t.device)] = gathered
    return whole


def _roll_left(t: torch.Tensor) -> torch.Tensor:
    """Shift [b, s] left by one along s; a zero enters at the end (Megatron-LM's roll_tensor)."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


def future_tokens(tensors: list, depth: int, cp_group) -> list[tuple[list, torch.Tensor]]:
    """tensors: [b, s/c] data (ids, positions, labels, loss mask; None allowed). Per depth k = 1..D:
    the tensors rolled left k times over the whole sequence, this rank's part of each, and the
    rolled loss mask's token count over the whole sequence (the last tensor is the mask)."""
    cp, cp_rank = comm.group_size(cp_group), comm.group_rank(cp_group)
    whole = [None if t is None else _whole(t, cp_group) for t in tensors]
    mine = None
    if cp > 1:
        s = whole[-1].size(1)
        mine = chunk_positions(s, cp, cp_rank, whole[-1].device)
    out = []
    for _ in range(depth):
        whole = [None if t is None else _roll_left(t) for t in whole]
        local = [None if t is None else (t if mine is None else t[:, mine].contiguous()) for t in whole]
        out.append((local, whole[-1].sum()))
    return out


class MultiTokenPredictionLayer(nn.Module):
    """MTP module k: enorm, hnorm, eh_proj, transformer_layer, final_layernorm (Megatron-LM's names)."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker, depth: int,
                 device=None, cp_group=None, ep_group=None, token_group=None, etp_group="tp"):
        super().__init__()
        h = config.hidden_size
        self.tp_group, self.sequence_parallel, self.rng_tracker = tp_group, execution.sequence_parallel, rng_tracker
        self.recompute = execution.recompute_granularity == "full"
        self.enorm = Norm(config, execution, device)
        self.hnorm = Norm(config, execution, device)
        # [2h] -> [h/tp] per rank, gathered to [h] (under SP the sequence is gathered first)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp_group=tp_group, bias=False, gather_output=True,
                                            init_std=config.init_method_std,
                                            sequence_parallel=execution.sequence_parallel,
                                            dtype=execution.params_dtype, device=device)
        # numbered after the decoder's layers (its init and names come from its own module name)
        self.transformer_layer = TransformerLayer(config, execution, tp_group, rng_tracker, config.num_layers + depth,
                                                  device, cp_group, ep_group, token_group, etp_group,
                                                  moe=config.is_moe_mtp_layer())
        if execution.recompute_granularity == "selective":
            self.transformer_layer.self_attention.recompute_core_attention = True
        if config.dsa:  # DeepSeek-V3.2's MTP layer is an MLA + DSA layer like the decoder's (model/dsa.py)
            self.transformer_layer.self_attention.core_attention.in_mtp = True
        self.final_layernorm = Norm(config, execution, device)

    def _body(self, hidden, embedded, cos, sin, attention_mask):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # [s(/tp), b, 2h]
        x = self.eh_proj(x)  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sp(x, self.tp_group)  # [s/tp, b, h]
        rotary = None if cos is None else (cos, sin)
        return self.transformer_layer(x, rotary, attention_mask)

    def forward(self, hidden, embedded, rotary=None, attention_mask=None):
        """hidden: h_{k-1}, embedded: Emb(ids >> k), both [s, b, h] ([s/tp, b, h] under SP) -> h_k."""
        cos, sin = rotary if rotary is not None else (None, None)
        if self.recompute and self.training and torch.is_grad_enabled():
            x = recompute(self._body, hidden, embedded, cos, sin, attention_mask, rng_tracker=self.rng_tracker)
        else:
            x = self._body(hidden, embedded, cos, sin, attention_mask)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(nn.Module):
    """The D MTP modules (`mtp.layers.{k-1}`), on the last pipeline stage."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, device=None,
                 cp_group=None, ep_group=None, token_group=None, etp_group="tp"):
        super().__init__()
        self.cp_group = cp_group
        self.scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, execution, tp_group, rng_tracker, k, device, cp_group, ep_group,
                                      token_group, etp_group) for k in range(config.mtp_num_layers))

    def shifted(self, input_ids, position_ids, labels, loss_mask) -> list:
        return future_tokens([input_ids, position_ids, labels, loss_mask], len(self.layers), self.cp_group)


def mtp_objective(results: list, main_tokens: torch.Tensor, microbatch_mean: bool, scale: float) -> torch.Tensor:
    """The MTP term of one micro-batch's objective, in the LM loss's normalisation: results per
    depth (masked loss sum here, tokens here, tokens of the whole sequence). With the per-micro-batch
    mean, each depth's sum over its own (whole-sequence) token count; with --calculate-per-token-loss
    the sum reweighed to the main loss's count (Megatron-LM's original_num_tokens / num_tokens)."""
    total = 0.0
    for loss_sum, _, tokens in results:
        if microbatch_mean:
            total = total + loss_sum / tokens.clamp(min=1)
        else:
            total = total + loss_sum * (main_tokens / tokens.clamp(min=1))
    return scale * total
