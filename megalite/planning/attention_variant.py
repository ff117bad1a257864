"""The attention variants' share of a layer's parameters and activations, for planning/memory.py:
the gated DeltaNet layer (model/gated_delta_net.py), the output gate (--attention-output-gate) and
DSA's indexer (model/dsa.py). Counts follow the code: each term names the tensor backward keeps."""
from __future__ import annotations

from ..config.attention_variant import linear_attention_pattern
from ..model.delta_rule import CHUNK


def linear_pattern(c) -> list[bool]:
    """Per decoder layer, whether it is a gated DeltaNet layer."""
    m = c.model
    if m.experimental_attention_variant not in ("gated_delta_net", "gdn"):
        return [False] * m.num_layers
    return linear_attention_pattern(m.linear_attention_freq, m.num_layers)


def _gdn_shape(c):
    m, t = c.model, c.parallel.tensor_model_parallel_size
    nk, nv, dk, dv = m.linear_num_key_heads // t, m.linear_num_value_heads // t, m.linear_key_head_dim, \
        m.linear_value_head_dim
    return nk, nv, dk, dv, nk * (2 * dk) + nv * dv  # conv channels on this rank


def gdn_params(c) -> tuple[int, int]:
    """(elements sharded over TP on one rank, replicated) of a DeltaNet layer's attention part:
    in_proj [nk·(2dk + 2r·dv + 2r), h], conv1d [channels, 1, K], dt_bias and A_log [nv], out_proj
    [h, nv·dv] split by key head; out_norm [dv] whole (with LayerNorm its bias too)."""
    m = c.model
    nk, nv, dk, dv, conv = _gdn_shape(c)
    h = m.hidden_size
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    sharded = rows * h + conv * m.linear_conv_kernel_dim + 2 * nv + nv * dv * h
    if m.add_bias_linear:
        sharded += rows
    replicated = dv * (2 if m.normalization == "LayerNorm" else 1) + (h if m.add_bias_linear else 0)
    return sharded, replicated


def output_gate_params(c) -> int:
    """The gate's rows in linear_qkv (one per query channel), on one TP rank."""
    m = c.model
    rows = m.num_attention_heads * m.kv_channels // c.parallel.tensor_model_parallel_size
    return rows * m.hidden_size + (rows if m.add_bias_linear else 0) if m.attention_output_gate else 0


def indexer_params(c) -> int:
    """DSA's indexer, whole on every TP rank: wq_b [H·D, q_lora_rank], wk [D, h], its LayerNorm
    (weight and bias), weights_proj [H, h]."""
    m = c.model
    if m.experimental_attention_variant != "dsa":
        return 0
    heads, dim = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
    return heads * dim * m.q_lora_rank + dim * m.hidden_size + 2 * dim + heads * m.hidden_size


def gdn_activation_bytes_per_token(c, selective: bool) -> float:
    """Bytes a DeltaNet layer's attention part keeps per token (beyond its input, which the layer's
    replicated terms count). The chunked rule runs in fp32 whatever the activations' dtype: per
    value head six C-wide rows (the decay, the masked K·Kᵀ, T, the intra-chunk scores and their
    reshaped copies; C = delta_rule.CHUNK), eleven dk-wide and eight dv-wide fp32 rows (q, k, the
    β-scaled keys, W, the decayed keys, U, V', the output, the norm's and gate's tensors), eight
    scalars, the chunk states (2·dk·dv / C); the activation dtype's conv input (padded) and
    pre-activation, the gate product and out_proj's input. Selective recompute keeps the rule's
    fp32 inputs (q, k [nv, dk], v [nv, dv], g, β) instead of its insides."""
    e = 2.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 4.0
    nk, nv, dk, dv, conv = _gdn_shape(c)
    rule = 4.0 * nv * (6 * CHUNK + 11 * dk + 8 * dv + 8 + 2 * dk * dv / CHUNK)
    if selective:
        # its inputs (q, k, v copies, g, β), and the output norm's and gate's tensors, β's and softplus's
        rule = 4.0 * nv * (2 * dk + dv + 2) + 4.0 * nv * (4 * dv + 4)
    qk = 4.0 * 2 * nk * dk if e == 2.0 else 4.0 * conv  # fp32 copies of q, k (fp32 runs: the conv's output)
    return rule + 4.0 * 2 * nk + e * 2 * conv + qk + 2 * e * nv * dv


def dsa_activation_bytes_per_token(c) -> float:
    """What DSA keeps per token beside MLA's q, k, v (and instead of any [s, s] scores): the selected
    key indices (int64, K of them), the indexer's outputs in the activations' dtype, and with
    --dsa-indexer-loss-coeff their fp32 gradients computed in forward (model/dsa.py)."""
    m = c.model
    e = 2.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 4.0
    width = m.dsa_indexer_n_heads * m.dsa_indexer_head_dim + m.dsa_indexer_head_dim + m.dsa_indexer_n_heads
    loss = 4.0 * width if m.dsa_indexer_loss_coeff else 0.0
    return 8.0 * min(m.dsa_indexer_topk, m.seq_length) + e * width + loss
