"""--optimizer muon's share of the parameters: the 1-D tensors (norms, biases, sink logits) of a
transformer layer and of the experts, which Muon leaves to its scalar optimizer with the word
embedding and output layer (optimizer/muon_matrices.py: `is_matrix`). memory.py counts the rest
of a stage as Muon's matrices, 4 bytes of momentum each, where Adam keeps 8 (Lion 4)."""
from __future__ import annotations

from .moe import expert_tp


def layer_vector_params(c, moe: bool = False) -> int:
    """Elements of one layer's 1-D tensors on one TP rank (routed experts aside: `expert_vector_params`)."""
    m, t = c.model, c.parallel.tensor_model_parallel_size
    h, bias = m.hidden_size, bool(m.add_bias_linear)
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    n = 2 * h * per_norm  # the input and pre-MLP norms
    if m.softmax_type == "learnable":
        n += m.num_attention_heads // t
    if m.multi_latent_attention:
        n += (h if bias else 0) + (((m.q_lora_rank or 0) + m.kv_lora_rank) * per_norm if m.qk_layernorm else 0)
    else:
        qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels // t
        n += (qkv if bias or m.add_qkv_bias else 0) + (h if bias else 0)
        n += 2 * m.kv_channels * per_norm if m.qk_layernorm else 0
    fc1 = m.gated_linear_unit + 1
    if moe:
        f_s = m.moe_shared_expert_intermediate_size or 0
        n += (m.num_experts + (fc1 * f_s // t + h if f_s else 0)) if bias else 0
    elif bias:
        n += fc1 * m.ffn_hidden_size // t + h
    return n


def expert_vector_params(c) -> int:
    """Elements of the routed experts' biases one GPU holds per MoE layer (fc1's split over ETP)."""
    m, p = c.model, c.parallel
    if not m.add_bias_linear:
        return 0
    fc1 = m.expert_ffn_hidden_size * (m.gated_linear_unit + 1)
    return m.num_experts // p.expert_model_parallel_size * (fc1 // expert_tp(c) + m.hidden_size)
