"""Attention variants (issue 30, item 5): --qk-layernorm, --window-size with
--window-attn-skip-freq, and --softmax-type off-by-one / learnable (attention sinks).

- each against attention written out in plain PyTorch here (`reference_attention`);
- under TP 2 the gradients of the replicated q/k norm weights, after the TP all-reduce, equal one
  process's;
- the flags' refusals, one line each;
- a model with all three trains the same on TP2 with SP, PP2 and CP2 (with selective recompute)
  as on one process: loss, gradient norm and eval loss per iteration within 1e-5, final weights.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import spawn
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.data.batch import build_batch
from megalite.model import GPTModel, model_configs
from megalite.model.attention import RotaryEmbedding, SelfAttention
from megalite.tensor_parallel import seed_everything
from tiny import mock, tiny
from tolerances import assert_close_fp32, fp32_atol


def reference_attention(x, w_qkv, w_proj, heads, groups, hn, *, q_norm=None, k_norm=None, eps=1e-5, rotary=None,
                        window=None, sinks=None):
    """Causal self-attention of x [s, b, h] written out: the fused QKV weight laid out by group
    ([ng, (np/ng + 2), hn, h]), RMSNorm over each head's q and k (`q_norm`, `k_norm`: weights
    [hn]), RoPE ((cos, sin) [s, 1, 1, hn]), a sliding window (key j visible from query i when
    0 <= i - j <= window) and sinks (per-head logits [np] in the softmax's denominator)."""
    s, b, _ = x.shape
    qkv = (x @ w_qkv.t()).view(s, b, groups, heads // groups + 2, hn)
    q = qkv[:, :, :, :-2].reshape(s, b, heads, hn)
    k = qkv[:, :, :, -2].repeat_interleave(heads // groups, dim=2)
    v = qkv[:, :, :, -1].repeat_interleave(heads // groups, dim=2)
    if q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm
    if rotary is not None:
        cos, sin = rotary

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin
        q, k = rope(q), rope(k)
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(hn)  # [b, np, s, s]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    visible = (i >= j) & ((i - j <= window) if window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # exp(score) / (sum of exp(scores) + exp(sink))
        top = torch.maximum(scores.amax(-1, keepdim=True), sinks.view(1, -1, 1, 1))
        e = (scores - top).exp()
        probs = e / (e.sum(-1, keepdim=True) + (sinks.view(1, -1, 1, 1) - top).exp())
    ctx = torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, heads * hn)
    return ctx @ w_proj.t()


def attention_layer(**settings):
    """A single-process SelfAttention (RoPE, RMSNorm, GQA 4/2, no biases) with random weights,
    its norm weights and sinks random too (so that a missing one shows)."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                vocab_size=64, padded_vocab_size=64, normalization="RMSNorm", add_bias_linear=False,
                attention_dropout=0.0, hidden_dropout=0.0, position_embedding_type="rope")
    layer_number = settings.pop("layer_number", 0)
    arch, execution = model_configs(**{**base, **settings})
    torch.manual_seed(0)
    layer = SelfAttention(arch, execution, None, layer_number=layer_number)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0))
    return arch, layer


def layer_and_reference(x, arch, layer, **extra):
    rotary = RotaryEmbedding(arch.kv_channels)(torch.arange(x.size(0)).unsqueeze(0))
    out = layer(x, rotary)
    q_norm = layer.q_layernorm.weight if layer.q_layernorm is not None else None
    k_norm = layer.k_layernorm.weight if layer.k_layernorm is not None else None
    ref = reference_attention(x, layer.linear_qkv.weight, layer.linear_proj.weight, arch.num_attention_heads,
                              arch.num_query_groups, arch.kv_channels, q_norm=q_norm, k_norm=k_norm,
                              eps=arch.norm_epsilon, rotary=rotary, **extra)
    return out, ref


# fp32 rounding (tests/tolerances.py) of the layer against the reference: forward, the QKV
# projection (32 terms), QK^T (8), the softmax's sum and PV (16 positions), the output projection
# (32); backward, a norm weight's gradient sums 16 positions x 2 sequences x 4 heads (128 terms)
FORWARD, BACKWARD = dict(k=32, chain=5), dict(k=128, chain=8)


def test_qk_layernorm_matches_reference():
    arch, layer = attention_layer(qk_layernorm=True)
    assert layer.q_layernorm.weight.shape == layer.k_layernorm.weight.shape == (arch.kv_channels,)
    x = torch.randn(16, 2, 32, requires_grad=True)
    out, ref = layer_and_reference(x, arch, layer)
    assert_close_fp32(out, ref, **FORWARD)
    # gradients reach the norm weights as the reference's do
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, layer.q_layernorm.weight, layer.k_layernorm.weight], g)
    want = torch.autograd.grad(ref, [x, layer.q_layernorm.weight, layer.k_layernorm.weight], g)
    for a, b in zip(got, want):
        assert_close_fp32(a, b, **BACKWARD)
    # without the flag: no norms, and the function differs
    plain = attention_layer()[1]
    assert plain.q_layernorm is None and not any("layernorm" in n for n, _ in plain.named_parameters())


def test_qk_layernorm_layer_norm_kind_and_names():
    arch, layer = attention_layer(qk_layernorm=True, normalization="LayerNorm", apply_layernorm_1p=True)
    names = {n for n, _ in layer.named_parameters()}
    assert {"q_layernorm.weight", "q_layernorm.bias", "k_layernorm.weight", "k_layernorm.bias"} <= names
    q = torch.randn(16, 2, 4, arch.kv_channels)
    w, bias = layer.q_layernorm.weight, layer.q_layernorm.bias
    torch.testing.assert_close(layer.q_layernorm(q), F.layer_norm(q, (arch.kv_channels,), 1 + w, bias))


# -- under TP 2 ---------------------------------------------------------------------------------------
def _tp_grads(cfg, group, rank, data):
    """Loss and gradients (global names) after the TP all-reduce of `sequence_parallel` parameters."""
    from megalite import comm
    from megalite.tensor_parallel.param_info import param_info
    model = GPTModel(cfg[0], group, seed_everything(3, rank, 0, torch.device("cpu")), execution=cfg[1])
    model.initialize(5)
    with torch.no_grad():  # norm weights other than 1, so that their gradient matters downstream
        for name, p in model.global_named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.copy_(torch.linspace(0.5, 1.5, p.numel()))
    model.train()
    loss = model(data["input_ids"], data["position_ids"], data["attention_mask"], data["labels"]).sum()
    loss.backward()
    out = {}
    for name, p in model.global_named_parameters():
        g = p.grad.clone()
        if param_info(p).sequence_parallel:
            comm.all_reduce(g, group)  # what DataParallel.finish_grad_sync does
        out[name] = g
    return float(loss), out


def _tp_worker(rank, world):
    import torch.distributed as dist
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=90,
              padded_vocab_size=128, seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
              attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", qk_layernorm=True)
    data = build_batch(torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(0)))
    one_loss, one = _tp_grads(model_configs(**kw), None, 0, data)
    tp_loss, tp = _tp_grads(model_configs(**kw), dist.group.WORLD, rank, data)
    names = [n for n in one if "q_layernorm" in n or "k_layernorm" in n]
    return {"loss": (one_loss, tp_loss), "norm_grads": {n: (one[n], tp[n]) for n in names}}


def test_qk_layernorm_gradients_under_tp2_match_one_process():
    for r in spawn(_tp_worker, 2):
        one, tp = r["loss"]
        # two layers' forward and backward and the loss over a vocabulary of 128 (tolerances.py)
        assert abs(one - tp) <= fp32_atol(128, abs(one), chain=2 * FORWARD["chain"] + 2)
        assert len(r["norm_grads"]) == 4  # q and k norms of 2 layers
        for name, (g_one, g_tp) in r["norm_grads"].items():
            assert g_one.abs().max() > 0, name
            assert_close_fp32(g_tp, g_one, k=128, chain=2 * BACKWARD["chain"], msg=name)


# -- flags ---------------------------------------------------------------------------------------------
def test_qk_layernorm_flag_reaches_the_model():
    args = validate_args(parse_args(tiny() + mock() + ["--qk-layernorm"]))
    assert args.model.qk_layernorm


# -- --window-size, --window-attn-skip-freq -------------------------------------------------------------
def test_sliding_window_matches_reference():
    x = torch.randn(16, 2, 32, requires_grad=True)
    arch, layer = attention_layer(window_size="3,0", qk_layernorm=True)
    assert layer.window == 3
    out, ref = layer_and_reference(x, arch, layer, window=3)
    assert_close_fp32(out, ref, **FORWARD)
    full = layer_and_reference(x, arch, layer)[1]
    assert (out - full).abs().max() > 1e-2  # the window changes the function
    # the local backend computes the same
    arch, local = attention_layer(window_size="3,0", qk_layernorm=True, attention_backend="local")
    assert_close_fp32(local(x, RotaryEmbedding(arch.kv_channels)(torch.arange(16).unsqueeze(0))), out, **FORWARD)


@pytest.mark.parametrize("window,freq,num_layers,windowed", [
    ("4,0", None, 3, [True, True, True]),
    ("4,0", "2", 4, [True, False, True, False]),  # gpt-oss: sliding, full, sliding, full
    ("4,0", "3", 6, [True, True, False, True, True, False]),
    ("4,0", "[1,0,0,1]", 4, [True, False, False, True]),
    ("4,0", "([1]*2+[0])*2", 6, [True, True, False, True, True, False]),
    ("-1,0", "2", 2, [False, False]),  # -1: no limit
])
def test_window_attn_skip_freq_chooses_layers_as_megatron(window, freq, num_layers, windowed):
    from megalite.config.model import GPTConfig
    cfg = GPTConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, seq_length=16,
                    window_size=window, window_attn_skip_freq=freq)
    assert [cfg.attention_window(i) is not None for i in range(num_layers)] == windowed
    # and each layer of a model gets its own
    arch, execution = model_configs(num_layers=num_layers, hidden_size=32, num_attention_heads=4, seq_length=16,
                                    vocab_size=64, padded_vocab_size=64, max_position_embeddings=16, window_size=window,
                                    window_attn_skip_freq=freq)
    model = GPTModel(arch, execution=execution)
    assert [layer.self_attention.window is not None for layer in model.decoder.layers] == windowed


def test_sliding_window_generation_equals_uncached():
    from megalite.generation import KVCache
    arch, layer = attention_layer(window_size="3,0")
    x = torch.randn(12, 1, 32)
    rope = RotaryEmbedding(arch.kv_channels)
    full = layer(x, rope(torch.arange(12).unsqueeze(0)))
    layer.inference_cache = KVCache(12)
    steps = [layer(x[:8], rope(torch.arange(8).unsqueeze(0)))]  # prefill, then one token at a time
    steps += [layer(x[i:i + 1], rope(torch.tensor([[i]]))) for i in range(8, 12)]
    layer.inference_cache = None
    assert_close_fp32(torch.cat(steps), full, **FORWARD)


@pytest.mark.parametrize("extra,message", [
    (["--window-size", "128"], "--window-size must be two integers LEFT,RIGHT, got '128'"),
    (["--window-size", "128,4"], "--window-size RIGHT must be 0"),
    (["--window-size=-2,0"], "--window-size LEFT must be >= 0 (or -1: no limit), got -2"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq chooses the layers --window-size applies to"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "[1,0,1]"],
     "--window-attn-skip-freq must be 3 entries for 2 layers"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "0"], "--window-attn-skip-freq must be an integer >= 1"),
])
def test_window_flags_refused_with_one_line(extra, message):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(tiny() + mock() + extra))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_window_flags_reach_the_model():
    c = validate_args(parse_args(tiny(num_layers=4) + mock() + ["--window-size", "(128,0)",
                                                              "--window-attn-skip-freq", "2"]))
    assert [c.model.attention_window(i) for i in range(4)] == [128, None, 128, None]


# -- --softmax-type --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "local"])
def test_learnable_sinks_match_reference(backend):
    x = torch.randn(16, 2, 32, requires_grad=True)
    arch, layer = attention_layer(softmax_type="learnable", window_size="5,0", qk_layernorm=True,
                                  attention_backend=backend)
    sinks = layer.core_attention.softmax_offset
    assert sinks.shape == (4,) and "core_attention.softmax_offset" in dict(layer.named_parameters())
    with torch.no_grad():
        sinks.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))  # large enough to take much of the weight
    out, ref = layer_and_reference(x, arch, layer, window=5, sinks=sinks)
    assert_close_fp32(out, ref, **FORWARD)
    assert (out - layer_and_reference(x, arch, layer, window=5)[1]).abs().max() > 1e-2
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [x, sinks], g), torch.autograd.grad(ref, [x, sinks], g)):
        assert_close_fp32(a, b, **BACKWARD)


def test_off_by_one_is_a_zero_sink_without_parameters():
    x = torch.randn(16, 2, 32)
    arch, layer = attention_layer(softmax_type="off-by-one")
    assert layer.core_attention.softmax_offset is None
    assert not any("softmax_offset" in n for n, _ in layer.named_parameters())
    out, ref = layer_and_reference(x, arch, layer, sinks=torch.zeros(4))
    assert_close_fp32(out, ref, **FORWARD)


def test_sinks_are_sharded_with_the_heads_and_initialised_by_name():
    from megalite.tensor_parallel.param_info import param_info
    arch, execution = model_configs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                    vocab_size=64, padded_vocab_size=64, max_position_embeddings=16,
                                    softmax_type="learnable")
    model = GPTModel(arch, execution=execution)
    model.initialize(5)
    params = dict(model.global_named_parameters())
    sink = params["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    info = param_info(sink)
    assert info.tensor_parallel and info.partition_dim == 0 and info.init == "normal"
    assert 0 < sink.abs().max() < 0.2  # normal(0, --init-method-std 0.02)


@pytest.mark.parametrize("extra,message", [
    (["--softmax-type", "learnable", "--attention-backend", "flash"],
     "--softmax-type learnable runs the explicit softmax"),
    (["--softmax-type", "off-by-one", "--use-flash-attn"], "--softmax-type off-by-one adds a logit to the softmax"),
    (["--softmax-type", "sink"], "invalid choice"),
])
def test_softmax_type_refusals(extra, message):
    from megalite.errors import UserError
    with pytest.raises(UserError) as e:
        validate_args(parse_args(tiny() + mock() + extra))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- every layout computes the same function -------------------------------------------------------------
# as tests/test_layouts*.py: fp32, dropout 0, clipping active each step; all three variants at once
# (gpt-oss's alternation: layers 0 and 2 windowed, 1 and 3 full), RoPE, RMSNorm and GQA. The window
# (8 keys back) crosses the CP chunks (16 tokens each at CP 2) and PP 2 puts a windowed and a full
# layer on each stage, chosen by global layer number.
VARIANT_MODEL = tiny(num_layers=4, seq_length=64, lr=3e-3, train_iters=6, log_interval=1, eval_interval=3,
                     eval_iters=1) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25", "--adam-eps", "1e-4",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--group-query-attention",
    "--num-query-groups", "2", "--qk-layernorm", "--window-size", "8,0", "--window-attn-skip-freq", "2",
    "--softmax-type", "learnable",
    # gpt-oss's YaRN, its original context (16) a quarter of the sequence: global positions under CP
    "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
    "16", "--no-yarn-correction-range-round-to-int"]
VARIANT_LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2-selective-recompute": (2, ["--context-parallel-size", "2", "--recompute-activations"]),
}


@pytest.fixture(scope="module")
def variant_reference(corpus, tmp_path_factory):
    from dist_helpers import assert_loss_falls, grad_norms, load_params, run_pretrain, train_losses
    tmp = tmp_path_factory.mktemp("variant")
    records, _ = run_pretrain(1, corpus + VARIANT_MODEL + ["--save", str(tmp / "ckpt")], tmp, "reference")
    assert_loss_falls(train_losses(records), 0.3)
    assert min(grad_norms(records)) > 0.25  # clipping acts on every iteration
    params = load_params(str(tmp / "ckpt"))
    assert any("q_layernorm" in n for n in params) and any("softmax_offset" in n for n in params)
    return records, params


@pytest.mark.parametrize("layout", list(VARIANT_LAYOUTS))
def test_attention_variants_layout_matches_single_process(variant_reference, corpus, tmp_path, layout):
    from dist_helpers import (assert_losses_close, assert_params_close, eval_losses, grad_norms, load_params,
                              run_pretrain, train_losses)
    ref_records, ref_params = variant_reference
    nproc, flags = VARIANT_LAYOUTS[layout]
    records, _ = run_pretrain(nproc, corpus + VARIANT_MODEL + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    assert_losses_close(train_losses(ref_records), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-5)
    assert_losses_close(eval_losses(ref_records), eval_losses(records), rtol=1e-5)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)


# -- YaRN (--position-embedding-type yarn) -----------------------------------------------------------------
YARN_CASES = [  # factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim, round to int
    (4.0, 64, 32.0, 1.0, 1.0, 0.0, True),
    (32.0, 4096, 32.0, 1.0, 1.0, 0.0, False),  # gpt-oss's
    (40.0, 4096, 32.0, 1.0, 0.707, 0.707, True),  # DeepSeek-V3's (concentration 1)
    (8.0, 128, 16.0, 2.0, 1.0, 0.5, True),
]


@pytest.mark.parametrize("factor,original,fast,slow,mscale,mscale_all_dim,round_to_int", YARN_CASES)
def test_yarn_cos_sin_equal_transformers(factor, original, fast, slow, mscale, mscale_all_dim, round_to_int):
    """cos and sin, with the concentration factor, as transformers' rope_type "yarn" gives them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(rope_type="yarn", rope_theta=10000.0, factor=factor, original_max_position_embeddings=original,
                  beta_fast=fast, beta_slow=slow, truncate=round_to_int, mscale=mscale, mscale_all_dim=mscale_all_dim)
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params,
                     max_position_embeddings=int(original * factor))
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope = RotaryEmbedding(64, 1.0, 10000.0, yarn=dict(
        factor=factor, original_max_position_embeddings=original, beta_fast=fast, beta_slow=slow, mscale=mscale,
        mscale_all_dim=mscale_all_dim, round_to_int=round_to_int))
    pos = torch.arange(0, 8 * original, 7).unsqueeze(0)
    emb = torch.cat([pos[0].float().unsqueeze(-1) * inv_freq] * 2, dim=-1)
    cos, sin = rope(pos)
    torch.testing.assert_close(cos[:, 0, 0], emb.cos() * scale, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, 0], emb.sin() * scale, rtol=0, atol=1e-6)
    plain = RotaryEmbedding(64, 1.0, 10000.0)
    assert (rope.inv_freq - plain.inv_freq).abs().max() > 1e-3  # YaRN changed the low frequencies
    assert rope.inv_freq[0] == plain.inv_freq[0]  # and kept the fastest one


