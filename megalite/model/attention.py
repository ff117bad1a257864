"""Self-attention with heads sharded across tensor-parallel ranks, and rotary embeddings.

Each TP rank owns num_query_groups/tp key-value groups and the query heads of those groups
(Megatron-LM paper Sec. 3: attention heads are split across ranks, so the QKV projection is
column-parallel and the output projection row-parallel). The fused QKV weight is laid out by
group, [ng, (np/ng + 2), hn, h] as in Megatron-LM, so a contiguous split of its rows gives each
rank whole groups.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..recompute import recompute
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_init
from ..tensor_parallel.layers import set_tp_attributes
from .config import ExecutionConfig, GPTConfig
from .norm import Norm
from .varlen_attention import document_attention
from ..context_parallel.attention import gather_kv, ring_layer_attention, ulysses_attention, window_mask
from ..context_parallel.documents import Documents
from ..context_parallel.sharding import chunk_positions, gathered_positions

try:  # optional accelerator, used only when asked for with --use-flash-attn
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021, Eq. 34), in the rotate-half form used by Megatron-LM and Llama."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: float = 10000.0,
                 scaling: dict | None = None, seq_len_interpolation_factor: float | None = None, device=None,
                 yarn: dict | None = None):
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        if self.dim % 2:
            raise ValueError(f"rotary dimension {self.dim} (kv channels x --rotary-percent) must be even")
        # on the model's device: a CPU buffer would meet CUDA activations in forward
        inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))
        if scaling is not None:
            inv_freq = llama3_scale_inv_freq(inv_freq, **scaling)
        # YaRN (GPTConfig.yarn()): its frequencies, and cos/sin scaled by the concentration factor,
        # so that every attention logit q·k is scaled by its square (Megatron-LM and transformers alike)
        self.attention_scaling = 1.0
        if yarn is not None:
            inv_freq = yarn_inv_freq(inv_freq, base, self.dim, **{k: v for k, v in yarn.items()
                                                                   if k not in ("mscale", "mscale_all_dim")})
            self.attention_scaling = yarn_concentration(yarn["factor"], yarn["mscale"], yarn["mscale_all_dim"])
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [s, b, 1, dim] in fp32."""
        pos = position_ids.float()
        if self.seq_len_interpolation_factor is not None:
            pos = pos / self.seq_len_interpolation_factor
        freqs = pos.unsqueeze(-1) * self.inv_freq  # [b, s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1).unsqueeze(2)
        if self.attention_scaling != 1.0:
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def yarn_inv_freq(inv_freq: torch.Tensor, base: float, dim: int, factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, Sec. 3.2 "NTK-by-parts"; Megatron-LM's
    YarnRotaryEmbedding): channel pair d turns original_max / (2π·base^(2d/dim)) times over the
    pretraining context. Pairs turning more than beta_fast times keep their frequency
    (extrapolation: local order stays as trained), pairs turning fewer than beta_slow times are
    divided by `factor` (interpolation: long distances land inside the trained range), and a
    linear ramp over the pairs between blends the two."""
    def pair_of(turns: float) -> float:  # the (fractional) channel pair that turns `turns` times
        return dim * math.log(original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp: avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's attention scaling (Peng et al. 2023, Eq. 22: √(1/t) = 0.1·ln s + 1), in DeepSeek's
    form that Megatron-LM takes: (0.1·mscale·ln s + 1) / (0.1·mscale_all_dim·ln s + 1), 1 when s <= 1."""
    def m(coefficient: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0
    return m(mscale) / m(mscale_all_dim)


def llama3_scale_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                          original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (Meta's reference `apply_scaling`, Megatron-LM's --use-rope-scaling):
    wavelengths longer than original_max / low_freq_factor are stretched by `factor`, those shorter
    than original_max / high_freq_factor kept, and the band between interpolated smoothly, so the
    model sees long contexts without disturbing the high frequencies that encode local order."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """--rotary-interleaved: the first `dim` channels of each head reordered even ones first, then
    odd ones, so that `apply_rotary`'s halves are RoFormer's pairs (2i, 2i+1) at frequency i. Done
    to queries and keys alike, it changes no q·k: interleaved RoPE is the rotate-half RoPE of the
    reordered channels (Megatron-LM's _rotate_half with rotary_interleaved)."""
    rot = t[..., :dim]
    out = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
    return torch.cat((out, t[..., dim:]), dim=-1) if t.size(-1) > dim else out


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [s, b, n, hn]: rotate the first `dim` channels of each head."""
    dim = cos.size(-1)
    rot, rest = t[..., :dim].float(), t[..., dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(t.dtype), rest), dim=-1) if rest.numel() else rotated.to(t.dtype)


def sdpa_backends(backend: str):
    """The torch SDPA kernels --attention-backend allows (a context manager): flash ->
    FlashAttention; fused -> cuDNN, then memory-efficient (Transformer Engine's "fused" attention
    is cuDNN's); unfused -> the math path; auto -> SDPA's own choice."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernels = {"flash": [SDPBackend.FLASH_ATTENTION],
               "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
               "unfused": [SDPBackend.MATH]}[backend]
    return sdpa_kernel(kernels, set_priority=True)


def local_attention(q, k, v, attention_mask=None, dropout_p: float = 0.0,
                    softmax_in_fp32: bool = False, sinks: torch.Tensor | None = None,
                    layer_coeff: int | None = None) -> torch.Tensor:
    """--attention-backend local: softmax(Q·Kᵀ/√d + mask)·V written out (Vaswani et al. 2017,
    Eq. 1), as Megatron-LM's local DotProductAttention: the scaling, masking and softmax of the
    scores in the activations' dtype, or in fp32 with `softmax_in_fp32` (--attention-softmax-in-fp32,
    Megatron-LM's FusedScaleMaskSoftmax upcast). q [b, n, s, hn],
    k/v [b, g, s, hn] (g query groups, each serving n/g heads); mask [b, 1, s, s] (True: may
    attend; or additive, 0 / -inf) or None for causal. `sinks` [n] (--softmax-type): one more logit
    per head, a column beside the keys' in the softmax, dropped after it (it has no value).
    `layer_coeff` (--apply-query-key-layer-scaling): the scores are scaled by 1/(√d·coeff) in the
    activations' dtype, then upcast and multiplied by coeff (Megatron-LM's DotProductAttention with
    FusedScaleMaskSoftmax's scale), so 16-bit scores stay small."""
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1))  # [b, n, s, s]
    if layer_coeff:
        scores = (scores * (1.0 / (math.sqrt(q.size(-1)) * layer_coeff))).float() * layer_coeff
    else:
        if softmax_in_fp32:  # Megatron-LM's FusedScaleMaskSoftmax: scale, mask and softmax in fp32
            scores = scores.float()
        scores = scores * (1.0 / math.sqrt(q.size(-1)))
    if attention_mask is None:  # causal, aligned at the top left as SDPA's is_causal
        attention_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:  # additive (0 / -inf), as SDPA takes it
        scores = scores + attention_mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    return torch.matmul(probs, v)


