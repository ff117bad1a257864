"""The GPT architecture, by Megatron-LM flag name: what checkpoints record as the model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .attention_variant import LINEAR_VARIANTS, VARIANTS, linear_attention_pattern
from .fields import AT_LEAST_1, NON_NEGATIVE, POSITIVE, PROBABILITY, derived, flag
from .moe import every_nth_pattern, moe_layer_pattern


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` x TP so the
    embedding splits evenly and the GEMM shapes stay friendly."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def parse_window_size(text: str) -> tuple[int, int]:
    """--window-size "LEFT,RIGHT" (or "(LEFT,RIGHT)", Megatron-LM's tuple_type) -> (left, right).
    Raises ValueError for anything else."""
    parts = str(text).strip().strip("()").split(",")
    if len(parts) != 2:
        raise ValueError(f"two integers LEFT,RIGHT, got {text!r}")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"two integers LEFT,RIGHT, got {text!r}") from None
    return left, right


def window_layer_pattern(freq, num_layers: int) -> list[bool]:
    """Per layer, whether --window-size applies (--window-attn-skip-freq): every layer without it;
    an int N: all but every N-th layer counted from 1; a list: 1 windowed, 0 full. Raises
    ValueError (with why) for a bad value."""
    if freq is None:
        return [True] * num_layers
    return every_nth_pattern(freq, num_layers)


@dataclass
class GPTConfig:
    """model: the architecture (Megatron-LM's model flags)."""
    num_layers: int = flag("--num-layers", None, "number of transformer layers (>= 1; required)", type=int,
                           check=AT_LEAST_1, required=True)
    hidden_size: int = flag("--hidden-size", None, "transformer hidden size h (>= 1; required)", type=int,
                            check=AT_LEAST_1, required=True)
    num_attention_heads: int = flag("--num-attention-heads", None, "number of attention heads a (>= 1; required)",
                                    type=int, check=AT_LEAST_1, required=True)
    vocab_size: int = derived(0, "the tokenizer's vocabulary, unpadded (filled when the tokenizer is built)")
    padded_vocab_size: int = derived(0, "vocab_size padded to --make-vocab-size-divisible-by x TP")
    make_vocab_size_divisible_by: int = flag("--make-vocab-size-divisible-by", 128,
                                             "pad the vocabulary to a multiple of this x TP (>= 1)", check=AT_LEAST_1)
    seq_length: int = flag("--seq-length", None, "sequence length s (>= 1; required)", type=int, check=AT_LEAST_1,
                           required=True)
    max_position_embeddings: int = flag("--max-position-embeddings", None,
                                        "size of the learned position table (>= --seq-length; default s)", type=int,
                                        check=AT_LEAST_1)
    ffn_hidden_size: int | None = flag("--ffn-hidden-size", None, "MLP hidden size (>= 1; default 4h, 8h/3 with --swiglu)",
                                       type=int, check=AT_LEAST_1)
    group_query_attention: bool = flag("--group-query-attention", False, "grouped-query attention",
                                       action="store_true")
    # None: multi-head attention (one group per head)
    num_query_groups: int | None = flag("--num-query-groups", None, "key/value groups with --group-query-attention "
                                        "(>= 1, divides --num-attention-heads)", type=int, check=AT_LEAST_1)
    kv_channels: int | None = flag("--kv-channels", None, "per-head size (>= 1; default h / a)", type=int,
                                   check=AT_LEAST_1)
    # rope: RoPE; yarn: RoPE with YaRN's frequencies and cos/sin scaling (Megatron-LM's
    # position_embedding_type "yarn", with the --rotary-scaling-factor / --yarn-* / --mscale flags)
    position_embedding_type: str = flag("--position-embedding-type", "learned_absolute",
                                        "learned_absolute, rope, or yarn (RoPE with YaRN's context extension)",
                                        choices=["learned_absolute", "rope", "yarn"])
    # Megatron-LM's --rope-type: the RoPE of multi-latent attention (rope or yarn); ordinary attention
    # takes rope only (Megatron-LM asserts it), its YaRN being --position-embedding-type yarn
    rope_type: str | None = flag("--rope-type", None, "multi-latent attention's RoPE (Megatron-LM's flag); "
                                 "ordinary attention takes only rope: use --position-embedding-type yarn for YaRN",
                                 choices=["rope", "yarn"])
    rotary_base: float = flag("--rotary-base", 10000.0, "RoPE base (> 0)", check=POSITIVE)
    # RoFormer's pairing (Su et al. 2021): channels (2i, 2i+1) rotate together, not (i, i + d/2)
    rotary_interleaved: bool = flag("--rotary-interleaved", False, "RoPE rotates pairs of even and odd channels "
                                    "(RoFormer's, GPT-J's) instead of the first and second half (Llama's)",
                                    action="store_true")
    rotary_percent: float = flag("--rotary-percent", 1.0, "fraction of head channels rotated by RoPE, in (0, 1]",
                                 check=(lambda v: 0 < v <= 1, "in (0, 1]"))
    normalization: str = flag("--normalization", "LayerNorm", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = flag("--norm-epsilon", 1e-5, "epsilon of the norms (> 0)", check=POSITIVE)
    swiglu: bool = flag("--swiglu", False, "SwiGLU MLP instead of GeLU", action="store_true")
    # gpt-oss's MLP (Megatron-LM's --quick-geglu): a GLU whose gate goes through quick_gelu,
    # x·sigmoid(1.702·x) (Hendrycks & Gimpel 2016, Sec. 2's sigmoid approximation)
    quick_geglu: bool = flag("--quick-geglu", False, "gated MLP with quick GeLU, x·sigmoid(1.702·x), on the gate "
                             "(gpt-oss's) instead of GeLU", action="store_true")
    # Nemotron-4's MLP (So et al. 2021, Primer): relu(x)², not gated (Megatron-LM's --squared-relu)
    squared_relu: bool = flag("--squared-relu", False, "squared ReLU MLP, relu(x)^2, instead of GeLU (not with "
                              "--swiglu or --quick-geglu)", action="store_true")
    glu_linear_offset: float = flag("--glu-linear-offset", 0.0, "gated MLPs: act(gate) · (up + this) (gpt-oss: 1)")
    activation_func_clamp_value: float | None = flag(
        "--activation-func-clamp-value", None, "--quick-geglu: the gate clamped to at most this, the up half to "
        "[-this, this], before the activation (gpt-oss: 7; > 0)", type=float, check=POSITIVE)
    add_bias_linear: bool = flag("--disable-bias-linear", True, "no biases in linear layers", action="store_false")
    # Qwen's attention: biases on the query, key and value projections only (Megatron-LM's --add-qkv-bias)
    add_qkv_bias: bool = flag("--add-qkv-bias", False, "biases in the QKV projection only (with "
                              "--disable-bias-linear: Qwen2's attention)", action="store_true")
    untie_embeddings_and_output_weights: bool = flag(
        "--untie-embeddings-and-output-weights", False, "separate output layer instead of reusing the word embedding",
        action="store_true")
    hidden_dropout: float = flag("--hidden-dropout", 0.1, "dropout probability, in [0, 1)", check=PROBABILITY)
    attention_dropout: float = flag("--attention-dropout", 0.1, "dropout probability, in [0, 1)", check=PROBABILITY)
    init_method_std: float = flag("--init-method-std", 0.02, "std of the normal weight init (> 0)", check=POSITIVE)
    # zero-centred norm weights: stored as w - 1, applied as 1 + w (Megatron-LM's LayerNorm1P)
    apply_layernorm_1p: bool = flag(
        "--apply-layernorm-1p", False, "zero-centred norm weights (Megatron-LM's LayerNorm1P, LayerNorm and "
        "RMSNorm): the weight is stored as w - 1 (initialised to 0) and applied as 1 + w; checkpoints record it",
        action="store_true")
    # GPT-2's tanh approximation of GeLU (Hendrycks & Gimpel 2016, Sec. 2), Megatron's --openai-gelu
    openai_gelu: bool = flag("--openai-gelu", False, "GPT-2's tanh-approximated GeLU (transformers' gelu_new)",
                             action="store_true")
    # Llama 3.1's RoPE scaling (Megatron's --use-rope-scaling): inv_freq divided by `factor` for
    # wavelengths above original_max / low_freq_factor, kept below original_max / high_freq_factor,
    # interpolated between (Meta's reference apply_scaling; transformers' rope_type "llama3")
    use_rope_scaling: bool = flag("--use-rope-scaling", False, "Llama 3.1 RoPE scaling of the rotary frequencies",
                                  action="store_true")
    rope_scaling_factor: float = flag("--rope-scaling-factor", 8.0, "--use-rope-scaling: context stretch factor")
    rope_scaling_low_freq_factor: float = flag("--rope-scaling-low-freq-factor", 1.0,
                                               "--use-rope-scaling: low_freq_factor")
    rope_scaling_high_freq_factor: float = flag("--rope-scaling-high-freq-factor", 4.0,
                                                "--use-rope-scaling: high_freq_factor")
    rope_scaling_original_max_position_embeddings: int = flag(
        "--rope-scaling-original-max-position-embeddings", 8192,
        "--use-rope-scaling: the context length the model was pretrained at")
    # position interpolation (Chen et al. 2023): positions divided by this (transformers' "linear")
    rotary_seq_len_interpolation_factor: float | None = flag(
        "--rotary-seq-len-interpolation-factor", None, "RoPE position interpolation: positions are divided by this",
        type=float)

    # YaRN (Peng et al. 2023; Megatron-LM's YarnRotaryEmbedding, transformers' rope_type "yarn"),
    # with --position-embedding-type yarn: frequencies whose wavelength exceeds the pretraining
    # context (fewer than beta_slow turns in it) divided by the scaling factor, those with more than
    # beta_fast turns kept, a linear ramp between; cos and sin multiplied by the concentration
    # factor (0.1·mscale·ln s + 1) / (0.1·mscale_all_dim·ln s + 1)
    rotary_scaling_factor: float = flag("--rotary-scaling-factor", 1.0, "YaRN's context extension factor s (>= 1)",
                                        check=(lambda v: v >= 1, ">= 1"))
    yarn_original_max_position_embeddings: int | None = flag(
        "--yarn-original-max-position-embeddings", None, "YaRN: the context length the model was pretrained at "
        "(>= 1; required with --position-embedding-type yarn)", type=int, check=AT_LEAST_1)
    yarn_beta_fast: float = flag("--yarn-beta-fast", 32.0, "YaRN: frequencies with more turns than this in the "
                                 "original context are kept (> 0)", check=POSITIVE)
    yarn_beta_slow: float = flag("--yarn-beta-slow", 1.0, "YaRN: frequencies with fewer turns than this are "
                                 "divided by --rotary-scaling-factor (> 0)", check=POSITIVE)
    mscale: float = flag("--mscale", 1.0, "YaRN: the concentration factor's numerator coefficient (>= 0)",
                         check=NON_NEGATIVE)
    mscale_all_dim: float = flag("--mscale-all-dim", 0.0, "YaRN: the concentration factor's denominator "
                                 "coefficient (>= 0)", check=NON_NEGATIVE)
    yarn_correction_range_round_to_int: bool = flag(
        "--yarn-correction-range-round-to-int", True, "YaRN: round the ramp's ends out to whole channel pairs "
        "(DeepSeek's; gpt-oss does not: --no-yarn-correction-range-round-to-int)", action="boolean_optional")
    # Megatron-LM's --enable-gpt-oss (its ModelOpt arguments): gpt-oss's YaRN, set by validation
    enable_gpt_oss: bool = flag("--enable-gpt-oss", False, "gpt-oss's YaRN, as Megatron-LM's preset: "
                                "--position-embedding-type yarn --rotary-scaling-factor 32 "
                                "--yarn-original-max-position-embeddings 131072 --yarn-beta-fast 32 --yarn-beta-slow 1 "
                                "--mscale 1 --mscale-all-dim 0 --no-yarn-correction-range-round-to-int",
                                action="store_true")

    # Qwen3's / OLMo 2's QK-norm (Megatron-LM's --qk-layernorm): a --normalization norm over each
    # head's query and key (kv_channels wide, weights shared by the heads), before RoPE
    qk_layernorm: bool = flag("--qk-layernorm", False, "normalise each attention head's query and key (a "
                              "--normalization norm over kv_channels, shared by the heads) before RoPE",
                              action="store_true")
    # sliding-window attention (Mistral, Gemma, gpt-oss; Megatron-LM's --window-size, whose
    # (left, right) is flash-attn's / Transformer Engine's: query i sees keys i - left .. i + right)
    window_size: str | None = flag(
        "--window-size", None, "sliding-window attention: LEFT,RIGHT (e.g. 128,0): query i attends to keys "
        "i - LEFT .. i (LEFT + 1 keys; RIGHT must be 0, attention is causal; LEFT -1: no limit); none: full "
        "causal attention", type=str)
    window_attn_skip_freq: str | None = flag(
        "--window-attn-skip-freq", None, "with --window-size, which layers attend fully: N (every N-th layer, "
        "from the N-th: N-1 windowed layers, then one full) or a Python list per layer, 1 windowed and 0 full, "
        "e.g. '[1,1,1,0]*3'", type=str)
    # attention sinks (gpt-oss; Megatron-LM's --softmax-type): one more logit per head in the softmax's
    # denominator, fixed at 0 (off-by-one, Miller 2023) or learned per head (learnable)
    softmax_type: str = flag("--softmax-type", "vanilla", "the attention softmax: vanilla; off-by-one (a logit 0 "
                             "beside the keys' in each denominator); learnable (a learned logit per head there: "
                             "gpt-oss's attention sinks)", choices=["vanilla", "off-by-one", "learnable"])

    # -- multi-latent attention (DeepSeek-V2 Sec. 2.1, V3 Sec. 2.1.1; Megatron-LM's MLASelfAttention,
    # model/mla.py): keys and values up-projected from a kv_lora_rank-wide latent per token, and a
    # decoupled RoPE key of qk_pos_emb_head_dim shared by the heads; queries optionally compressed too
    multi_latent_attention: bool = flag("--multi-latent-attention", False, "multi-latent attention (DeepSeek-V2/V3) "
                                        "instead of the fused-QKV attention", action="store_true")
    q_lora_rank: int | None = flag("--q-lora-rank", None, "MLA: rank of the query's low-rank compression (>= 1); "
                                   "none: no query compression", type=int, check=AT_LEAST_1)
    kv_lora_rank: int = flag("--kv-lora-rank", 32, "MLA: rank of the key/value latent (>= 1)", check=AT_LEAST_1)
    qk_head_dim: int = flag("--qk-head-dim", 128, "MLA: per-head query/key channels without RoPE (>= 1)",
                            check=AT_LEAST_1)
    qk_pos_emb_head_dim: int = flag("--qk-pos-emb-head-dim", 64, "MLA: per-head query/key channels with RoPE "
                                    "(the decoupled key; even, >= 2)", check=AT_LEAST_1)
    v_head_dim: int = flag("--v-head-dim", 128, "MLA: per-head value channels (>= 1)", check=AT_LEAST_1)
    # -- attention variants (config/attention_variant.py; Megatron-LM's experimental_attention_variant)
    # Qwen3-Next's gated attention: a sigmoid gate per query channel on the attention's output,
    # its rows beside each group's queries in linear_qkv (Megatron-LM's attention_output_gate)
    attention_output_gate: bool = flag(
        "--attention-output-gate", False, "gate the softmax attention's output: o · sigmoid(x W_gate) per head "
        "channel before the output projection (Qwen3-Next's gated attention)", action="store_true")
    experimental_attention_variant: str | None = flag(
        "--experimental-attention-variant", None, "gated_delta_net (or gdn): gated DeltaNet layers interleaved with "
        "softmax attention by --linear-attention-freq (Qwen3-Next, Qwen3.5); dsa: DeepSeek Sparse Attention on "
        "multi-latent attention (DeepSeek-V3.2)", choices=list(VARIANTS))
    linear_attention_freq: str | None = flag(
        "--linear-attention-freq", None, "gated_delta_net: N (N-1 DeltaNet layers, then one softmax layer, "
        "repeated) or a Python list per layer, 1 DeltaNet and 0 softmax, e.g. '([1]*3+[0])*2'", type=str)
    linear_conv_kernel_dim: int = flag("--linear-conv-kernel-dim", 4, "gated_delta_net: the causal short "
                                       "convolution's width over q, k, v (>= 1)", check=AT_LEAST_1)
    linear_key_head_dim: int = flag("--linear-key-head-dim", 128, "gated_delta_net: query/key head size (>= 1)",
                                    check=AT_LEAST_1)
    linear_value_head_dim: int = flag("--linear-value-head-dim", 128, "gated_delta_net: value/gate head size "
                                      "(>= 1)", check=AT_LEAST_1)
    linear_num_key_heads: int = flag("--linear-num-key-heads", 16, "gated_delta_net: query/key heads (>= 1)",
                                     check=AT_LEAST_1)
    linear_num_value_heads: int = flag("--linear-num-value-heads", 32, "gated_delta_net: value heads, a multiple "
                                       "of --linear-num-key-heads (>= 1)", check=AT_LEAST_1)
    dsa_indexer_n_heads: int | None = flag("--dsa-indexer-n-heads", None, "dsa: the indexer's heads (>= 1)",
                                           type=int, check=AT_LEAST_1)
    dsa_indexer_head_dim: int | None = flag("--dsa-indexer-head-dim", None, "dsa: the indexer's head size, its "
                                            "first --qk-pos-emb-head-dim channels rotated (>= 1)", type=int,
                                            check=AT_LEAST_1)
    dsa_indexer_topk: int | None = flag("--dsa-indexer-topk", None, "dsa: keys each query attends to (>= 1)",
                                        type=int, check=AT_LEAST_1)
    dsa_indexer_loss_coeff: float | None = flag(
        "--dsa-indexer-loss-coeff", None, "dsa: weight of the indexer's loss, KL(dense attention || indexer), "
        "added to the objective (>= 0; none or 0: the indexer is not trained)", type=float, check=NON_NEGATIVE)
    dsa_indexer_use_sparse_loss: bool = flag(
        "--dsa-indexer-use-sparse-loss", False, "dsa: the indexer's loss over the selected keys only",
        action="store_true")

    # -- multi-token prediction (DeepSeek-V3 Sec. 2.2; Megatron-LM's MultiTokenPredictionBlock) ---
    mtp_num_layers: int | None = flag(
        "--mtp-num-layers", None, "multi-token prediction: this many sequential MTP modules (>= 1) on the last "
        "pipeline stage, module k predicting token i+k+1 from the main model's (or module k-1's) output at i and "
        "the embedding of token i+k; they share the word embedding and the output layer; none: no MTP",
        type=int, check=AT_LEAST_1)
    mtp_loss_scaling_factor: float = flag(
        "--mtp-loss-scaling-factor", 0.1, "weight of the MTP loss: the mean of the MTP modules' losses times this "
        "is added to the LM loss (>= 0)", check=NON_NEGATIVE)

    # -- Mixture of Experts (model/moe/; Megatron-LM's --num-experts and --moe-* flags) ----------
    num_experts: int | None = flag("--num-experts", None, "experts per MoE layer (>= 2); none: a dense model",
                                   type=int, check=AT_LEAST_1)
    moe_ffn_hidden_size: int | None = flag("--moe-ffn-hidden-size", None,
                                           "each expert's hidden size (>= 1; default --ffn-hidden-size)", type=int,
                                           check=AT_LEAST_1)
    moe_router_topk: int = flag("--moe-router-topk", 2, "experts per token k (>= 1, <= --num-experts)",
                                check=AT_LEAST_1)
    # an int k: every k-th layer (layer i is MoE when i % k == 0); or a list of 0/1 per layer
    moe_layer_freq: str = flag("--moe-layer-freq", "1", "which layers are MoE: k (every k-th, from the first) or "
                               "a Python list of 0/1 per layer, e.g. '([0]+[1]*3)*2'", type=str)
    moe_router_load_balancing_type: str = flag(
        "--moe-router-load-balancing-type", "aux_loss", "aux_loss (Switch/GShard, over the micro-batch), "
        "seq_aux_loss (per sequence, DeepSeek-V2), global_aux_loss (the expert loads over the whole stage and the "
        "iteration's micro-batches so far), sinkhorn (S-BASE: the top-k of the Sinkhorn-balanced scores, no loss; "
        "--moe-aux-loss-coeff must be 0) or none",
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    moe_aux_loss_coeff: float = flag("--moe-aux-loss-coeff", 0.0, "weight of the load-balancing loss (>= 0)",
                                     check=NON_NEGATIVE)
    moe_z_loss_coeff: float | None = flag("--moe-z-loss-coeff", None, "weight of the router z-loss (ST-MoE; >= 0)",
                                          type=float, check=NON_NEGATIVE)
    moe_router_score_function: str = flag("--moe-router-score-function", "softmax", "router scores",
                                          choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = flag(
        "--moe-router-pre-softmax", False, "softmax over all experts before top-k (Qwen2-MoE without norm_topk_prob) "
        "instead of over the k selected logits (Mixtral)", action="store_true")
    # group-limited routing (DeepSeek-V2's device-limited, V3's node-limited): experts in groups of
    # E / groups, each group scored by the sum of its top (k / group_topk) scores, top-k within the
    # best group_topk groups (Megatron-LM's group_limited_topk)
    moe_router_num_groups: int | None = flag(
        "--moe-router-num-groups", None, "group-limited routing: the experts in this many equal groups (contiguous "
        "indices; dividing --num-experts), each token's top-k chosen within its --moe-router-group-topk best groups "
        "(DeepSeek-V3's node-limited routing)", type=int, check=AT_LEAST_1)
    moe_router_group_topk: int | None = flag(
        "--moe-router-group-topk", None, "group-limited routing: groups kept per token, each scored by the sum of "
        "its top (--moe-router-topk / this) expert scores (<= --moe-router-num-groups, <= --moe-router-topk)",
        type=int, check=AT_LEAST_1)
    moe_router_topk_scaling_factor: float | None = flag(
        "--moe-router-topk-scaling-factor", None, "multiplies the routing probabilities of the chosen experts "
        "(DeepSeek-V3's routed_scaling_factor; > 0); none: 1", type=float, check=POSITIVE)
    moe_router_dtype: str | None = flag(
        "--moe-router-dtype", None, "the router's logits, probabilities and losses and the weighted sum of the "
        "experts' outputs in this dtype; none: fp32 (megalite routes in fp32 whatever the activations' dtype)",
        type=str, choices=["fp32", "fp64"])
    moe_router_enable_expert_bias: bool = flag(
        "--moe-router-enable-expert-bias", False, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to "
        "the scores for the top-k choice only, moved after each step by --moe-router-bias-update-rate towards "
        "balance (needs --moe-router-score-function sigmoid)", action="store_true")
    moe_router_bias_update_rate: float = flag("--moe-router-bias-update-rate", 1e-3,
                                              "step of the expert-bias update (>= 0)", check=NON_NEGATIVE)
    moe_shared_expert_intermediate_size: int | None = flag(
        "--moe-shared-expert-intermediate-size", None, "hidden size of the shared expert every token goes through "
        "(>= 1); none: no shared expert", type=int, check=AT_LEAST_1)
    moe_shared_expert_gate: bool = flag("--moe-shared-expert-gate", False, "a sigmoid gate on the shared expert's "
                                        "output (Qwen2-MoE)", action="store_true")
    moe_expert_capacity_factor: float | None = flag(
        "--moe-expert-capacity-factor", None, "token dropping: each expert takes at most ceil(tokens x k / experts x "
        "this) of a rank's tokens (> 0); none: dropless", type=float, check=POSITIVE)
    moe_token_drop_policy: str = flag("--moe-token-drop-policy", "probs", "with a capacity: which tokens an "
                                      "over-full expert keeps (the highest probabilities, or the first)",
                                      choices=["probs", "position"])

    def __post_init__(self):
        # defaults for configs built in code; validation sets them from the flags (with the SwiGLU rule)
        if self.hidden_size is None or self.num_attention_heads is None:
            return  # a config being parsed: validation requires them
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether (0-based, global) layer `layer_number` has an MoE MLP."""
        return bool(self.num_experts) and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer_number]

    def is_moe_mtp_layer(self) -> bool:
        """An MTP module's transformer layer is built as the last decoder layer is (Megatron-LM's
        get_gpt_mtp_block_spec takes the decoder's last layer spec): MoE when that layer is."""
        return self.is_moe_layer(self.num_layers - 1)

    @property
    def gated_delta_net(self) -> bool:
        """--experimental-attention-variant gated_delta_net (or gdn)."""
        return self.experimental_attention_variant in LINEAR_VARIANTS

    @property
    def dsa(self) -> bool:
        """--experimental-attention-variant dsa."""
        return self.experimental_attention_variant == "dsa"

    def is_linear_attention_layer(self, layer_number: int) -> bool:
        """Whether (0-based, global) layer `layer_number` is a gated DeltaNet layer. An MTP layer
        (numbered past the decoder's) is softmax attention, as Qwen3-Next's MTP layer."""
        if not self.gated_delta_net or layer_number >= self.num_layers:
            return False
        return linear_attention_pattern(self.linear_attention_freq, self.num_layers)[layer_number]

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def attention_window(self, layer_number: int) -> int | None:
        """LEFT of --window-size for (0-based, global) layer `layer_number`, None where it attends
        fully: Megatron-LM's is_layer_window_attention (whose layer numbers start at 1)."""
        if self.window_size is None:
            return None
        left, _ = parse_window_size(self.window_size)
        if left < 0:
            return None
        # an MTP layer (numbered num_layers + d here) counts from the first layer again, as Megatron-LM's
        # MTP layers number theirs from 1
        layer_number = layer_number % self.num_layers
        return left if window_layer_pattern(self.window_attn_skip_freq, self.num_layers)[layer_number] else None

    def rope_scaling(self) -> dict | None:
        """The llama3 scaling parameters for RotaryEmbedding, None without --use-rope-scaling."""
        if not self.use_rope_scaling:
            return None
        return dict(factor=self.rope_scaling_factor, low_freq_factor=self.rope_scaling_low_freq_factor,
                    high_freq_factor=self.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings)

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 holds [gate; up] (Megatron-LM's gated_linear_unit): --swiglu or --quick-geglu."""
        return self.swiglu or self.quick_geglu

    @property
    def uses_rope(self) -> bool:
        """Rotary position embeddings (plain or YaRN)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def mla_yarn(self) -> bool:
        """MLA with YaRN RoPE: Megatron-LM's --rope-type, whose default for MLA is yarn (its
        MLATransformerConfig); at --rotary-scaling-factor 1 YaRN is plain RoPE."""
        return self.multi_latent_attention and (self.rope_type or "yarn") == "yarn"

    def yarn(self) -> dict | None:
        """YaRN's parameters for RotaryEmbedding, None without --position-embedding-type yarn (or MLA's
        --rope-type yarn)."""
        if self.position_embedding_type != "yarn" and not self.mla_yarn:
            return None
        original = (self.yarn_original_max_position_embeddings or self.max_position_embeddings
                    or self.seq_length)  # unused at factor 1
        return dict(factor=self.rotary_scaling_factor,
                    original_max_position_embeddings=original, beta_fast=self.yarn_beta_fast,
                    beta_slow=self.yarn_beta_slow, mscale=self.mscale,
                    mscale_all_dim=self.mscale_all_dim, round_to_int=self.yarn_correction_range_round_to_int)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """From `to_dict`'s record; keys GPTConfig no longer has are dropped (checkpoints before the
        configs were split recorded the dtype, sequence parallelism, recompute and kernels here)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
