"""Multi-latent attention (MLA; DeepSeek-V2 Sec. 2.1, DeepSeek-V3 Sec. 2.1.1), with Megatron-LM's
module names (megatron/core/transformer/multi_latent_attention.py, MLASelfAttention).

Per token x [h] (n heads, d = --qk-head-dim, dr = --qk-pos-emb-head-dim, dv = --v-head-dim):

    query   c_q = norm(W_DQ x) [q_lora_rank], q = W_UQ c_q [n, d + dr]     (--q-lora-rank)
            or q = W_Q x [n, d + dr]                                        (no --q-lora-rank)
    kv      [c_kv ; k_r] = W_DKV x [kv_lora_rank + dr], c_kv = norm(c_kv)
            [k_c ; v] = W_UKV c_kv [n, d + dv]
    keys    k = [k_c ; RoPE(k_r)] (the rotated k_r shared by every head: the "decoupled" key)
    queries q = [q_c ; RoPE(q_r)]
    out     W_O · softmax(q·kᵀ · m² / √(d + dr)) · v

with m YaRN's attention scaling of --mscale-all-dim (1 without YaRN). While generating only c_kv
and the rotated k_r are cached, kv_lora_rank + dr values per token (DeepSeek-V2 Eq. 9-11: the
93.3% smaller KV cache); the up-projection runs over the cached latent when attending.

Names: linear_q_proj, or linear_q_down_proj / q_layernorm / linear_q_up_proj; linear_kv_down_proj /
kv_layernorm / linear_kv_up_proj; linear_proj. The two latent norms exist with --qk-layernorm, as
in Megatron-LM's MLA layer spec (IdentityOp otherwise).

Tensor parallelism: the heads are split, so the up-projections are column-parallel and linear_proj
row-parallel; the down-projections and latent norms are replicated. Their gradient is complete on
every TP rank because the up-projection's input enters the TP region through copy_to_tp (and k_r
through its own copy_to_tp): backward all-reduces the heads' partial gradients there. Under
sequence parallelism the down-projections run on this rank's s/tp tokens and the up-projections
gather the (narrow) latent, so the down weights' gradient is a partial sum over tokens, marked for
the TP all-reduce as the other replicated weights there.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import comm
from ..context_parallel.attention import gather_sequence
from ..context_parallel.sharding import chunk_positions, gathered_positions
from ..recompute import recompute
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_init
from ..tensor_parallel.fp8_linear import fp8_linear
from ..tensor_parallel.mappings import copy_to_tp, gather_from_sp
from ..tensor_parallel.param_info import param_info
from .attention import CoreAttention, apply_rotary, yarn_concentration
from .config import ExecutionConfig, GPTConfig
from .dsa import DSAttention
from .norm import Norm


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with W [out, in] whole on every TP rank (MLA's down-projections). Under sequence
    parallelism each rank sees other tokens: the gradient is marked for a TP all-reduce."""

    fp8 = None  # --fp8-format: its FP8 GEMM site (model/fp8.py)

    def __init__(self, input_size: int, output_size: int, execution: ExecutionConfig, init_std: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=execution.params_dtype, device=device))
        set_init(self.weight, "normal", init_std)
        param_info(self.weight).sequence_parallel = execution.sequence_parallel

    def forward(self, x):
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, None, self.fp8)
        return torch.nn.functional.linear(x, self.weight)


def mla_softmax_scale_factor(config: GPTConfig) -> float:
    """m² of the softmax scale m² / √(d + dr): YaRN's mscale of --mscale-all-dim, squared
    (Megatron-LM's MLASelfAttention and transformers' DeepseekV3Attention); 1 without YaRN."""
    if config.yarn() is None:
        return 1.0
    m = yarn_concentration(config.rotary_scaling_factor, config.mscale_all_dim, 0.0)  # 0.1·a·ln s + 1
    return m * m