class CoreAttention(nn.Module):
    """softmax(Q·Kᵀ/√d)·V over this rank's heads; [s, b, n, hn] in, [s, b, n·hn] out.

    Kept as its own module so selective recompute can wrap exactly this part (Korthikanti et
    al. 2022, Sec. 5: it holds the s²-sized activations but little compute). The kernel is
    --attention-backend's: torch SDPA (restricted to the chosen kernels), the flash-attn package
    (--use-flash-attn), or megalite's explicit `local_attention`.
    """

    def __init__(self, attention_dropout: float, execution: ExecutionConfig, rng_tracker, num_heads: int = 0,
                 softmax_type: str = "vanilla", init_std: float = 0.0, device=None, layer_number: int = 0):
        super().__init__()
        # --apply-query-key-layer-scaling: Megatron-LM's 1-based global layer number
        self.layer_coeff = layer_number + 1 if execution.apply_query_key_layer_scaling else None
        self.dropout = attention_dropout
        self.use_flash = execution.use_flash_attn
        self.backend = execution.attention_backend
        self.softmax_in_fp32 = execution.attention_softmax_in_fp32
        self.rng_tracker = rng_tracker
        # --softmax-type: SDPA's kernels take no extra logit, so a sink runs `local_attention`'s
        # explicit softmax (the cost of --attention-backend unfused: the [b, n, s, s] scores)
        self.softmax_type = softmax_type
        self.softmax_offset = None
        if softmax_type == "learnable":  # Megatron-LM's name; one logit per head, sharded with the heads
            self.softmax_offset = nn.Parameter(torch.empty(num_heads, dtype=execution.params_dtype, device=device))
            set_tp_attributes(self.softmax_offset, 0)
            set_init(self.softmax_offset, "normal", init_std)

    def forward(self, q, k, v, attention_mask=None):
        p = self.dropout if self.training else 0.0
        # attention probabilities are sharded across TP: their dropout masks must differ per rank
        fork = self.rng_tracker.fork() if (p > 0 and self.rng_tracker is not None) else contextlib.nullcontext()
        s, b, n, hn = q.shape
        with fork:
            if isinstance(attention_mask, Documents):  # packed documents (--reset-attention-mask)
                return self._documents(q, k, v, attention_mask, p)
            if self.use_flash and attention_mask is None:
                out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                      dropout_p=p, causal=True)  # [b, s, n, hn]
                return out.transpose(0, 1).reshape(s, b, -1)
            qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
            if self.backend == "local" or self.softmax_type != "vanilla":
                out = local_attention(qb, kb, vb, attention_mask, p, self.softmax_in_fp32, self._sinks(qb),
                                      self.layer_coeff)
            else:
                with sdpa_backends(self.backend):
                    out = F.scaled_dot_product_attention(
                        qb, kb, vb, attn_mask=attention_mask, dropout_p=p, is_causal=attention_mask is None,
                        enable_gqa=kb.size(1) != qb.size(1))
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # v's head size (MLA's may differ from q's)


    def _documents(self, q, k, v, documents: Documents, p: float):
        """Attention within each document, tile by tile (model/varlen_attention.py): no [s, s] mask.
        A sink logit (--softmax-type) joins the softmax through the log-sum-exp: the keys' share
        of the probability mass is exp(lse - logaddexp(lse, sink))."""
        s, b = q.shape[:2]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
        out, lse = document_attention(qb, kb, vb, documents, p)
        sinks = self._sinks(qb)
        if sinks is not None:
            lse_sink = sinks.float().view(1, -1, 1)
            out = out * torch.exp(lse - torch.logaddexp(lse, lse_sink)).unsqueeze(-1).to(out.dtype)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sinks(self, q):
        if self.softmax_type == "learnable":
            return self.softmax_offset
        return q.new_zeros(q.size(1)) if self.softmax_type == "off-by-one" else None


