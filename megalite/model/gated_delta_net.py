"""The gated DeltaNet layer (Yang et al. 2024; Qwen3-Next, Qwen3.5), with Megatron-LM's names
(megatron/core/ssm/gated_delta_net: in_proj, conv1d, dt_bias, A_log, out_norm, out_proj).

    x [s, b, h] -> in_proj -> per key head: q [dk], k [dk], v [r·dv], z [r·dv], b [r], a [r]
                             (r = value heads per key head)
    q, k, v = act(causal depthwise conv1d over time, width --linear-conv-kernel-dim)
    q, k = l2norm(q), l2norm(k), each key head serving its r value heads
    β = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias)        (per value head, fp32)
    o = gated delta rule(q, k, v, g, β)                            (model/delta_rule.py)
    y = out_proj(out_norm(o) · act(z))                             (the output gate; norm per head)

act is the MLP's activation (SiLU with --swiglu), as Megatron-LM's config.activation_func.

Layout: in_proj's rows and conv1d's channels go by key head, [nk, (q, k, v, z, b, a)] and
[nk, (q, k, v)] (Qwen3-Next's in_proj_qkvz / in_proj_ba order), so a contiguous split gives each
tensor-parallel rank whole key heads with their value heads, as megalite's fused QKV goes by
query group: in_proj and conv1d are column-parallel, dt_bias and A_log split by value head,
out_proj row-parallel, out_norm replicated (its gradient summed over TP: each rank normalises
its own heads). Under sequence parallelism in_proj gathers the sequence and out_proj
reduce-scatters it, as any attention layer's projections.

Memory: no [s, s] tensor anywhere; the chunked rule keeps O(s) (delta_rule.py).

Context parallelism (c ranks, each holding chunks r and 2c-1-r of the sequence): the state runs
through the sequence in order, so instead of handing it from rank to rank the layer goes head-
parallel, as Megatron-LM's GDN (cp2hp / hp2cp) and DeepSpeed-Ulysses: after in_proj one
all-to-all gives each CP rank the whole sequence of 1/c of its key heads (q, k, v with β and a),
reordered into sequence order; the convolution (its channels' weights sliced per CP rank) and the
chunked rule run as on one process; the inverse all-to-all returns the output of every head for
this rank's tokens, and the norm, gate and out_proj run on them. Exact; traffic O(s·channels/c)
per rank; needs the key heads per TP rank to divide by c.
Packed documents (--reset-attention-mask): the attention mask is then megalite's `Documents`,
whose per-token document ids (the whole sequence, in order: what this layer runs on, under CP too)
stop both the convolution and the delta rule at every document start: a convolution tap reads
only its own document's tokens, and the state starts again (delta_rule.py), so each document is
computed as if alone.
Generation keeps `DeltaNetState`: the last (width - 1) conv inputs and the [dk, dv] state per
value head, so each new token costs O(1) in the sequence length.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..recompute import recompute
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_init
from ..tensor_parallel.layers import set_tp_attributes
from .config import ExecutionConfig, GPTConfig
from ..context_parallel.documents import Documents
from ..context_parallel.sharding import gathered_positions
from ..context_parallel.ulysses import gather_heads, scatter_sequence
from .delta_rule import gated_delta_rule, l2norm, recurrent_delta_rule
from .mlp import quick_gelu
from .norm import Norm


def layer_activation(config: GPTConfig):
    """The MLP's activation function (not the GLU): Megatron-LM's config.activation_func."""
    if config.swiglu:
        return F.silu
    if config.quick_geglu:
        return quick_gelu
    return (lambda x: F.gelu(x, approximate="tanh")) if config.openai_gelu else F.gelu


class DeltaNetState:
    """One layer's generation cache: conv [b, channels, width - 1] (the last inputs of the causal
    convolution) and the delta rule's state [b, value heads, dk, dv], this rank's heads."""

    def __init__(self, max_len: int = 0):
        self.max_len, self.conv, self.state = max_len, None, None


class GatedDeltaNet(nn.Module):
    """[s, b, h] in ([s/tp, b, h] under sequence parallelism), [s, b, h] out."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, device=None,
                 cp_group=None, layer_number: int = 0):
        super().__init__()
        tp = comm.group_size(tp_group)
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nv % nk:
            raise ValueError(f"--linear-num-value-heads ({nv}) is not a multiple of --linear-num-key-heads ({nk})")
        if nk % tp:
            raise ValueError(f"--linear-num-key-heads ({nk}) is not divisible by --tensor-model-parallel-size ({tp})")
        cp = comm.group_size(cp_group)
        if (nk // tp) % cp:
            raise ValueError(f"--linear-num-key-heads ({nk}) / TP ({tp}) is not divisible by --context-parallel-size "
                             f"({cp}): each CP rank runs the whole sequence of 1/{cp} of the key heads")
        self.cp_group = cp_group
        self.dk, self.dv, self.r = config.linear_key_head_dim, config.linear_value_head_dim, nv // nk
        self.groups = nk // tp  # key heads on this rank, each with r value heads
        self.width = config.linear_conv_kernel_dim
        self.act = layer_activation(config)
        per_group = 2 * self.dk + 2 * self.r * self.dv + 2 * self.r
        self.conv_per_group = 2 * self.dk + self.r * self.dv
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=execution.sequence_parallel,
                      dtype=execution.params_dtype, device=device)
        self.in_proj = ColumnParallelLinear(config.hidden_size, nk * per_group, init_std=std, **common)
        self.conv1d = nn.Module()  # Megatron-LM's nn.Conv1d (depthwise, no bias): weight [channels, 1, width]
        self.conv1d.weight = nn.Parameter(torch.empty(self.groups * self.conv_per_group, 1, self.width,
                                                      dtype=execution.params_dtype, device=device))
        set_tp_attributes(self.conv1d.weight, 0)
        # PyTorch's Conv1d default (kaiming_uniform with a = √5): U(±1/√fan_in), fan_in = width
        bound = 1.0 / math.sqrt(self.width)
        set_init(self.conv1d.weight, "uniform", bounds=(-bound, bound))
        self.dt_bias = nn.Parameter(torch.empty(nv // tp, dtype=execution.params_dtype, device=device))
        set_tp_attributes(self.dt_bias, 0)
        set_init(self.dt_bias, "ones")
        self.A_log = nn.Parameter(torch.empty(nv // tp, dtype=execution.params_dtype, device=device))
        set_tp_attributes(self.A_log, 0)
        set_init(self.A_log, "log_uniform", bounds=(1.0, 16.0))  # Megatron-LM's A_init_range
        self.out_norm = Norm(config, execution, device, size=self.dv, head_sharded=True)
        self.out_proj = RowParallelLinear(nv * self.dv, config.hidden_size, init_std=out_std, **common)
        self.recompute_core_attention = False  # selective recompute: the delta rule redone in backward
        self.inference_cache: DeltaNetState | None = None  # while generating (megalite.generation)

    def forward(self, x, rotary=None, attention_mask=None):
        p = self.in_proj(x)  # [s, b, groups·per_group] (s/c tokens under CP)
        s, b = p.shape[:2]
        dk, dv, r = self.dk, self.dv, self.r
        p = p.view(s, b, self.groups, -1)
        qkv, z, beta, a = p.split([self.conv_per_group, r * dv, r, r], dim=-1)
        cp = comm.group_size(self.cp_group)
        if cp > 1:  # the whole sequence, in order, of this CP rank's 1/c key heads
            qkv, beta, a, gathered = self._to_heads(qkv, beta, a)
        sq, groups = qkv.shape[0], qkv.size(2)
        conv_w, dt_bias, A_log = self._local_weights()
        seg = attention_mask.doc_ids if isinstance(attention_mask, Documents) else None  # [b, sq]
        qkv = self._conv(qkv.reshape(sq, b, -1).permute(1, 2, 0), conv_w, seg)  # [b, channels, sq]
        q, k, v = qkv.transpose(1, 2).reshape(b, sq, groups, -1).split([dk, dk, r * dv], dim=-1)
        q, k = (l2norm(t.float()).repeat_interleave(r, dim=2) for t in (q, k))  # [b, sq, heads, dk]
        v = v.reshape(b, sq, -1, dv)
        beta = torch.sigmoid(beta.reshape(sq, b, -1).transpose(0, 1).float())
        g = -A_log.float().exp() * F.softplus(a.reshape(sq, b, -1).transpose(0, 1).float() + dt_bias.float())
        o = self._rule(q, k, v, g, beta, seg)  # [b, sq, heads, dv]
        if cp > 1:  # back to this rank's tokens, every local head (Megatron-LM's hp2cp)
            o = gather_heads(o.transpose(0, 1).index_select(0, gathered), self.cp_group).transpose(0, 1)
        z = z.reshape(s, b, -1, dv).transpose(0, 1)
        y = (self.out_norm(o) * self.act(z.float())).to(x.dtype)  # norm before the gate (Qwen3-Next's RMSNormGated)
        return self.out_proj(y.transpose(0, 1).reshape(s, b, -1))

    def _to_heads(self, qkv, beta, a):
        """Context parallelism (Megatron-LM's GDN cp2hp): one all-to-all turns this rank's s/c tokens
        of every key head ([s/c, b, groups, ...], chunks r and 2c-1-r) into the whole sequence of
        groups/c key heads (with their value heads' β and a), put back in sequence order: the
        convolution and the delta rule then run exactly as on one process, since both are per head
        (the convolution per channel). Returns qkv, β, a [s, b, groups/c, ...] and the gathered
        order's positions (index_select by them returns sequence order to the gathered one)."""
        s = qkv.size(0) * comm.group_size(self.cp_group)
        gathered = gathered_positions(s, comm.group_size(self.cp_group), qkv.device)
        heads = scatter_sequence(torch.cat([qkv, beta, a], dim=-1), self.cp_group)
        heads = heads.index_select(0, torch.argsort(gathered))  # [s, b, groups/c, ...] in sequence order
        return (*heads.split([self.conv_per_group, self.r, self.r], dim=-1), gathered)

    def _local_weights(self):
        """conv1d's channels, dt_bias and A_log of the key heads this rank runs: all of this TP
        rank's, or under CP the CP rank's 1/c of them (each CP rank's gradient lands in its own
        slice; the data-parallel reduction, over DP x CP, sums the slices)."""
        w, dt_bias, A_log = self.conv1d.weight, self.dt_bias, self.A_log
        cp = comm.group_size(self.cp_group)
        if cp == 1:
            return w, dt_bias, A_log
        rank, per = comm.group_rank(self.cp_group), self.groups // cp
        return (w.view(self.groups, -1, 1, self.width)[rank * per:(rank + 1) * per].reshape(-1, 1, self.width),
                dt_bias.view(self.groups, -1)[rank * per:(rank + 1) * per].reshape(-1),
                A_log.view(self.groups, -1)[rank * per:(rank + 1) * per].reshape(-1))

    def _conv(self, x, w, seg=None):
        """Causal depthwise convolution (weight w [channels, 1, width]) + activation over time: x [b, channels, s];
        `seg` [b, s]: each token's document, a tap reading another document's token reads 0."""
        cache = self.inference_cache
        if cache is None and seg is not None:
            # y_t = Σ_j w_j · x_{t-j} · [seg_{t-j} = seg_t], tap j = width-1-(kernel index) as conv1d counts
            y = 0
            for j in range(self.width):
                same = (F.pad(seg, (j, 0), value=-1)[:, :seg.size(1)] == seg).unsqueeze(1)  # [b, 1, s]
                y = y + w[:, 0, self.width - 1 - j, None] * F.pad(x, (j, 0))[..., :x.size(-1)] * same
            return self.act(y)
        if cache is None:
            return self.act(F.conv1d(F.pad(x, (self.width - 1, 0)), w, groups=w.size(0)))
        past = cache.conv if cache.conv is not None else x.new_zeros(x.size(0), x.size(1), self.width - 1)
        full = torch.cat([past, x], dim=-1)
        cache.conv = full[..., full.size(-1) - (self.width - 1):]
        return self.act(F.conv1d(full, w, groups=w.size(0)))

    def _rule(self, q, k, v, g, beta, seg=None):
        cache = self.inference_cache
        if cache is not None:  # generation: carry the state; one token at a time needs no chunks
            rule = recurrent_delta_rule if q.size(1) == 1 else (
                lambda *t: gated_delta_rule(*t, final_state=True))
            o, cache.state = rule(q, k, v, g, beta, cache.state)
            return o
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            return recompute(lambda *t: gated_delta_rule(*t, seg=seg)[0], q, k, v, g, beta)
        return gated_delta_rule(q, k, v, g, beta, seg=seg)[0]
