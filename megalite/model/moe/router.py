"""The top-k router: which experts each token goes to, with what weight, and the losses that keep
the experts evenly loaded. Computed in fp32 whatever the activations' dtype (fp64 with --moe-router-dtype fp64).

Scores (Megatron-LM's topk_softmax_with_capacity):
  softmax            probs = softmax(top-k logits)           (Mixtral: softmax, top-k, renormalise)
  softmax, pre       probs = top-k of softmax(logits)        (Qwen2-MoE without norm_topk_prob)
  sigmoid            s = sigmoid(logits); top-k of s (+ expert bias, for the choice only);
                     probs = s_topk / sum(s_topk) for k > 1  (DeepSeek-V3)
  group-limited      the top-k taken within each token's best --moe-router-group-topk of
                     --moe-router-num-groups expert groups (GroupLimitedTopK)
  scaling factor     probs x --moe-router-topk-scaling-factor (DeepSeek-V3's routed_scaling_factor)

Losses, each added to the backward of the layer's output (AuxLossInjector) rather than to the
language-model loss, so a pipeline stage without the loss can train its router:
  aux_loss      Switch Transformer (Fedus et al. 2021, Eq. 4) with top-k (GShard):
                coeff · E / (T² k) · Σ_e P_e · f_e,  P_e = Σ_t p_te (all-expert scores), f_e = tokens sent to e
                (before dropping; with an expert bias, the top-k of the scores without it)
  seq_aux_loss  the same per sequence, averaged over sequences (DeepSeek-V2, Eq. 12-14)
  global_aux_loss  the same with f_e counted over the whole stage (TP x CP x DP) and averaged over
                the iteration's micro-batches so far (Qiu et al. 2025, arXiv:2501.11873; Megatron-LM's
                _apply_global_aux_loss)
  z-loss        coeff · mean_t logsumexp(logits_t)²  (ST-MoE, Zoph et al. 2022, Eq. 5)
Sinkhorn routing (S-BASE, Clark et al. 2022; Megatron-LM's sinkhorn_load_balancing) replaces the
score function and any loss: in training the top-k of the doubly normalised exp(logits) (no
gradient), weighted by sigmoid (k = 1) or softmax (k > 1) of the logits; in evaluation the top-k of
those weights.
Under sequence or context parallelism each rank holds some of the tokens: f_e, T and the sequence
length count the whole micro-batch (one all-reduce of the counts over the TP x CP group), the
scores' sums only this rank's tokens, so the ranks' parts add up to the loss of the whole
micro-batch and each rank's part carries exactly its tokens' gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from ...tensor_parallel import set_init
from ...tensor_parallel.param_info import param_info
from ..config import ExecutionConfig, GPTConfig


@dataclass
class Routing:
    probs: torch.Tensor  # [T, k] fp32 combine weights (0 where a token was dropped)
    indices: torch.Tensor  # [T, k] int64 expert of each choice
    kept: torch.Tensor | None  # [T, k] bool: within the expert's capacity (None: dropless)
    loss: torch.Tensor | None  # this rank's part of the micro-batch's aux + z losses (None: none)


def plain_topk(values: torch.Tensor, k: int):
    """(top-k values, their expert indices) of each token's row [T, E]."""
    return torch.topk(values, k, dim=-1)


class ScoreFunction:
    """How a router turns fp32 logits [T, E] into each token's k experts and their weights.

    A new score function is a subclass and one entry in SCORE_FUNCTIONS (the choices of
    --moe-router-score-function). `select(values, k)` picks each row's top-k (plain, or restricted
    to a few groups of experts)."""

    def __call__(self, logits: torch.Tensor, k: int, select, pre_softmax: bool,
                 expert_bias: torch.Tensor | None):
        """(probs [T, k], indices [T, k], the scores the load-balancing loss weighs [T, E])."""
        raise NotImplementedError


class SoftmaxScores(ScoreFunction):
    """Mixtral: the top-k logits, softmaxed; pre-softmax (Qwen2-MoE without norm_topk_prob): the
    top-k of the softmax over all E."""

    def __call__(self, logits, k, select, pre_softmax, expert_bias):
        scores = torch.softmax(logits, dim=-1)
        if pre_softmax:
            probs, indices = select(scores, k)
        else:
            top, indices = select(logits, k)
            probs = torch.softmax(top, dim=-1)
        return probs, indices, scores