def probe_attention(backend: str, use_flash_attn: bool, heads: int, groups: int, head_dim: int, dtype,
                    dropout: float, with_mask: bool, device) -> None:
    """Forward and backward once through CoreAttention with these settings on `device`; raises
    what the kernel raises when the device cannot run them (validate_args turns that into a
    refusal naming --attention-backend)."""
    attention = CoreAttention(dropout, ExecutionConfig(use_flash_attn=use_flash_attn, attention_backend=backend),
                              None).train()
    s = 16
    q = torch.randn(s, 1, heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(s, 1, groups, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril() if with_mask else None
    attention(q, k, v, mask).float().sum().backward()


class SelfAttention(nn.Module):
    """Under context parallelism (`cp_group` of size c > 1) the input holds this rank's s/c tokens
    (context_parallel/): keys and values of the whole sequence are all-gathered over the
    CP group after RoPE (each rank rotates its own tokens by their global positions), and the
    attention mask, [b or 1, 1, s/c, s] with columns in gathered order, is always given."""

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, device=None,
                 cp_group=None, layer_number: int = 0):
        super().__init__()
        self.cp_group = cp_group
        tp = comm.group_size(tp_group)
        for what, n in (("--num-attention-heads", config.num_attention_heads), ("--num-query-groups", config.num_query_groups)):
            if n % tp:
                raise ValueError(f"{what} ({n}) is not divisible by --tensor-model-parallel-size ({tp})")
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.hn = config.kv_channels
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.hn
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=execution.sequence_parallel,
                      dtype=execution.params_dtype, device=device)
        # --add-qkv-bias: a bias on Q, K and V whatever --disable-bias-linear says (Megatron-LM's),
        # sharded over TP with the rows of the weight, group by group
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, init_std=std,
                                               **dict(common, bias=config.add_bias_linear or config.add_qkv_bias))
        self.core_attention = CoreAttention(config.attention_dropout, execution, rng_tracker, self.num_heads,
                                            config.softmax_type, std, device, layer_number)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.hn, config.hidden_size,
                                             init_std=out_std, **common)
        # --qk-layernorm: Megatron-LM's q_layernorm / k_layernorm over each head's hn channels;
        # every TP rank holds the whole (shared) weights but sees only its heads' q and k
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = Norm(config, execution, device, size=self.hn, head_sharded=True)
            self.k_layernorm = Norm(config, execution, device, size=self.hn, head_sharded=True)
        # --window-size on this layer (--window-attn-skip-freq): keys at most `window` positions back
        self.window = config.attention_window(layer_number)
        # --cp-comm-type of this layer, and the --hierarchical-context-parallel-sizes groups a2a+p2p
        # exchanges over (context_parallel.attention.set_hierarchy fills them after the build)
        self.cp_comm_type = execution.cp_comm_type_of(layer_number)
        self.cp_levels: list = []
        self.recompute_core_attention = False  # set by activation recompute ("selective")
        # while generating: a cache of this rank's keys and values (megalite.generation.KVCache)
        self.inference_cache = None
        self.max_logits = None  # --qk-clip: a MaxLogitTracker (model/max_logit.py), set by optimizer/qk_clip.py
        self.rotary_interleaved = config.rotary_interleaved

    def forward(self, x, rotary=None, attention_mask=None):
        qkv = self.linear_qkv(x)  # [s, b, ng·(np/ng + 2)·hn] for this rank's groups
        s, b = qkv.shape[:2]
        # one split, not three slices: its backward concatenates the three gradients into one
        # new tensor, where each slice's would zero a qkv-sized tensor and the three be summed
        q, k, v = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.hn).split(
            [self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.num_heads, self.hn)
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, ng, hn]
        if self.q_layernorm is not None:  # before RoPE, as Megatron-LM and Qwen3
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            if self.rotary_interleaved:
                q, k = deinterleave(q, rotary[0].size(-1)), deinterleave(k, rotary[0].size(-1))
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.inference_cache is not None:
            # the new tokens' keys/values join the cached ones; queries see every earlier position
            k, v, attention_mask = self.inference_cache.update(k, v, attention_mask)
        cp = comm.group_size(self.cp_group)
        if cp > 1 and self.cp_comm_type == "a2a":
            return self.linear_proj(ulysses_attention(q, k, v, attention_mask, self.window, self.cp_group,
                                                      self._attend))
        if cp > 1 and self.cp_comm_type in ("p2p", "a2a+p2p"):
            # each block's probabilities are rebuilt in backward already: nothing to recompute
            a2a, ring = (None, self.cp_group) if self.cp_comm_type == "p2p" else self.cp_levels
            return self.linear_proj(ring_layer_attention(q, k, v, attention_mask, self.window, a2a, ring))
        if cp > 1:
            # the kv heads, before GQA expands them: c x less traffic than the expanded ones
            k, v = gather_kv(k, v, self.cp_group)  # [s, b, ng, hn], gathered key order
        if self.window is not None:
            attention_mask = self._windowed(attention_mask, q.size(0), k.size(0), q.device)
        if self.max_logits is not None and self.training:
            self.max_logits.observe(q, k, attention_mask)
        return self.linear_proj(self._attend(q, k, v, attention_mask))

    def _attend(self, q, k, v, attention_mask):
        """Core attention, under selective recompute when asked: keep q, k, v; redo softmax(QKᵀ)·V
        (and its dropout) in backward."""
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            return recompute(self.core_attention, q, k, v, attention_mask, rng_tracker=self.core_attention.rng_tracker)
        return self.core_attention(q, k, v, attention_mask)

    def _windowed(self, attention_mask, sq: int, sk: int, device):
        """`attention_mask` (None: causal) narrowed to the sliding window: query i sees key j when
        0 <= i - j <= window, in global positions: under CP this rank's two chunks against the
        gathered keys (context_parallel/sharding.py), while generating the new queries at the end
        of the cached keys (aligned bottom-right, as the cache's causal mask). Packed documents
        carry the window themselves (no mask is built)."""
        if isinstance(attention_mask, Documents):
            return attention_mask.with_window(self.window)
        cp = comm.group_size(self.cp_group)
        if cp > 1:
            q_pos = chunk_positions(sk, cp, comm.group_rank(self.cp_group), device)
            k_pos = gathered_positions(sk, cp, device)
        else:
            q_pos, k_pos = torch.arange(sk - sq, sk, device=device), torch.arange(sk, device=device)
        return window_mask(q_pos, k_pos, self.window, attention_mask)