class MLASelfAttention(nn.Module):
    """[s, b, h] in (s/tp under sequence parallelism, s/c under context parallelism), [s, b, h] out.
    `rotary`: (cos, sin) of --qk-pos-emb-head-dim channels (GPTModel builds them for MLA)."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, device=None,
                 cp_group=None, layer_number: int = 0):
        super().__init__()
        tp = comm.group_size(tp_group)
        if config.num_attention_heads % tp:
            raise ValueError(f"--num-attention-heads ({config.num_attention_heads}) is not divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        self.tp_group, self.cp_group, self.sequence_parallel = tp_group, cp_group, execution.sequence_parallel
        n = config.num_attention_heads
        self.num_heads = n // tp
        self.qk_dim, self.pos_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        q_head = self.qk_dim + self.pos_dim
        h, std = config.hidden_size, config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        column = dict(tp_group=tp_group, bias=False, sequence_parallel=execution.sequence_parallel,
                      dtype=execution.params_dtype, device=device, init_std=std)
        latent_norm = (lambda size: Norm(config, execution, device, size=size)) if config.qk_layernorm else None
        if self.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, n * q_head, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, self.q_lora_rank, execution, std, device)
            self.q_layernorm = latent_norm(self.q_lora_rank) if latent_norm else None
            self.linear_q_up_proj = ColumnParallelLinear(self.q_lora_rank, n * q_head, **column)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.pos_dim, execution, std, device)
        self.kv_layernorm = latent_norm(self.kv_lora_rank) if latent_norm else None
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_lora_rank, n * (self.qk_dim + self.v_dim), **column)
        # --experimental-attention-variant dsa: DeepSeek Sparse Attention's indexer and sparse softmax (model/dsa.py)
        self.dsa = config.dsa
        self.core_attention = (DSAttention(config, execution, tp_group, device, cp_group) if self.dsa else
                               CoreAttention(config.attention_dropout, execution, rng_tracker, self.num_heads,
                                             config.softmax_type, std, device, layer_number))
        self.linear_proj = RowParallelLinear(n * self.v_dim, h, tp_group=tp_group, bias=config.add_bias_linear,
                                             sequence_parallel=execution.sequence_parallel,
                                             dtype=execution.params_dtype, device=device, init_std=out_std)
        # SDPA scales by 1/√(d + dr); YaRN's m² goes on the queries (the same logits)
        self.query_scale = mla_softmax_scale_factor(config)
        self.recompute_core_attention = False  # set by activation recompute ("selective")
        self.recompute_up_proj = False  # --recompute-modules mla_up_proj: the up projections and RoPE
        # while generating: a cache of the latent c_kv and the rotated k_r (megalite.generation.KVCache)
        self.inference_cache = None

    def _queries(self, x, rotary):
        """(q [s, b, n/tp, d + dr], RoPE applied to its last dr channels; the normalised query latent
        [s_local, b, q_lora_rank], DSA's indexer input, or None without --q-lora-rank)."""
        c_q = None
        if self.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            c_q = self.linear_q_down_proj(x)  # [s_local, b, q_lora_rank]
            c_q = self.q_layernorm(c_q) if self.q_layernorm is not None else c_q
            q = self.linear_q_up_proj(c_q)
        s, b = q.shape[:2]
        q = q.view(s, b, self.num_heads, self.qk_dim + self.pos_dim)
        if rotary is not None:
            q_c, q_r = q.split([self.qk_dim, self.pos_dim], dim=-1)
            q = torch.cat([q_c, apply_rotary(q_r, *rotary)], dim=-1)
        return (q * self.query_scale if self.query_scale != 1.0 else q), c_q

    def _latent(self, x, rotary):
        """(c_kv [s_local, b, kv_lora_rank] normalised, k_r [s, b, 1, dr] rotated and in the TP region)."""
        c_kv, k_r = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            c_kv = self.kv_layernorm(c_kv)
        # every local head reads k_r: its gradient is a partial sum over TP (reduced in backward)
        k_r = gather_from_sp(k_r, self.tp_group) if self.sequence_parallel else copy_to_tp(k_r, self.tp_group)
        k_r = k_r.unsqueeze(2)
        return c_kv, (apply_rotary(k_r, *rotary) if rotary is not None else k_r)

    def keys_values(self, c_kv, k_r, rows=None):
        """Per-head k [s, b, n/tp, d + dr] and v [s, b, n/tp, dv] from the latent and the rotated k_r
        (whose rows follow the up-projection's); `rows` (CP): the order attention wants them in."""
        kv = self.linear_kv_up_proj(c_kv)
        s, b = kv.shape[:2]
        k_c, v = kv.view(s, b, self.num_heads, self.qk_dim + self.v_dim).split([self.qk_dim, self.v_dim], dim=-1)
        k = torch.cat([k_c, k_r.expand(-1, -1, self.num_heads, -1)], dim=-1)
        if rows is None:
            return k, v
        return k.index_select(0, rows), v.index_select(0, rows)  # copies: the up-projection's output is freed

    def _gather_latent(self, c_kv, k_r):
        """Context parallelism: the whole sequence's normalised latent c_kv and rotated k_r
        (kv_lora_rank + dr values a token, DeepSeek-V2 Sec. 2.1.2's small cache, instead of every
        head's keys and values) all-gathered over the CP group (backward reduce-scatters); each CP
        rank up-projects the whole sequence. Under sequence parallelism c_kv is this TP rank's slice
        of the CP rank's tokens and the up-projection gathers the slices over TP after the CP
        gather, so its rows come TP rank by TP rank; k_r (gathered over TP already) is put in that
        order. Returns c_kv, k_r and `rows`, the order attention wants the keys in: the gathered
        order (the CP mask's columns), or sequence order for DSA (its top-k among tied scores)."""
        c = comm.group_size(self.cp_group)
        s = k_r.size(0) * c
        gathered = gathered_positions(s, c, k_r.device)
        up = gathered
        t = comm.group_size(self.tp_group)
        if self.sequence_parallel and t > 1:  # rows: TP rank j's slice of each CP rank's tokens, j by j
            n = s // (c * t)
            up = torch.cat([chunk_positions(s, c, i, k_r.device)[j * n:(j + 1) * n] for j in range(t) for i in range(c)])
        row_of = torch.argsort(gathered)  # row_of[p]: the gathered row holding position p
        k_r = gather_sequence(k_r, self.cp_group).index_select(0, row_of[up])
        target = torch.arange(s, device=k_r.device) if self.dsa else gathered
        return gather_sequence(c_kv, self.cp_group), k_r, torch.argsort(up)[target]

    def forward(self, x, rotary=None, attention_mask=None):
        up = self.recompute_up_proj and self.training and torch.is_grad_enabled()
        q, c_q = recompute(self._queries, x, rotary) if up else self._queries(x, rotary)
        c_kv, k_r = self._latent(x, rotary)
        rows = None
        if comm.group_size(self.cp_group) > 1:  # the whole sequence's latent (DSA's indexer picks among its keys)
            c_kv, k_r, rows = self._gather_latent(c_kv, k_r)
        if self.inference_cache is not None:
            if self.sequence_parallel:
                raise ValueError("MLA's generation cache holds whole sequences; build the model without "
                                 "sequence parallelism to generate")
            # the latent and the rotated key join the cached ones: kv_lora_rank + dr values per token
            c_kv, k_r, attention_mask = self.inference_cache.update(c_kv, k_r, attention_mask)
        k, v = recompute(self.keys_values, c_kv, k_r, rows) if up else self.keys_values(c_kv, k_r, rows)
        if self.dsa:
            return self.linear_proj(self.core_attention(q, k, v, x, c_q, rotary, self.inference_cache))
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            ctx = recompute(self.core_attention, q, k, v, attention_mask, rng_tracker=self.core_attention.rng_tracker)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(ctx)
