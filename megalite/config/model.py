"""The GPT architecture, by Megatron-LM flag name: what checkpoints record as the model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .fields import AT_LEAST_1, POSITIVE, PROBABILITY, derived, flag


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` x TP so the
    embedding splits evenly and the GEMM shapes stay friendly."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


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
    position_embedding_type: str = flag("--position-embedding-type", "learned_absolute",
                                        choices=["learned_absolute", "rope"])
    rotary_base: float = flag("--rotary-base", 10000.0, "RoPE base (> 0)", check=POSITIVE)
    rotary_percent: float = flag("--rotary-percent", 1.0, "fraction of head channels rotated by RoPE, in (0, 1]",
                                 check=(lambda v: 0 < v <= 1, "in (0, 1]"))
    normalization: str = flag("--normalization", "LayerNorm", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = flag("--norm-epsilon", 1e-5, "epsilon of the norms (> 0)", check=POSITIVE)
    swiglu: bool = flag("--swiglu", False, "SwiGLU MLP instead of GeLU", action="store_true")
    add_bias_linear: bool = flag("--disable-bias-linear", True, "no biases in linear layers", action="store_false")
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

    def rope_scaling(self) -> dict | None:
        """The llama3 scaling parameters for RotaryEmbedding, None without --use-rope-scaling."""
        if not self.use_rope_scaling:
            return None
        return dict(factor=self.rope_scaling_factor, low_freq_factor=self.rope_scaling_low_freq_factor,
                    high_freq_factor=self.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """From `to_dict`'s record; keys GPTConfig no longer has are dropped (checkpoints before the
        configs were split recorded the dtype, sequence parallelism, recompute and kernels here)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
