"""The model's shape, activation recompute and sequence/context parallelism, mixed precision and
the data-parallel sharding strategy, and the attention backend (probed on this machine)."""
from __future__ import annotations

import os

from ..config.model import parse_window_size, window_layer_pattern
from ..config.run import RunConfig
from ..config.sharding import get_strategy
from .errors import fail
from .mla import check_mla


def check_model_shape(c: RunConfig) -> None:
    m, k, tp = c.model, c.kernels, c.parallel.tensor_model_parallel_size
    heads = m.num_attention_heads
    if "model.num_query_groups" in c.explicit and not m.group_query_attention:
        fail("--num-query-groups needs --group-query-attention")
    if not m.group_query_attention:
        m.num_query_groups = heads
    elif "model.num_query_groups" not in c.explicit:
        fail("--group-query-attention needs --num-query-groups")
    if heads % m.num_query_groups:
        fail(f"--num-attention-heads ({heads}) is not divisible by --num-query-groups ({m.num_query_groups})")
    if heads % tp:
        fail(f"--num-attention-heads ({heads}) is not divisible by --tensor-model-parallel-size ({tp})")
    if m.num_query_groups % tp:
        fail(f"--num-query-groups ({m.num_query_groups}) is not divisible by --tensor-model-parallel-size ({tp})")
    if "model.kv_channels" not in c.explicit and not m.multi_latent_attention:  # MLA's: arguments/mla.py
        if m.hidden_size % heads:
            fail(f"--hidden-size ({m.hidden_size}) is not divisible by --num-attention-heads ({heads}); "
                 f"set --kv-channels")
        m.kv_channels = m.hidden_size // heads
    if "model.ffn_hidden_size" not in c.explicit:
        # SwiGLU keeps the MLP's parameter count near 8h² with ffn = 8h/3 (Megatron does the same)
        m.ffn_hidden_size = max(1, int(8 * m.hidden_size / 3)) if m.swiglu else 4 * m.hidden_size
    if m.ffn_hidden_size % tp:
        fail(f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by --tensor-model-parallel-size ({tp})")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        fail(f"--seq-length ({m.seq_length}) exceeds --max-position-embeddings ({m.max_position_embeddings})")
    check_mla(c)
    check_rope(c)
    if m.uses_rope and not m.multi_latent_attention:
        # RoPE rotates channel pairs: the rotated part of each head must be a positive even size
        rot = int(m.kv_channels * m.rotary_percent)
        if rot < 2 or rot % 2:
            fail(f"--rotary-percent {m.rotary_percent} x {m.kv_channels} channels per head = {rot} rotated "
                 f"channels; RoPE needs a positive even number")
    if c.data.reset_attention_mask and k.use_flash_attn:
        fail("--reset-attention-mask attends within documents with megalite's tiled kernel "
             "(model/varlen_attention.py); --use-flash-attn's varlen kernel is not wired in: drop --use-flash-attn")
    if c.data.reset_attention_mask and k.attention_backend != "auto":
        c.notices.append(f"--attention-backend {k.attention_backend}: --reset-attention-mask attends within "
                         "documents with megalite's tiled kernel (model/varlen_attention.py) instead")
    if k.use_flash_attn and k.attention_backend not in ("auto", "flash"):
        fail(f"--use-flash-attn selects the flash-attn package, which --attention-backend "
             f"{k.attention_backend} excludes; use --attention-backend flash (or auto)")
    check_attention_variants(c)
    if m.openai_gelu and m.swiglu:
        fail("--openai-gelu selects the GeLU MLP's activation; --swiglu has none (choose one)")
    check_glu(c)
    if (m.use_rope_scaling or m.rotary_seq_len_interpolation_factor) and m.position_embedding_type != "rope":
        fail("--use-rope-scaling / --rotary-seq-len-interpolation-factor need --position-embedding-type rope"
             + (" (YaRN has its own frequencies)" if m.position_embedding_type == "yarn" else ""))
    if m.use_rope_scaling and not m.rope_scaling_low_freq_factor < m.rope_scaling_high_freq_factor:
        fail("--rope-scaling-low-freq-factor must be below --rope-scaling-high-freq-factor")


# Megatron-LM's --enable-gpt-oss (megatron/post_training/model_builder.py): gpt-oss's YaRN, with its
# original context as Megatron-LM sets it (131072; the released gpt-oss config.json says 4096)
GPT_OSS_YARN = {"rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 131072,
                "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                "yarn_correction_range_round_to_int": False}
YARN_FLAGS = {"rotary_scaling_factor": "--rotary-scaling-factor",
              "yarn_original_max_position_embeddings": "--yarn-original-max-position-embeddings",
              "yarn_beta_fast": "--yarn-beta-fast", "yarn_beta_slow": "--yarn-beta-slow", "mscale": "--mscale",
              "mscale_all_dim": "--mscale-all-dim",
              "yarn_correction_range_round_to_int": "--yarn-correction-range-round-to-int"}


def check_glu(c: RunConfig) -> None:
    """--quick-geglu, --glu-linear-offset and --activation-func-clamp-value (Megatron-LM's rules)."""
    m = c.model
    if m.quick_geglu and (m.swiglu or m.openai_gelu):
        fail(f"--quick-geglu is the MLP's activation; {'--swiglu' if m.swiglu else '--openai-gelu'} is another "
             f"(choose one)")
    if m.glu_linear_offset and not m.gated_linear_unit:
        fail(f"--glu-linear-offset {m.glu_linear_offset} applies to a gated MLP (--swiglu or --quick-geglu)")
    if m.activation_func_clamp_value is not None and not m.quick_geglu:
        fail("--activation-func-clamp-value clamps --quick-geglu's inputs; it needs --quick-geglu")
    if m.squared_relu and (m.gated_linear_unit or m.openai_gelu):
        other = "--swiglu" if m.swiglu else "--quick-geglu" if m.quick_geglu else "--openai-gelu"
        fail(f"--squared-relu is the MLP's activation; {other} is another (choose one; Megatron-LM asserts it)")
    if m.rotary_interleaved and m.multi_latent_attention:
        fail("--rotary-interleaved with --multi-latent-attention is not supported (MLA's decoupled RoPE keys are "
             "rotated in halves here)")
    if m.rotary_interleaved and not m.uses_rope:
        c.notices.append(f"--rotary-interleaved has no effect with --position-embedding-type "
                         f"{m.position_embedding_type} (no RoPE; Megatron-LM accepts it there)")
    k = c.kernels
    if k.apply_query_key_layer_scaling:
        k.attention_softmax_in_fp32 = True  # as Megatron-LM's validate_args
        if k.attention_backend != "local":
            c.notices.append(f"--apply-query-key-layer-scaling acts on --attention-backend local (the scores megalite "
                             f"computes); with {k.attention_backend}, SDPA's kernels keep Q·K^T in fp32 and need no "
                             f"guard (the same function)")


def check_rope(c: RunConfig) -> None:
    """--position-embedding-type yarn and its flags, --enable-gpt-oss's preset, --rope-type."""
    m = c.model
    if m.rope_type == "yarn" and not m.multi_latent_attention:  # Megatron-LM asserts it: "Common attention only support rope_type='rope'"
        fail("--rope-type yarn is multi-latent attention's RoPE (as Megatron-LM, ordinary attention takes "
             "--rope-type rope); for YaRN on this model use --position-embedding-type yarn")
    if m.enable_gpt_oss:
        apply_gpt_oss_yarn(c)
    if m.mla_yarn:
        return  # MLA's YaRN (--rope-type yarn, its default): checked in mla.py
    if m.position_embedding_type != "yarn":
        given = [flag for key, flag in YARN_FLAGS.items() if f"model.{key}" in c.explicit]
        if given and m.multi_latent_attention:
            fail(f"{given[0]} sets YaRN, which needs --rope-type yarn with --multi-latent-attention (got "
                 f"--rope-type {m.rope_type})")
        if given:
            fail(f"{given[0]} sets YaRN, which needs --position-embedding-type yarn (got "
                 f"{m.position_embedding_type})")
        return
    if m.yarn_original_max_position_embeddings is None:  # Megatron-LM's _set_yarn_config default
        m.yarn_original_max_position_embeddings = 4096
        c.notices.append("--position-embedding-type yarn without --yarn-original-max-position-embeddings: 4096, "
                         "Megatron-LM's default")
    if m.rotary_percent != 1.0:
        fail(f"--position-embedding-type yarn rotates every head channel (Megatron-LM's YarnRotaryEmbedding); "
             f"--rotary-percent must be 1.0, got {m.rotary_percent}")


def apply_gpt_oss_yarn(c: RunConfig) -> None:
    """--enable-gpt-oss: Megatron-LM's preset sets position_embedding_type yarn over the command
    line's rope (its examples/gptoss/02_train.sh gives both); a YaRN flag given with another value
    than the preset's is refused rather than overridden unseen."""
    m = c.model
    if m.position_embedding_type == "learned_absolute" and "model.position_embedding_type" in c.explicit:
        fail("--enable-gpt-oss sets gpt-oss's YaRN RoPE; it conflicts with --position-embedding-type "
             "learned_absolute")
    if m.position_embedding_type == "rope" and "model.position_embedding_type" in c.explicit:
        c.notices.append("--enable-gpt-oss: --position-embedding-type rope becomes yarn (Megatron-LM's preset)")
    m.position_embedding_type = "yarn"
    for key, value in GPT_OSS_YARN.items():
        if f"model.{key}" in c.explicit and getattr(m, key) != value:
            shown = ("--no-yarn-correction-range-round-to-int" if key == "yarn_correction_range_round_to_int"
                     else f"{YARN_FLAGS[key]} {value:g}")
            fail(f"--enable-gpt-oss sets {shown} (Megatron-LM's gpt-oss preset), but {YARN_FLAGS[key]} gives "
                 f"{getattr(m, key)}; drop one of them")
        setattr(m, key, value)


def check_attention_variants(c: RunConfig) -> None:
    """--window-size / --window-attn-skip-freq (their syntax) and --softmax-type, and the kernels
    that cannot apply them."""
    m, k = c.model, c.kernels
    if m.window_attn_skip_freq is not None and m.window_size is None:
        fail("--window-attn-skip-freq chooses the layers --window-size applies to; it needs --window-size")
    if m.window_size is not None:
        try:
            left, right = parse_window_size(m.window_size)
            window_layer_pattern(m.window_attn_skip_freq, m.num_layers)
        except ValueError as e:
            flag = "--window-size" if "LEFT,RIGHT" in str(e) else "--window-attn-skip-freq"
            fail(f"{flag} must be {e}")
        if left < -1:
            fail(f"--window-size LEFT must be >= 0 (or -1: no limit), got {left}")
        if right != 0:
            fail(f"--window-size RIGHT must be 0: a GPT's attention is causal, no later key is visible "
                 f"(got {m.window_size})")
        if left >= 0 and k.use_flash_attn:
            fail("--window-size needs an explicit mask over the window, which megalite does not pass to "
                 "--use-flash-attn; drop --use-flash-attn (torch SDPA is used)")


    if m.softmax_type != "vanilla":
        if k.use_flash_attn:
            fail(f"--softmax-type {m.softmax_type} adds a logit to the softmax, which flash-attn does not take; "
                 f"drop --use-flash-attn")
        if k.attention_backend in ("flash", "fused"):
            fail(f"--softmax-type {m.softmax_type} runs the explicit softmax (SDPA's kernels take no extra logit); "
                 f"--attention-backend {k.attention_backend} excludes it: use auto, unfused or local")


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def check_recompute_modules(c: RunConfig) -> None:
    """--recompute-modules (Megatron-LM's selective recompute of chosen parts of each layer)."""
    r, m = c.recompute, c.model
    modules = r.recompute_modules
    if "recompute.recompute_modules" not in c.explicit:
        return
    if r.recompute_granularity != "selective":
        c.notices.append("--recompute-modules has no effect without --recompute-granularity selective (Megatron-LM "
                         "accepts and ignores it there)")
        return
    bad = [x for x in modules if x not in RECOMPUTE_MODULES]
    if bad:
        fail(f"--recompute-modules {bad[0]} is not one of {', '.join(RECOMPUTE_MODULES)}")
    if "mla_up_proj" in modules and not m.multi_latent_attention:
        fail("--recompute-modules mla_up_proj needs --multi-latent-attention (as Megatron-LM)")
    if not m.num_experts and any(x in modules for x in ("moe_act", "moe", "shared_experts")):
        c.notices.append("--recompute-modules moe_act / moe / shared_experts have no effect on a dense model")


def check_offloading(c: RunConfig) -> None:
    """--fine-grained-activation-offloading and --offload-modules (model/offload.py)."""
    r = c.recompute
    if r.fine_grained_activation_offloading and not r.offload_modules:
        fail("--fine-grained-activation-offloading needs --offload-modules (the parts whose activations move)")
    if r.offload_modules and not r.fine_grained_activation_offloading:
        c.notices.append("--offload-modules has no effect without --fine-grained-activation-offloading")


def check_recompute(c: RunConfig) -> None:
    """Activation memory: recompute and sequence parallelism (Megatron-LM's rules)."""
    r, p = c.recompute, c.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if r.recompute_activations:
        if r.recompute_granularity == "full":
            fail("--recompute-activations (selective recompute) conflicts with --recompute-granularity full")
        r.recompute_granularity = "selective"
    if r.recompute_granularity == "full":
        per_chunk = c.model.num_layers // (pp * p.virtual_pipeline_model_parallel_size)
        if p.pipeline_model_parallel_layout is not None:  # uneven stages: the largest
            from ..config.pipeline_layout import layout_of
            per_chunk = layout_of(p.pipeline_model_parallel_layout, pp).max_chunk_layers()
        if r.recompute_method is None:
            fail("--recompute-granularity full needs --recompute-method uniform or block")
        if r.recompute_num_layers is None or not 1 <= r.recompute_num_layers <= per_chunk:
            fail(f"--recompute-granularity full needs --recompute-num-layers between 1 and the layers per "
                 f"pipeline stage (model chunk), {per_chunk}; got {r.recompute_num_layers}")
    elif r.recompute_granularity == "selective":
        if r.recompute_method is not None or r.recompute_num_layers is not None:
            fail("--recompute-method / --recompute-num-layers apply to --recompute-granularity full only, "
                 "not selective")
    elif r.recompute_method is not None or r.recompute_num_layers is not None:  # Megatron-LM ignores them then
        c.notices.append("--recompute-method / --recompute-num-layers have no effect without --recompute-granularity "
                         "full (Megatron-LM accepts and ignores them there)")
        r.recompute_method = r.recompute_num_layers = None
    check_recompute_modules(c)
    check_offloading(c)
    if p.sequence_parallel and tp == 1:
        # as Megatron-LM: without TP there is nothing to shard along the sequence
        p.sequence_parallel = False
        c.notices.append("--sequence-parallel switched off: --tensor-model-parallel-size is 1 (as Megatron-LM)")
    if p.sequence_parallel and c.model.seq_length % tp:
        fail(f"--sequence-parallel needs --seq-length ({c.model.seq_length}) divisible by "
             f"--tensor-model-parallel-size ({tp})")


def check_context_parallel(c: RunConfig) -> None:
    """--context-parallel-size: the sequence must cut into 2·CP equal chunks (each split again over
    TP under sequence parallelism), and the features that cannot follow a sequence split are refused."""
    p = c.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return
    sp = p.sequence_parallel and tp > 1
    need = 2 * cp * (tp if sp else 1)
    if c.model.seq_length % need:
        fail(f"--context-parallel-size {cp} needs --seq-length ({c.model.seq_length}) divisible by 2 x CP"
             + (f" x --tensor-model-parallel-size (with --sequence-parallel) = {need}" if sp else f" = {need}"))
    if c.kernels.use_flash_attn:
        fail(f"--context-parallel-size {cp} cannot be combined with --use-flash-attn: context-parallel attention "
             f"needs an explicit mask over the gathered keys, which flash_attn_func does not take; drop "
             f"--use-flash-attn (torch SDPA is used)")


def check_precision(c: RunConfig) -> None:
    """Mixed precision and the distributed optimizer."""
    o, d = c.optimizer, c.ddp
    if o.fp16 and o.bf16:
        fail("--fp16 and --bf16 are mutually exclusive")
    if o.loss_scale is not None and not (o.fp16 or o.bf16):
        fail("--loss-scale needs --fp16 or --bf16 (fp32 training does not scale the loss)")
    dynamic = {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2}
    for name, default in dynamic.items():
        if getattr(o, name) != default and (not o.fp16 or o.loss_scale is not None):
            fail(f"--{name.replace('_', '-')} sets dynamic loss scaling, which only --fp16 without --loss-scale uses")
    if o.fp16 and o.min_loss_scale > o.initial_loss_scale:
        fail(f"need 0 < --min-loss-scale ({o.min_loss_scale}) <= --initial-loss-scale ({o.initial_loss_scale})")
    if o.inject_overflow_at_iteration is not None and not (o.fp16 or o.loss_scale is not None):
        fail("--inject-overflow-at-iteration needs loss scaling (--fp16, or --loss-scale)")
    strategy = d.data_parallel_sharding_strategy
    if "ddp.data_parallel_sharding_strategy" in c.explicit and not get_strategy(strategy).shards_optimizer and \
            "ddp.use_distributed_optimizer" in c.explicit:
        fail("--use-distributed-optimizer shards the optimizer state, which --data-parallel-sharding-strategy "
             "no_shard does not; drop one of them")
    d.use_distributed_optimizer = get_strategy(strategy).shards_optimizer
    if d.overlap_param_gather and not d.use_distributed_optimizer:
        fail("--overlap-param-gather needs --use-distributed-optimizer (or a --data-parallel-sharding-strategy "
             "other than no_shard)")
    if "optimizer.optimizer_offload_fraction" in c.explicit and not o.optimizer_cpu_offload:
        fail("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    if o.optimizer_cpu_offload:
        if not d.use_distributed_optimizer:
            fail("--optimizer-cpu-offload offloads each rank's shard of the optimizer state: it needs "
                 "--use-distributed-optimizer or --data-parallel-sharding-strategy optim, optim_grads or "
                 "optim_grads_params")
        if not 0.0 < o.optimizer_offload_fraction <= 1.0:
            fail(f"--optimizer-offload-fraction must be in (0, 1], got {o.optimizer_offload_fraction} "
                 "(to offload nothing, drop --optimizer-cpu-offload)")
    if c.training.compile and get_strategy(strategy).shards_params:
        fail("--compile with --data-parallel-sharding-strategy optim_grads_params is not supported: ZeRO-3 "
             "gathers and frees each layer's parameters in hooks around the very layers --compile traces; "
             "use optim_grads, or drop --compile")
    if d.grad_reduce_in_bf16 and not o.bf16:
        fail("--grad-reduce-in-bf16 needs --bf16 (with fp16 or fp32 parameters the gradients stay fp32; "
             "Megatron-LM ignores it there)")
    o.params_dtype = "float16" if o.fp16 else "bfloat16" if o.bf16 else "float32"


def check_attention_backend(c: RunConfig) -> None:
    """Run the chosen attention backend once, forward and backward, on this machine's device with
    the run's dtype, head shape, dropout and mask: a backend the device cannot run is refused here,
    naming it, instead of failing inside the first iteration."""
    import warnings

    import torch

    from ..model.attention import probe_attention
    k, m, tp = c.kernels, c.model, c.parallel.tensor_model_parallel_size
    if c.data.reset_attention_mask:  # its own kernel (check_model_shape's notice), not the backend's
        return
    if k.attention_backend == "auto" and not k.use_flash_attn:
        return
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if c.parallel.distributed_backend == "nccl" else torch.device("cpu"))
    dtype = getattr(torch, c.optimizer.params_dtype)
    with warnings.catch_warnings(record=True) as caught:  # SDPA says why a kernel was skipped in warnings
        warnings.simplefilter("always")
        try:
            probe_attention(k.attention_backend, k.use_flash_attn, heads=m.num_attention_heads // tp,
                            groups=m.num_query_groups // tp, head_dim=m.kv_channels, dtype=dtype,
                            dropout=m.attention_dropout,
                            with_mask=m.window_size is not None, device=device)
            return
        except Exception as e:  # the kernel's own reason, shortened
            error = e
    why = [w for w in (str(w.message).split(" (Triggered")[0].strip() for w in caught) if not w.endswith(":")]
    reason = "; ".join(dict.fromkeys(why + [str(error).strip().splitlines()[0] if str(error).strip()
                                            else type(error).__name__]))[:300]
    if device.type == "cpu" and not k.use_flash_attn:  # a GPU kernel choice: the CPU's kernel computes the same
        c.notices.append(f"--attention-backend {k.attention_backend}: a GPU kernel that cannot run on the CPU "
                         f"({reason[:120]}); SDPA's CPU kernel runs instead (--attention-backend auto; the same "
                         f"function)")
        k.attention_backend = "auto"
        return
    fail(f"--attention-backend {k.attention_backend} cannot run here ({device.type}, "
         f"{c.optimizer.params_dtype}, head size {m.kv_channels}"
         f"{', attention dropout ' + str(m.attention_dropout) if m.attention_dropout else ''}"
         f"): {reason}")
