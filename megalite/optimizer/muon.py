"""--optimizer muon: Muon for the transformer layers' matrices, Adam or Lion for everything else,
as one inner optimizer of MixedPrecisionOptimizer (the masters, clipping and loss scaling stay its).

Which tensors: every 2-D weight but the word embedding and the output layer (Megatron-LM's rule:
attention's QKV and projection, the MLPs, each MoE expert's weights on their own, routers, MLA's
projections) is a *matrix*, stepped by Muon; embeddings, the output layer, norms and biases by
--muon-scalar-optimizer (torch's AdamW with --adam-beta1/2 and --adam-eps, or Lion). Both take the
learning rate of the schedule and decoupled weight decay (2-D tensors only, as for Adam).

Muon's step on a matrix W with gradient G (Jordan et al. 2024; Megatron-LM / Emerging-Optimizers):
    M <- beta M + (1 - beta) G                   (--muon-momentum beta; M: `momentum_buffer`)
    X  = (1 - beta) G + beta M  if --muon-nesterov, else M
    W <- W (1 - lr wd) - lr * scale * NS(X)      (newton_schulz.py: NS, scale, QKV split, TP modes)
The momentum is elementwise, so it lives wherever the master does, piece by piece: whole
matrices under no_shard, this rank's slices of the DP buckets under ZeRO-1/2/3 (muon_matrices.py
assembles the whole matrix for NS at the one DP rank that owns it). The checkpoint therefore
saves and reshards it like Adam's moments.

With --use-precision-aware-optimizer the momentum is stored in --exp-avg-dtype (bf16 / fp16: 2
bytes instead of 4) and widened to fp32 for the step; the scalar Adam is precision_adam.py's.

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2):
    W <- W (1 - lr wd) - lr sign(beta1 m + (1 - beta1) g);   m <- beta2 m + (1 - beta2) g
"""
from __future__ import annotations

import torch

from ..config import OptimizerConfig
from .precision_adam import STORAGE_DTYPES


class Muon:
    """Momentum, then the orthogonalized update of each matrix. `matrices(masters, inputs)` returns
    the scaled update of each master piece (collectives included: it runs on every rank every
    step, with or without pieces of its own). Counts steps per group, as apex-style optimizers."""

    def __init__(self, groups: list[dict], config: OptimizerConfig, matrices):
        self.param_groups = [dict(g, lr=config.lr, momentum=config.muon_momentum, nesterov=config.muon_nesterov)
                             for g in groups]
        self.state: dict = {}
        self.matrices = matrices
        # --use-precision-aware-optimizer --exp-avg-dtype: the momentum's storage; computed in fp32
        self.momentum_dtype = STORAGE_DTYPES[config.exp_avg_dtype]

    def init_state(self) -> None:
        for group in self.param_groups:
            group["step"] = 0
            for m in group["params"]:
                self.state[m] = {"momentum_buffer": torch.zeros_like(m, dtype=self.momentum_dtype)}

    @torch.no_grad()
    def step(self) -> None:
        masters, inputs = [], []
        for group in self.param_groups:
            beta = group["momentum"]
            for m in group["params"]:
                # the precision-aware optimizer hands gradients over as decoupled_grad (precision_adam.py)
                g = (m.grad if m.grad is not None else m.decoupled_grad.view_as(m)).float()
                buf = self.state[m]["momentum_buffer"]
                wide = buf.float()  # buf itself when stored in fp32
                wide.lerp_(g, 1 - beta)
                if wide is not buf:
                    buf.copy_(wide)  # rounded into its storage dtype; this step uses the fp32 value
                inputs.append(g.lerp(wide, beta) if group["nesterov"] else wide)
                masters.append(m)
        updates = iter(self.matrices(masters, inputs))
        for group in self.param_groups:
            group["step"] += 1
            lr, wd = group["lr"], group["weight_decay"]
            for m in group["params"]:
                w = m.float()  # m itself for fp32 masters; an fp16 master is updated in fp32
                if wd:
                    w.mul_(1 - lr * wd)
                w.add_(next(updates).view_as(m).to(m.device), alpha=-lr)
                if w is not m:
                    m.copy_(w)


class Lion:
    """Lion over the scalar optimizer's pieces (elementwise, so any slicing steps the same)."""

    def __init__(self, groups: list[dict], config: OptimizerConfig):
        self.param_groups = [dict(g, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2)) for g in groups]
        self.state: dict = {}

    def init_state(self) -> None:
        for group in self.param_groups:
            group["step"] = 0
            for m in group["params"]:
                self.state[m] = {"exp_avg": torch.zeros_like(m)}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] += 1
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for m in group["params"]:
                g, exp_avg = m.grad, self.state[m]["exp_avg"]
                direction = exp_avg.mul(b1).add_(g, alpha=1 - b1).sign_()
                if wd:
                    m.mul_(1 - lr * wd)
                m.add_(direction, alpha=-lr)
                exp_avg.lerp_(g, 1 - b2)


class ChainedOptimizer:
    """Muon and the scalar optimizer seen as one: their groups and state, one step."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def build_muon(groups: list[dict], config: OptimizerConfig, matrices, scalar_factory) -> tuple[ChainedOptimizer, str]:
    """Split each group into Muon's matrices (`matrices.is_matrix(master)`) and the scalar
    optimizer's rest; `scalar_factory(groups)` builds the Adam for the rest."""
    muon_groups, scalar_groups = [], []
    for g in groups:
        mine = [m for m in g["params"] if matrices.is_matrix(m)]
        rest = [m for m in g["params"] if not matrices.is_matrix(m)]
        if mine:
            muon_groups.append(dict(g, params=mine))
        if rest:
            scalar_groups.append(dict(g, params=rest))
    parts = [Muon(muon_groups, config, matrices)]
    if config.muon_scalar_optimizer == "lion":
        scalar, name = (Lion(scalar_groups, config), "lion") if scalar_groups else (None, "lion")
    else:
        scalar, name = scalar_factory(scalar_groups) if scalar_groups else (None, "adam")
    if scalar is not None:
        parts.append(scalar)
    desc = (f"muon ({config.muon_num_ns_steps} Newton-Schulz steps, momentum {config.muon_momentum:g}"
            f"{', nesterov' if config.muon_nesterov else ''}, {config.muon_scale_mode} scale"
            f" x {config.muon_extra_scale_factor:g}, TP mode {config.muon_tp_mode}"
            f"{'' if config.muon_split_qkv else ', QKV whole'}) + {name.split(' (')[0]} for the rest")
    if config.use_precision_aware_optimizer:
        desc += (f" (precision-aware: exp_avg {config.exp_avg_dtype} (Muon's momentum too), exp_avg_sq "
                 f"{config.exp_avg_sq_dtype}, computed in fp32)")
    return ChainedOptimizer(parts), desc

