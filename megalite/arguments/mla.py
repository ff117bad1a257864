"""Multi-latent attention's flags (--multi-latent-attention, model/mla.py): what they need and
what MLA cannot be combined with."""
from __future__ import annotations

from ..config.run import RunConfig
from .errors import fail

MLA_FLAGS = {"q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim",
             "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim"}


def check_mla(c: RunConfig) -> None:
    """Before check_rope: an MLA flag without --multi-latent-attention; MLA's RoPE and heads."""
    m, k, tp = c.model, c.kernels, c.parallel.tensor_model_parallel_size
    if not m.multi_latent_attention:
        given = [flag for key, flag in MLA_FLAGS.items() if f"model.{key}" in c.explicit]
        if given:
            fail(f"{given[0]} sets multi-latent attention's shape; it needs --multi-latent-attention")
        return
    if "model.kv_channels" not in c.explicit:  # the query/key head size (the attention-backend probe's)
        m.kv_channels = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.position_embedding_type == "yarn":
        fail("--multi-latent-attention takes its YaRN from --rope-type yarn, not --position-embedding-type yarn")
    if m.position_embedding_type == "learned_absolute":  # Megatron-LM's default type: both, as its GPTModel
        c.notices.append("--multi-latent-attention with --position-embedding-type learned_absolute (Megatron-LM's "
                         "default): learned absolute positions are added to the embeddings and MLA's decoupled "
                         "keys get their RoPE (--rope-type) as well, as in Megatron-LM's GPTModel")
    if m.num_attention_heads % tp:
        fail(f"--num-attention-heads ({m.num_attention_heads}) is not divisible by --tensor-model-parallel-size "
             f"({tp}): multi-latent attention splits its heads across TP")
    refused = [("--group-query-attention", m.group_query_attention, "its keys and values are per head, "
                "from a shared latent"),
               ("--add-qkv-bias", m.add_qkv_bias, "it has no fused QKV projection"),
               (f"--rotary-percent {m.rotary_percent}", m.rotary_percent != 1.0, "RoPE rotates all "
                "--qk-pos-emb-head-dim channels"),
               ("--use-rope-scaling", m.use_rope_scaling, "its RoPE is --rope-type rope or yarn"),
               ("--rotary-seq-len-interpolation-factor", m.rotary_seq_len_interpolation_factor,
                "its RoPE is --rope-type rope or yarn"),
               ("--window-size", m.window_size is not None, "megalite's MLA attends to every earlier position"),
               ("--use-flash-attn", k.use_flash_attn and m.qk_head_dim + m.qk_pos_emb_head_dim != m.v_head_dim,
                "flash-attn needs equal query and value head sizes; SDPA runs MLA")]
    for what, given, why in refused:
        if given:
            fail(f"{what} cannot be combined with --multi-latent-attention: {why}")
    if m.qk_pos_emb_head_dim % 2 or m.qk_pos_emb_head_dim < 2:
        fail(f"--qk-pos-emb-head-dim ({m.qk_pos_emb_head_dim}) must be even: RoPE rotates channel pairs")
    if m.mla_yarn and m.rotary_scaling_factor > 1 and m.yarn_original_max_position_embeddings is None:
        # Megatron-LM's MLATransformerConfig.original_max_position_embeddings (its flag is not read for MLA)
        m.yarn_original_max_position_embeddings = 4096
        c.notices.append("--rope-type yarn without --yarn-original-max-position-embeddings: 4096, Megatron-LM's "
                         "MLATransformerConfig default")
