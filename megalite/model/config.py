"""The GPT model's shape and options, by Megatron-LM flag name."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` x TP so the
    embedding splits evenly and the GEMM shapes stay friendly."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the tokenizer's, unpadded
    padded_vocab_size: int
    seq_length: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None  # None: multi-head attention (one group per head)
    kv_channels: int | None = None
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    use_flash_attn: bool = False
    # core attention: auto | flash | fused | unfused | local (model/attention.py)
    attention_backend: str = "auto"
    # zero-centred norm weights: stored as w - 1, applied as 1 + w (Megatron-LM's LayerNorm1P)
    apply_layernorm_1p: bool = False
    # the vocabulary-parallel cross entropy with its two sum all-reduces fused (tensor_parallel/cross_entropy.py)
    cross_entropy_loss_fusion: bool = False
    sequence_parallel: bool = False
    # activation recompute: None | "full" | "selective"; method "uniform" | "block"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    params_dtype: torch.dtype = field(default=torch.float32)
    # GPT-2's tanh approximation of GeLU (Hendrycks & Gimpel 2016, Sec. 2), Megatron's --openai-gelu
    openai_gelu: bool = False
    # Llama 3.1's RoPE scaling (Megatron's --use-rope-scaling): inv_freq divided by `factor` for
    # wavelengths above original_max / low_freq_factor, kept below original_max / high_freq_factor,
    # interpolated between (Meta's reference apply_scaling; transformers' rope_type "llama3")
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    # position interpolation (Chen et al. 2023): positions divided by this (transformers' "linear")
    rotary_seq_len_interpolation_factor: float | None = None

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        # activation recompute (the flags are checked with their names in arguments.validate_args)
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', "
                             f"got {self.recompute_granularity!r}")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(f"full recompute needs recompute_method 'uniform' or 'block', "
                                 f"got {self.recompute_method!r}")
            if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
                raise ValueError(f"full recompute needs recompute_num_layers >= 1, got {self.recompute_num_layers!r}")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError("recompute_method and recompute_num_layers apply to recompute_granularity 'full' only")

    def rope_scaling(self) -> dict | None:
        """The llama3 scaling parameters for RotaryEmbedding, None without --use-rope-scaling."""
        if not self.use_rope_scaling:
            return None
        return dict(factor=self.rope_scaling_factor, low_freq_factor=self.rope_scaling_low_freq_factor,
                    high_freq_factor=self.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params_dtype"] = str(self.params_dtype).replace("torch.", "")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        d = dict(d)
        d["params_dtype"] = getattr(torch, d.get("params_dtype", "float32"))
        return cls(**d)