def test_yarn_flags_reach_the_model_and_gpt_oss_preset():
    from megalite.config.model import GPTConfig
    c = validate_args(parse_args(tiny() + mock() + ["--position-embedding-type", "yarn", "--rotary-scaling-factor",
                                                   "4", "--yarn-original-max-position-embeddings", "16"]))
    assert c.model.yarn() == dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                  mscale=1.0, mscale_all_dim=0.0, round_to_int=True)
    model = GPTModel(GPTConfig(**dict(c.model.to_dict(), vocab_size=64, padded_vocab_size=64)))
    assert model.rotary.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    # Megatron-LM's --enable-gpt-oss over its examples/gptoss/02_train.sh's --position-embedding-type rope
    c = validate_args(parse_args(tiny() + mock() + ["--position-embedding-type", "rope", "--rope-type", "rope",
                                                   "--enable-gpt-oss"]))
    assert c.model.position_embedding_type == "yarn"
    assert c.model.yarn() == dict(factor=32.0, original_max_position_embeddings=131072, beta_fast=32.0,
                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, round_to_int=False)
    assert any("--position-embedding-type rope becomes yarn" in n for n in c.notices)


@pytest.mark.parametrize("extra,message", [
    (["--position-embedding-type", "rope", "--yarn-beta-fast", "16"],
     "--yarn-beta-fast sets YaRN, which needs --position-embedding-type yarn (got rope)"),
    (["--no-yarn-correction-range-round-to-int"], "--yarn-correction-range-round-to-int sets YaRN"),
    (["--rope-type", "yarn"], "--rope-type yarn is multi-latent attention's RoPE"),
    (["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "16", "--rotary-percent", "0.5"],
     "--rotary-percent must be 1.0"),
    (["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "16", "--use-rope-scaling"],
     "--use-rope-scaling / --rotary-seq-len-interpolation-factor need --position-embedding-type rope (YaRN"),
    (["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "16", "--rotary-scaling-factor",
      "0.5"], "--rotary-scaling-factor must be >= 1"),
    (["--enable-gpt-oss", "--yarn-original-max-position-embeddings", "4096"],
     "--enable-gpt-oss sets --yarn-original-max-position-embeddings 131072"),
    (["--enable-gpt-oss", "--position-embedding-type", "learned_absolute"],
     "--enable-gpt-oss sets gpt-oss's YaRN RoPE; it conflicts with --position-embedding-type learned_absolute"),
])
def test_yarn_refusals(extra, message):
    from megalite.errors import UserError
    with pytest.raises(UserError) as e:
        validate_args(parse_args(tiny() + mock() + extra))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
