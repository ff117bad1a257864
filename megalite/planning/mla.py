"""Multi-latent attention's share of a layer's parameters and activations (model/mla.py), for
planning/memory.py: exact parameter counts, and the activations its tensors keep for backward."""
from __future__ import annotations


def mla_params(c) -> tuple[int, int]:
    """(elements sharded over TP, on one TP rank; elements replicated on every TP rank) of one MLA
    attention: the up-projections and linear_proj split by heads, the down-projections and latent
    norms whole (with linear_proj's bias and a sink logit per head as the ordinary attention's)."""
    m, t = c.model, c.parallel.tensor_model_parallel_size
    h, n = m.hidden_size, m.num_attention_heads // t
    d, dr, dv, r, rq = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
    sharded = n * (d + dr) * (rq or h) + n * (d + dv) * r + n * dv * h
    if m.softmax_type == "learnable":
        sharded += n
    replicated = (rq * h if rq else 0) + (r + dr) * h + (h if m.add_bias_linear else 0)
    if m.qk_layernorm:  # the latent norms
        replicated += ((rq or 0) + r) * (2 if m.normalization == "LayerNorm" else 1)
    return sharded, replicated


def mla_activation_coefficients(c) -> tuple[float, float]:
    """(bytes per token per h of 16-bit activations split with the heads over TP; of the latents,
    whole on each TP rank, split over TP only under sequence parallelism), in the units of
    Korthikanti et al. 2022 Table 2: the query (up-projection output, rotated, scaled), the
    up-projected keys/values and the concatenated keys, the context; the normalised latents kept
    as the up-projections' inputs; under CP the keys and values of the whole sequence (up-projected
    from the gathered latent, model/mla.py; the gathered latent itself, c·kv_lora_rank, is left out:
    the dry run measures 0.995-1.003x this plan on CP2, TP2+SP x CP2 and CP2 with recompute)."""
    m, cp = c.model, c.parallel.context_parallel_size
    h, n = m.hidden_size, m.num_attention_heads
    d, dr, dv, r, rq = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
    heads = n * (3 * (d + dr) + (d + dv) + (d + dr) + dv)
    if cp > 1:  # the gathered keys and values replace the local ones (only concatenated for the gather)
        heads += cp * n * (d + dr + dv) - n * (d + dr) - n * (d + dv)
    latents = 2 * (rq or 0) + 2 * r + 2 * dr
    # fp32 intermediates: RoPE rotates in fp32 (model/attention.py apply_rotary keeps the rotated
    # half, and with 16-bit activations the upcast channels too) and so do the latent RMSNorms:
    # 4 bytes each, in units of 2 bytes (x2 again for fp32 activations, as the rest)
    per = 4.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 1.0
    heads += per / 2 * n * dr
    latents += per / 2 * (dr + (((rq or 0) + r) if m.qk_layernorm else 0))
    return 2.0 * heads / h, 2.0 * latents / h
