"""The MoE layers' load statistics across ranks, once per iteration: the aux-loss-free expert-bias
update (DeepSeek-V3, Sec. 2.1.2), and the losses and tokens per expert that the log reports.

Each router counts the choices of this rank's own tokens (before any gather), so a sum over the
ranks of a pipeline stage counts each token once; its loss parts sum, over TP x CP, to the
micro-batch's loss, and over DP and micro-batches to the iteration's total."""
from __future__ import annotations

import torch
from torch import nn

from ... import comm


def moe_layers(model: list[nn.Module]) -> list:
    """(global layer number, MoELayer) of every MoE layer of these model chunks."""
    return [pair for chunk in model for pair in chunk.moe_layers()]


def start_iteration(model: list[nn.Module], aux_loss_scale: float, stage_group=None) -> None:
    """Zero the routers' statistics; `aux_loss_scale`: d(objective)/d(router loss) of one micro-batch;
    `stage_group`: the ranks of the pipeline stage (TP x CP x DP), over which global_aux_loss counts."""
    for _, layer in moe_layers(model):
        layer.aux_loss_scale = aux_loss_scale
        if hasattr(layer.router.balancing, "reset"):
            layer.router.balancing.reset(stage_group)
        layer.router.tokens_per_expert.zero_()
        layer.router.aux_loss_sum = layer.router.z_loss_sum = None


@torch.no_grad()
def update_expert_bias(model: list[nn.Module], stage_group, rate: float) -> None:
    """b_e += rate · sign(mean load - load_e), the loads summed over the stage's ranks (`stage_group`:
    TP x CP x DP), so every replica moves its bias alike."""
    routers = [layer.router for _, layer in moe_layers(model) if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = comm.all_reduce(torch.stack([r.tokens_per_expert for r in routers]), stage_group)
    for r, c in zip(routers, counts):
        r.expert_bias += rate * torch.sign(c.mean() - c)


@torch.no_grad()
def iteration_metrics(model: list[nn.Module], num_layers: int, num_experts: int, microbatches: int, coeffs,
                      device) -> dict:
    """Summed over every rank (one all-reduce of [layers, 3 + E]): per MoE layer its load-balancing
    loss and z-loss (means over the iteration's `microbatches` global micro-batches, divided by
    their coefficients, as Megatron-LM logs them) and the tokens each expert received."""
    table = torch.zeros(num_layers, 3 + num_experts, dtype=torch.float64, device=device)
    for n, layer in moe_layers(model):
        r = layer.router
        table[n, 0] = 1.0
        table[n, 1] = r.aux_loss_sum if r.aux_loss_sum is not None else 0.0
        table[n, 2] = r.z_loss_sum if r.z_loss_sum is not None else 0.0
        table[n, 3:] = r.tokens_per_expert
    comm.all_reduce(table, comm.world_group())
    aux_coeff, z_coeff = coeffs
    layers = []
    for n in range(num_layers):
        if table[n, 0] > 0:
            tokens = table[n, 3:]
            layers.append({"layer": n, "tokens_min": int(tokens.min()), "tokens_max": int(tokens.max()),
                           "load_balancing_loss": float(table[n, 1]) / microbatches / aux_coeff if aux_coeff else None,
                           "z_loss": float(table[n, 2]) / microbatches / z_coeff if z_coeff else None})
    out = {"moe_layers": layers}
    for key in ("load_balancing_loss", "z_loss"):
        values = [rec[key] for rec in layers if rec[key] is not None]
        if values:
            out[key] = sum(values) / len(values)
    return out