class SigmoidScores(ScoreFunction):
    """DeepSeek-V3: s = sigmoid(logits), the top-k of s + expert bias (the bias for the choice
    only), the weights s_topk normalised over the k (k > 1); the loss weighs s normalised over E."""

    def __call__(self, logits, k, select, pre_softmax, expert_bias):
        scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        indices = select(choice, k)[1]
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        return probs, indices, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


class GroupLimitedTopK:
    """Group-limited top-k (DeepSeek-V2 Sec. 2.1.3, V3 Sec. 2.1.2; Megatron-LM's group_limited_topk):
    the E experts in `num_groups` groups of consecutive indices, each group scored per token by the
    sum of its top (k // group_topk) values, and the top-k chosen within the `group_topk` best
    groups only. With the groups on EP ranks or nodes, a token's copies reach at most group_topk
    of them."""

    def __init__(self, num_groups: int, group_topk: int):
        self.num_groups, self.group_topk = num_groups, group_topk

    def __call__(self, values: torch.Tensor, k: int):
        T, E = values.shape
        grouped = values.view(T, self.num_groups, E // self.num_groups)
        group_scores = grouped.topk(k // self.group_topk, dim=-1).values.sum(dim=-1)  # [T, groups]
        best = torch.topk(group_scores, self.group_topk, dim=-1).indices
        keep = torch.zeros(T, self.num_groups, dtype=torch.bool, device=values.device).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand(grouped.shape).reshape(T, E)
        return torch.topk(values.masked_fill(~keep, float("-inf")), k, dim=-1)


SCORE_FUNCTIONS: dict[str, type[ScoreFunction]] = {"softmax": SoftmaxScores, "sigmoid": SigmoidScores}


def capacity_mask(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity: int,
                  policy: str) -> torch.Tensor:
    """[T, k] bool: the choices each expert keeps, at most `capacity` of them: those with the
    highest probabilities ("probs") or of the earliest tokens ("position")."""
    T = indices.size(0)
    chosen = torch.zeros(T, num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)
    if policy == "probs":
        weight = torch.full((T, num_experts), -1.0, dtype=probs.dtype, device=probs.device).scatter_(1, indices, probs)
        top = torch.topk(weight, min(capacity, T), dim=0).indices  # [capacity, E]: each expert's best tokens
        keep = torch.zeros_like(chosen).scatter_(0, top, True) & chosen
    else:
        keep = chosen & (torch.cumsum(chosen.long(), dim=0) <= capacity)
    return keep.gather(1, indices)


def pad_to_capacity(probs: torch.Tensor, indices: torch.Tensor, kept: torch.Tensor, num_experts: int,
                    capacity: int):
    """--moe-pad-expert-input-to-capacity (Megatron-LM's pad_to_capacity): the routing as E choices
    per token (probs [T, E], 0 where not chosen; indices [T, E] = 0..E-1; kept [T, E]), each expert
    keeping its kept choices plus the earliest other tokens up to exactly min(capacity, T) rows.
    The padding rows weigh 0: the same function, with every expert's input the same shape."""
    T = indices.size(0)
    dense = torch.zeros(T, num_experts, dtype=probs.dtype, device=probs.device).scatter(1, indices, probs)
    keep = torch.zeros(T, num_experts, dtype=torch.bool, device=kept.device).scatter(1, indices, kept)
    room = min(capacity, T) - keep.sum(0, keepdim=True)  # [1, E] padding rows each expert needs
    keep |= ~keep & (torch.cumsum((~keep).long(), dim=0) <= room)
    every = torch.arange(num_experts, device=indices.device).expand(T, num_experts)
    return dense, every, keep


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, total_tokens: int, k: int,
                        coeff: float) -> torch.Tensor:
    """coeff · E / (T² k) · Σ_e P_e f_e over this rank's scores [T_local, E] and the whole
    micro-batch's counts [E] (T: its token count)."""
    E = scores.size(-1)
    return scores.sum(0).mul(counts).sum() * (coeff * E / (total_tokens * total_tokens * k))


def sequence_load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, seq_length: int, k: int,
                                 coeff: float) -> torch.Tensor:
    """Per sequence: scores [s_local, b, E], counts [b, E] over whole sequences of `seq_length`
    tokens; the loss of each sequence, averaged over the b sequences."""
    E, b = scores.size(-1), scores.size(1)
    per_seq = (scores.sum(0) * counts).sum(-1) * (E / (seq_length * seq_length * k))  # [b]
    return per_seq.sum() * (coeff / b)


