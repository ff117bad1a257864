"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2-Exp, Sec. 2.1), on multi-latent attention, with
Megatron-LM's names (megatron/core/transformer/experimental_attention_variant/dsa.py: DSAttention
with its DSAIndexer: linear_wq_b, linear_wk, k_norm, linear_weights_proj).

The lightning indexer scores every earlier key for each query with a few small heads,

    I[t, s] = Σ_h w[t, h] · ReLU(q_I[t, h] · k_I[s])          q_I = W_qb c_q (from the query latent)
    w = x W_w / √(H · D),  k_I = LayerNorm(x W_k)              (RoPE on the first dr channels of both)

and each query attends only to its --dsa-indexer-topk highest-scoring keys (and never past its
own position). The indexer reads the layer's input and query latent detached: it is trained by its
own loss alone, KL(p || softmax(I[t, :])) per query with p the dense attention's probabilities
summed over the heads and renormalised (Sec. 2.1, Eq. 3), times --dsa-indexer-loss-coeff,
averaged over the tokens (over the top-k keys only with --dsa-indexer-use-sparse-loss).

Memory: no [s, s] tensor is kept. The top-k choice, the sparse attention and the indexer's loss
run over chunks of queries: a chunk's scores ([b, c, s] for the indexer, [b, n, c, k] for the
attention, [b, n, c, s] for the loss's dense target) exist only while it is computed. What stays
for backward is O(s·k) (the selected indices) plus the inputs: the sparse attention recomputes
each chunk in backward, and the indexer's loss computes its gradient chunk by chunk in forward
(it is a function of the indexer's outputs only) and hands it back in backward. The indexer's
cost: H·D·s² multiply-adds for its scores per sequence (as Megatron-LM's), against the dense
attention's n·(2·dqk + dv)·s²... and, in training with a loss, the dense target's n·dqk·s².

Tensor parallelism: the attention heads are split as MLA's; the indexer is replicated (Megatron-
LM's parallel_mode "duplicated"): every rank scores the whole sequence (its inputs gathered under
sequence parallelism) and picks the same keys; the loss's target sums the heads over TP, so its
gradient, and hence the indexer's, is the same on every rank and needs no reduction.
Hadamard rotation of q_I and k_I (Megatron-LM's rotate_activation) preserves every q·k and is
left out, as transformers' DeepseekV32 leaves it out.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..context_parallel.attention import gather_sequence
from ..context_parallel.sharding import chunk_positions, gathered_positions
from ..recompute import recompute
from ..tensor_parallel import set_init
from ..tensor_parallel.param_info import param_info
from .attention import apply_rotary
from .config import ExecutionConfig, GPTConfig
from .moe.layer import AttachLoss
from .moe.router import first_training_pass
from .norm import Norm

# the budget of one chunk's scores (fp32 elements): 16 Mi = 64 MiB
CHUNK_ELEMENTS = 1 << 24


class _PrecomputedGrad(torch.autograd.Function):
    """loss with its gradients with respect to `inputs` computed already (in forward)."""

    @staticmethod
    def forward(ctx, loss, *inputs_and_grads):
        n = len(inputs_and_grads) // 2
        ctx.save_for_backward(*inputs_and_grads[n:])
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.saved_tensors
        return (None, *(g * grad for g in grads), *([None] * len(grads)))


def _linear(rows: int, cols: int, execution: ExecutionConfig, std: float, device) -> nn.Parameter:
    """A replicated weight [rows, cols]: its input is the whole sequence on every TP rank, so its
    gradient is whole there too (no TP reduction)."""
    w = nn.Parameter(torch.empty(rows, cols, dtype=execution.params_dtype, device=device))
    set_init(w, "normal", std)
    return w


class DSAIndexer(nn.Module):
    """q_I [s, b, H, D], k_I [s, b, D] and the head weights w [s, b, H] (scaled by 1/√(H·D))."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, device=None):
        super().__init__()
        self.heads, self.dim, self.rope = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, \
            config.qk_pos_emb_head_dim
        std = config.init_method_std
        self.linear_wq_b = nn.Module()
        self.linear_wq_b.weight = _linear(self.heads * self.dim, config.q_lora_rank, execution, std, device)
        self.linear_wk = nn.Module()
        self.linear_wk.weight = _linear(self.dim, config.hidden_size, execution, std, device)
        # LayerNorm whatever --normalization says (Megatron-LM builds k_norm as LayerNorm)
        self.k_norm = Norm(_as_layernorm(config), execution, device, size=self.dim)
        for p in self.k_norm.parameters():  # whole-sequence input (see _linear)
            param_info(p).sequence_parallel = False
        self.linear_weights_proj = nn.Module()
        self.linear_weights_proj.weight = _linear(self.heads, config.hidden_size, execution, std, device)

    def _rotate(self, t, rotary):
        """RoPE on the first dr channels (DeepSeek's order: rotated, then the rest), rotate-half."""
        if rotary is None:
            return t
        pe, rest = t.split([self.rope, self.dim - self.rope], dim=-1)
        return torch.cat([apply_rotary(pe, *rotary), rest], dim=-1)

    def forward(self, x, qr, rotary):
        s, b = x.shape[:2]
        q = self._rotate(F.linear(qr, self.linear_wq_b.weight).view(s, b, self.heads, self.dim), rotary)
        k = self._rotate(self.k_norm(F.linear(x, self.linear_wk.weight)).unsqueeze(2), rotary).squeeze(2)
        w = F.linear(x, self.linear_weights_proj.weight) * (self.heads * self.dim) ** -0.5
        return q, k, w


def _as_layernorm(config: GPTConfig) -> GPTConfig:
    import dataclasses
    return dataclasses.replace(config, normalization="LayerNorm")


def _chunks(s: int, per_row: int):
    """Row ranges of at most CHUNK_ELEMENTS / per_row rows."""
    c = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    return [(r, min(r + c, s)) for r in range(0, s, c)]


def index_scores(q, k, w):
    """I [b, c, sk] (fp32) of q_I [c, b, H, D], k_I [sk, b, D], w [c, b, H]."""
    relu = torch.einsum("cbhd,kbd->bchk", q.float(), k.float()).relu_()
    return torch.einsum("bchk,cbh->bck", relu, w.float())


def _causal(scores, q_pos, k_pos):
    """scores [b, c, sk] (or [b, n, c, sk]) with keys after each query at -inf."""
    future = k_pos[None, :] > q_pos[:, None]  # [c, sk]
    return scores.masked_fill(future, float("-inf"))


@torch.no_grad()
def select_topk(q, k, w, q_pos, k_pos, topk: int) -> torch.Tensor:
    """The top-k keys of each query [b, s, min(topk, sk)] (int64), chunk by chunk."""
    sk, kk = k.size(0), min(topk, k.size(0))
    out = []
    for r0, r1 in _chunks(q.size(0), q.size(1) * q.size(2) * sk):
        scores = _causal(index_scores(q[r0:r1], k, w[r0:r1]), q_pos[r0:r1], k_pos)
        out.append(scores.topk(kk, dim=-1).indices)
    return torch.cat(out, dim=1)


def _sparse_chunk(q, k, v, idx, q_pos, scale):
    """One chunk of queries q [c, b, n, d] over their selected keys idx [b, c, K]: [c, b, n·dv]."""
    c, b, n, _ = q.shape
    K = idx.size(-1)
    flat = idx.reshape(b, c * K)

    def pick(t):  # [sk, b, n, x] -> [b, c, K, n, x]
        t = t.transpose(0, 1)
        return t.gather(1, flat[:, :, None, None].expand(-1, -1, *t.shape[2:])).view(b, c, K, *t.shape[2:])

    kk, vv = pick(k), pick(v)
    scores = torch.einsum("cbnd,bcknd->bnck", q.float(), kk.float()) * scale
    valid = idx <= q_pos[None, :, None]  # [b, c, K]: never a key past the query
    probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1).to(v.dtype)
    return torch.einsum("bnck,bcknd->cbnd", probs, vv).reshape(c, b, -1)


def sparse_attention(q, k, v, idx, q_pos, scale: float):
    """softmax over each query's selected keys: q [s, b, n, d], k [sk, b, n, d], v [sk, b, n, dv]
    (keys in sequence order), idx [b, s, K] -> [s, b, n·dv]; each chunk recomputed in backward
    (only its inputs are kept)."""
    b, n, K = q.size(1), q.size(2), idx.size(-1)
    train = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    for r0, r1 in _chunks(q.size(0), b * n * K * (q.size(-1) + v.size(-1))):
        args = (q[r0:r1], k, v, idx[:, r0:r1], q_pos[r0:r1], scale)
        outs.append(recompute(_sparse_chunk, *args) if train else _sparse_chunk(*args))
    return torch.cat(outs, dim=0)


def indexer_loss(iq, ik, iw, q, k, idx, q_pos, k_pos, scale: float, coeff: float, sparse: bool, tp_group,
                 queries: int | None = None):
    """coeff · mean over queries of KL(dense attention's head-summed probabilities || softmax of the
    index scores) (Megatron-LM's compute_dsa_indexer_loss), with a graph into iq, ik, iw only:
    the gradient is computed here, chunk by chunk, and handed back in backward. `queries`: the
    mean's count (default this call's b·s; under CP the whole sequence's, so that the CP ranks'
    partial sums add up to one process's mean)."""
    b, s = iq.size(1), iq.size(0)
    queries = b * s if queries is None else queries
    leaves = [t.detach().requires_grad_() for t in (iq, ik, iw)]
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in leaves]
    total = iq.new_zeros((), dtype=torch.float32)
    q, k = q.detach(), k.detach()
    for r0, r1 in _chunks(s, b * max(q.size(2), iq.size(2)) * k.size(0)):
        with torch.no_grad():
            dense = torch.einsum("cbnd,kbnd->bnck", q[r0:r1].float(), k.float()) * scale
            dense = _causal(dense, q_pos[r0:r1], k_pos)
            selected = None
            if sparse:
                selected = torch.zeros(dense.size(0), r1 - r0, k.size(0), dtype=torch.bool, device=q.device)
                selected.scatter_(-1, idx[:, r0:r1], True)
                dense = dense.masked_fill(~selected[:, None], float("-inf"))
            target = comm.all_reduce(torch.softmax(dense, dim=-1).sum(dim=1), tp_group)  # heads over TP
            target = target / target.sum(dim=-1, keepdim=True)
        with torch.enable_grad():
            scores = _causal(index_scores(leaves[0][r0:r1], leaves[1], leaves[2][r0:r1]), q_pos[r0:r1], k_pos)
            if selected is not None:
                scores = scores.masked_fill(~selected, float("-inf"))
            p = torch.softmax(scores, dim=-1)
            kl = (target * (torch.log(target + 1e-10) - torch.log(p + 1e-10))).sum()
            part = kl * (coeff / queries)
            for g, d in zip(grads, torch.autograd.grad(part, leaves)):
                g += d
        total = total + part.detach()
    return _PrecomputedGrad.apply(total, iq, ik, iw, *(g.to(t.dtype) for g, t in zip(grads, (iq, ik, iw))))


class DSAttention(nn.Module):
    """MLA's core attention under --experimental-attention-variant dsa: the indexer's top-k, the
    sparse softmax over them, and (training) the indexer's loss attached to the output."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, device=None, cp_group=None):
        super().__init__()
        self.indexer = DSAIndexer(config, execution, device)
        self.cp_group = cp_group
        self.topk, self.coeff = config.dsa_indexer_topk, config.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = config.dsa_indexer_use_sparse_loss
        self.tp_group, self.sequence_parallel = tp_group, execution.sequence_parallel
        self.loss_scale = 1.0  # d(objective)/d(indexer loss) of a micro-batch, set by the trainer (start_iteration)
        self.loss_sum = None  # this iteration's indexer losses (detached), for the log
        # an MTP module's layer (model/mtp.py): its loss trains its indexer and is logged with the
        # decoder's, but it is not one of the layers the logged mean divides by (Megatron-LM's)
        self.in_mtp = False

    def forward(self, q, k, v, x, qr, rotary, cache=None):
        """q [s, b, n, d] (scaled as the softmax wants it times √d), k [sk, b, n, d], v [sk, b, n, dv]
        (sk > s while generating; under CP the whole sequence's, in sequence order: model/mla.py),
        x and qr the layer's input and normalised query latent ([s/tp, b, .] under
        sequence parallelism); `cache`: the layer's KVCache while generating."""
        x, qr = x.detach(), qr.detach()
        if self.sequence_parallel:
            x, qr = (comm.all_gather(t.contiguous(), self.tp_group, dim=0) for t in (x, qr))
        iq, ik, iw = self.indexer(x, qr, rotary)
        if cache is not None:
            ik = cache.update_index_keys(ik)
        cp = comm.group_size(self.cp_group)
        if cp > 1:
            ik = self._gather_index_keys(ik)
        sk = k.size(0)
        k_pos = torch.arange(sk, device=q.device)
        q_pos = chunk_positions(sk, cp, comm.group_rank(self.cp_group), q.device) if cp > 1 else k_pos[sk - q.size(0):]
        idx = select_topk(iq, ik, iw, q_pos, k_pos, self.topk)
        scale = 1.0 / math.sqrt(q.size(-1))
        out = sparse_attention(q, k, v, idx, q_pos, scale)
        if self.training and torch.is_grad_enabled() and self.coeff > 0:
            # the mean over the whole sequence's queries: the CP ranks' parts add up to one process's
            loss = indexer_loss(iq, ik, iw, q, k, idx, q_pos, k_pos, scale, self.coeff, self.sparse_loss,
                                self.tp_group, queries=q.size(0) * q.size(1) * cp)
            if first_training_pass():  # not full recompute's second forward, in backward: logged once
                self.loss_sum = loss.detach() + (0 if self.loss_sum is None else self.loss_sum)
            out = AttachLoss.apply(out, loss, self.loss_scale)
        return out

    def _gather_index_keys(self, ik):
        """Context parallelism: the index keys of the whole sequence, all-gathered (D values a token;
        backward reduce-scatters) and put in sequence order, as MLA puts the keys and values. The
        order matters beyond the positions: the ReLU'd index scores tie (at 0) often, and the top-k
        among ties goes by column, so only the one-process order picks one process's keys."""
        c = comm.group_size(self.cp_group)
        order = torch.argsort(gathered_positions(ik.size(0) * c, c, ik.device))
        return gather_sequence(ik, self.cp_group).index_select(0, order)


def dsa_layers(model: list[nn.Module]) -> list[DSAttention]:
    return [m for chunk in model for m in chunk.modules() if isinstance(m, DSAttention)]


def start_iteration(model: list[nn.Module], loss_scale: float) -> None:
    """Zero the indexers' loss sums; `loss_scale`: d(objective)/d(indexer loss) of one micro-batch."""
    for layer in dsa_layers(model):
        layer.loss_scale, layer.loss_sum = loss_scale, None


@torch.no_grad()
def iteration_indexer_loss(model: list[nn.Module], microbatches: int, tp_size: int, dp_size: int,
                           device, cp_size: int = 1) -> float | None:
    """The last iteration's indexer loss as Megatron-LM logs it ("indexer loss"): coeff · KL, summed
    over the DSA layers and divided by the decoder's layers, the mean over its `microbatches` global
    micro-batches. The MTP modules' layers add their losses to the sum but not to the count:
    Megatron-LM's MTP layer numbers its DSAttention 1..D, whose loss lands in the tracker's slot of
    decoder layer k (DSAIndexerLossLoggingHelper.save_loss_to_tracker), and the log divides the
    slots' sum by num_layers. A collective on every rank (each TP rank holds the same values, each
    DP rank its own micro-batches' values, each CP rank its queries' part of them)."""
    t = torch.zeros(2, dtype=torch.float64, device=device)
    for layer in dsa_layers(model):
        if layer.loss_sum is not None:
            t[0] += float(layer.loss_sum)
        t[1] += 0.0 if layer.in_mtp else 1.0
    comm.all_reduce(t, comm.world_group())
    layers = float(t[1]) / (tp_size * dp_size * cp_size)  # every layer is counted by each of its TP x DP x CP ranks
    return float(t[0]) / tp_size / microbatches / layers if layers else None