class BalancingLoss:
    """A load-balancing loss over this rank's scores [T_local, E] (s_local x b tokens in [s, b]
    order) and the micro-batch's routing choices, whose counts are summed over `token_group`.
    A new one is a subclass and one entry in LOAD_BALANCING (the choices of
    --moe-router-load-balancing-type); `enabled` False: no loss, nothing computed."""
    enabled = True

    def __call__(self, scores: torch.Tensor, onehot: torch.Tensor, token_group, seq_shape: tuple[int, int], k: int,
                 coeff: float) -> torch.Tensor:
        raise NotImplementedError


class MicroBatchAuxLoss(BalancingLoss):
    """aux_loss: over the whole micro-batch (Switch / GShard)."""

    def __call__(self, scores, onehot, token_group, seq_shape, k, coeff):
        s_local, b = seq_shape
        counts = comm.all_reduce(onehot.sum(0), token_group)
        return load_balancing_loss(scores, counts, s_local * b * comm.group_size(token_group), k, coeff)


class SequenceAuxLoss(BalancingLoss):
    """seq_aux_loss: per sequence, averaged over the sequences (DeepSeek-V2)."""

    def __call__(self, scores, onehot, token_group, seq_shape, k, coeff):
        s_local, b = seq_shape
        counts = comm.all_reduce(onehot.view(s_local, b, -1).sum(0), token_group)
        return sequence_load_balancing_loss(scores.view(s_local, b, -1), counts,
                                            s_local * comm.group_size(token_group), k, coeff)


class GlobalAuxLoss(BalancingLoss):
    """global_aux_loss: f_e over every rank of the stage (TP x CP x DP: `stage_group`), averaged
    over this iteration's micro-batches so far (`reset` at each iteration's start)."""

    def __init__(self):
        self.stage_group, self.counts, self.steps = None, None, 0

    def reset(self, stage_group) -> None:
        self.stage_group, self.counts, self.steps = stage_group, None, 0

    def __call__(self, scores, onehot, token_group, seq_shape, k, coeff):
        s_local, b = seq_shape
        counts = comm.all_reduce(onehot.sum(0), self.stage_group)
        self.counts = counts if self.counts is None else self.counts + counts
        self.steps += 1
        total = s_local * b * comm.group_size(self.stage_group)
        return load_balancing_loss(scores, self.counts / self.steps, total, k, coeff)


class NoBalancingLoss(BalancingLoss):
    """none: the routers are balanced by other means (the expert bias) or not at all."""
    enabled = False


class SinkhornBalancing(NoBalancingLoss):
    """sinkhorn: balanced by the routing itself (`sinkhorn_routing`), no loss."""


LOAD_BALANCING: dict[str, type[BalancingLoss]] = {
    "aux_loss": MicroBatchAuxLoss, "seq_aux_loss": SequenceAuxLoss, "global_aux_loss": GlobalAuxLoss,
    "sinkhorn": SinkhornBalancing, "none": NoBalancingLoss}


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Megatron-LM's moe_utils.sinkhorn: exp(cost) [T, E] scaled by row and column factors until
    the columns' factors move by less than `tol` on average (each row then sums to 1/T, each
    column to 1/E: the tokens spread evenly over the experts)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    error, d1_old = 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + 1e-8)
        d1 = (1 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + 1e-8)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, k: int, training: bool):
    """(probs [T, k], indices [T, k]) of Megatron-LM's sinkhorn_load_balancing: the weights are
    sigmoid (k = 1) or softmax over all experts (k > 1) of the logits, never renormalised."""
    weights = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
    with torch.no_grad():
        indices = torch.topk(sinkhorn(logits.float()) if training else weights, k, dim=-1).indices
    return weights.gather(1, indices), indices


def first_training_pass() -> bool:
    """Whether this forward adds to the iteration's statistics (tokens per expert, logged losses):
    not under no_grad (evaluation), and not inside a backward pass, where activation recompute
    (non-reentrant torch.utils.checkpoint) runs the same forward a second time."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class TopKRouter(nn.Module):
    def __init__(self, config: GPTConfig, execution: ExecutionConfig, device=None):
        super().__init__()
        E, h = config.num_experts, config.hidden_size
        self.num_experts, self.topk = E, config.moe_router_topk
        self.score_function = SCORE_FUNCTIONS[config.moe_router_score_function]()
        self.pre_softmax = config.moe_router_pre_softmax
        self.balancing = LOAD_BALANCING[config.moe_router_load_balancing_type]()
        self.aux_coeff = config.moe_aux_loss_coeff
        self.z_coeff = config.moe_z_loss_coeff
        self.capacity_factor, self.drop_policy = config.moe_expert_capacity_factor, config.moe_token_drop_policy
        self.pad_to_capacity = execution.moe_pad_expert_input_to_capacity and self.capacity_factor is not None
        self.select = GroupLimitedTopK(config.moe_router_num_groups, config.moe_router_group_topk) \
            if config.moe_router_group_topk else plain_topk
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.dtype = torch.float64 if config.moe_router_dtype == "fp64" else torch.float32
        self.weight = nn.Parameter(torch.empty(E, h, dtype=execution.params_dtype, device=device))
        set_init(self.weight, "normal", config.init_method_std)
        # a bias on the logits unless --disable-bias-linear (Megatron-LM's Router; gpt-oss's router
        # has one), initialised like the weight (Megatron-LM's init_method on both)
        self.bias = None
        if config.add_bias_linear:
            self.bias = nn.Parameter(torch.empty(E, dtype=execution.params_dtype, device=device))
            set_init(self.bias, "normal", config.init_method_std)
        # replicated across TP; under sequence parallelism each TP rank routes other tokens
        for p in (self.weight, self.bias):
            if p is not None:
                param_info(p).sequence_parallel = execution.sequence_parallel
        # aux-loss-free balancing: moved by the trainer after each step (moe/balance.py)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device)
                             if config.moe_router_enable_expert_bias else None)
        # this iteration's tokens per expert on this rank (the bias update and the log read it)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32, device=device),
                             persistent=False)
        self.aux_loss_sum = self.z_loss_sum = None  # this rank's parts, summed over micro-batches

    def forward(self, x: torch.Tensor, token_group, seq_shape: tuple[int, int]) -> Routing:
        """x [T, h] with T = s_local·b tokens in [s, b] order; `token_group`: the ranks holding
        the rest of the micro-batch's tokens (TP under sequence parallelism, x CP)."""
        bias = self.bias.to(self.dtype) if self.bias is not None else None
        logits = F.linear(x.to(self.dtype), self.weight.to(self.dtype), bias)  # [T, E] in fp32 (or fp64)
        if isinstance(self.balancing, SinkhornBalancing):
            (probs, indices), scores = sinkhorn_routing(logits, self.topk, self.training), None
        else:
            probs, indices, scores = self.score_function(logits, self.topk, self.select, self.pre_softmax,
                                                         self.expert_bias)
        if self.scaling_factor:
            probs = probs * self.scaling_factor
        kept = capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(x.size(0) * self.topk / self.num_experts * self.capacity_factor)
            kept = capacity_mask(probs.detach(), indices, self.num_experts, capacity, self.drop_policy)
            probs = probs * kept
        if first_training_pass():
            with torch.no_grad():
                routed = torch.zeros(x.size(0), self.num_experts, device=x.device)
                routed.scatter_(1, indices, 1.0 if kept is None else kept.float())
                self.tokens_per_expert += routed.sum(0)
        loss = self._losses(logits, scores, indices, token_group, seq_shape)
        if self.pad_to_capacity:
            return Routing(*pad_to_capacity(probs, indices, kept, self.num_experts, capacity), loss)
        return Routing(probs, indices, kept, loss)

    def _losses(self, logits, scores, indices, token_group, seq_shape):
        s_local, b = seq_shape
        n = comm.group_size(token_group)
        total = None
        if self.training and self.balancing.enabled and self.aux_coeff > 0:
            with torch.no_grad():  # the choices, before any dropping (Megatron-LM's)
                if self.expert_bias is not None or self.select is not plain_topk:
                    # f_e counts the plain top-k of the scores themselves, not of scores + bias nor
                    # within the groups (DeepSeek-V3 Eq. 18; Megatron-LM's
                    # compute_routing_scores_for_aux_loss): bias and groups steer the choice but
                    # are no part of the load the loss measures
                    indices = torch.topk(scores, self.topk, dim=-1).indices
                onehot = torch.zeros_like(scores).scatter_(1, indices, 1.0)
            total = self.balancing(scores, onehot, token_group, seq_shape, self.topk, self.aux_coeff)
            if first_training_pass():
                self.aux_loss_sum = total.detach() + (0 if self.aux_loss_sum is None else self.aux_loss_sum)
        if self.training and self.z_coeff:
            z = torch.logsumexp(logits, dim=-1).square().sum() * (self.z_coeff / (s_local * b * n))
            if first_training_pass():
                self.z_loss_sum = z.detach() + (0 if self.z_loss_sum is None else self.z_loss_sum)
            total = z if total is None else total + z
        return total
