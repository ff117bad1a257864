"""Activation recompute (--recompute-granularity full|selective) changes memory, never the result.

- dropout > 0: the recomputed forward redraws the same masks, so every parameter gradient is
  bit-identical (torch.equal) to no recompute from the same RNG state; a negative control shows
  the check fails when the tracker's state is not restored;
- saved-tensor accounting: full recompute keeps exactly the chunk inputs, selective drops exactly
  what core attention saves, and a model whose activations dominate holds far less with full;
- in eval mode and under no_grad nothing is recomputed.
That pretrain_gpt.py trains the same model with every mode as without recompute is in
test_layouts.py.
"""
import pytest
import torch

import megalite.model.attention as attention_module
import megalite.model.transformer as transformer_module
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.data.batch import build_batch
from megalite.model import GPTModel, model_configs
from megalite.model.attention import CoreAttention
from megalite.model.transformer import TransformerBlock
from megalite.recompute import SavedActivations, recompute
from megalite.tensor_parallel import seed_everything
from tiny import mock, tiny

MODES = {  # name -> (granularity, method, num_layers), for a 3-layer model
    "none": (None, None, None),
    "full-uniform-1": ("full", "uniform", 1),
    "full-uniform-2": ("full", "uniform", 2),  # chunks of 2 + 1 layers
    "full-block-1": ("full", "block", 1),
    "full-block-3": ("full", "block", 3),
    "selective": ("selective", None, None),
}


def config(mode="none", variant=False, dropout=0.2, **kw):
    g, m, n = MODES[mode]
    extra = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                 add_bias_linear=False, untie_embeddings_and_output_weights=True) if variant else {}
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=90, padded_vocab_size=128,
                seq_length=16, max_position_embeddings=16, hidden_dropout=dropout, attention_dropout=dropout,
                recompute_granularity=g, recompute_method=m, recompute_num_layers=n)
    return model_configs(**{**base, **extra, **kw})  # (GPTConfig, ExecutionConfig)


def batch(variant=False, b=2, s=16, vocab=90, seed=0):
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    tokens[:, 5] = 0  # an end-of-document token: with the variant, a document-wise attention mask
    return build_batch(tokens, eod=0, reset_position_ids=variant, reset_attention_mask=variant)


def grads(cfg, data, rng_seed=11):
    """Loss and every parameter gradient of one forward/backward from a fixed RNG state."""
    model = GPTModel(cfg[0], None, None, execution=cfg[1])
    model.initialize(5)
    model.train()
    # seed after construction (which may draw from the default generator), then hand the tracker
    # to every module that forks it
    tracker = seed_everything(rng_seed, 0, 0, torch.device("cpu"))
    for mod in model.modules():
        if hasattr(mod, "rng_tracker"):
            mod.rng_tracker = tracker
    loss = model(data["input_ids"], data["position_ids"], data["attention_mask"], data["labels"]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# -- flags ------------------------------------------------------------------------------------------
BASE = mock(100) + tiny(num_layers=4, seq_length=16, global_batch_size=None, train_iters=1)


def args_for(extra, world=1):
    return validate_args(parse_args(BASE + extra), world)


def test_flags_fill_config_fields():
    a = args_for(["--recompute-activations"])
    r = a.recompute
    assert (r.recompute_granularity, r.recompute_method, r.recompute_num_layers) == ("selective", None, None)
    a = args_for(["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
                  "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)
    r = a.recompute
    assert (r.recompute_granularity, r.recompute_method, r.recompute_num_layers, a.parallel.sequence_parallel) == \
        ("full", "block", 2, True)
    # uniform chunks need not divide the stage (Megatron-LM: the last chunk is shorter)
    assert args_for(["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "3"]).recompute.recompute_num_layers == 3


@pytest.mark.parametrize("extra,world,pattern", [
    (["--recompute-granularity", "full"], 1, r"--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], 1,
     r"--recompute-num-layers between 1 and .* 4; got None"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], 1,
     r"--recompute-num-layers between 1 and"),
    # per pipeline stage: 4 layers / PP 2 = 2
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3",
      "--pipeline-model-parallel-size", "2"], 2, r"between 1 and the layers per pipeline stage \(model chunk\), 2; got 3"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1, r"full only, not selective"),
    (["--recompute-activations", "--recompute-method", "uniform"], 1, r"full only, not selective"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], 1, r"--recompute-activations .* conflicts with --recompute-granularity full"),
])
def test_bad_recompute_flags(extra, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        args_for(extra, world)


def test_bad_recompute_config():
    with pytest.raises(ValueError, match="recompute_method"):
        config("none", recompute_granularity="full", recompute_method=None, recompute_num_layers=1)
    with pytest.raises(ValueError, match="recompute_granularity"):
        config("none", recompute_granularity="everything")


# -- dropout > 0: bit-identical gradients ------------------------------------------------------------
@pytest.mark.parametrize("variant", [False, True], ids=["base", "rope-rmsnorm-swiglu-gqa-mask"])
def test_recompute_gradients_bit_identical_with_dropout(variant):
    data = batch(variant)
    ref_loss, ref = grads(config("none", variant), data)
    # dropout really acts: another RNG state gives other gradients, so equality below is not vacuous
    other_loss, other = grads(config("none", variant), data, rng_seed=12)
    assert not torch.equal(ref_loss, other_loss)
    for mode in MODES:
        loss, got = grads(config(mode, variant), data)
        assert torch.equal(loss, ref_loss), mode
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), f"{mode}: gradient of {name} differs"


def test_negative_control_without_tracker_restore(monkeypatch):
    """If recompute did not restore the tracker (attention dropout runs in a tracker fork), the
    recomputed masks would differ and the gradients with them: the test above can fail."""
    def recompute_without_tracker(fn, *args, rng_tracker=None):
        return recompute(fn, *args, rng_tracker=None)

    monkeypatch.setattr(attention_module, "recompute", recompute_without_tracker)
    monkeypatch.setattr(transformer_module, "recompute", recompute_without_tracker)
    data = batch()
    _, ref = grads(config("none"), data)
    for mode in ("full-uniform-1", "selective"):
        _, got = grads(config(mode), data)
        assert not all(torch.equal(got[n], ref[n]) for n in ref), mode


@pytest.mark.parametrize("mode", ["full-uniform-1", "selective"])
def test_eval_and_no_grad_skip_recompute(monkeypatch, mode):
    """Recompute only pays off when a backward follows: in eval mode (with autograd on) the model
    keeps its activations like a model without recompute, and under no_grad the checkpoint
    wrapper is not entered at all (its bookkeeping would be pure overhead)."""
    calls = []

    def counting_recompute(fn, *args, rng_tracker=None):
        calls.append(fn)
        return recompute(fn, *args, rng_tracker=rng_tracker)

    monkeypatch.setattr(attention_module, "recompute", counting_recompute)
    monkeypatch.setattr(transformer_module, "recompute", counting_recompute)
    data = batch()

    def forward(cfg, training, grad):
        model = GPTModel(cfg[0], None, None, execution=cfg[1])
        model.initialize(5)
        model.train(training)
        calls.clear()
        with torch.set_grad_enabled(grad), SavedActivations(model.parameters()) as saved:
            model(data["input_ids"], data["position_ids"])
        return saved.nbytes(), len(calls)

    train_bytes, train_calls = forward(config(mode, dropout=0.0), True, True)
    assert train_calls > 0  # the counter sees recompute where it runs ...
    eval_bytes, eval_calls = forward(config(mode, dropout=0.0), False, True)
    plain_eval_bytes, _ = forward(config("none", dropout=0.0), False, True)
    assert eval_calls == 0  # ... and none in eval mode,
    assert eval_bytes == plain_eval_bytes > train_bytes  # which keeps what no recompute keeps
    _, no_grad_calls = forward(config(mode, dropout=0.0), True, False)
    assert no_grad_calls == 0  # nor under no_grad


# -- saved-activation bytes --------------------------------------------------------------------------
S, B, H, L = 64, 2, 32, 4  # sequence, micro-batch, hidden, layers
SBH_BYTES = S * B * H * 4  # one fp32 [s, b, h] activation


def decoder_saved(mode_or_cfg, dropout=0.1, regions=False):
    """Saved bytes of L transformer layers (no final norm) on an [s, b, h] input."""
    if isinstance(mode_or_cfg, str):
        g, m, n = {"uniform-1": ("full", "uniform", 1), "uniform-2": ("full", "uniform", 2),
                   "block-2": ("full", "block", 2)}.get(mode_or_cfg, MODES.get(mode_or_cfg, (None,) * 3))
        cfg = model_configs(num_layers=L, hidden_size=H, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                        seq_length=S, max_position_embeddings=S, hidden_dropout=dropout, attention_dropout=dropout,
                        recompute_granularity=g, recompute_method=m, recompute_num_layers=n)
    tracker = seed_everything(3, 0, 0, torch.device("cpu"))
    block = TransformerBlock(*cfg, None, tracker, post_process=False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(S, B, H, requires_grad=True)
    counter, handles = SavedActivations(block.parameters()), []
    if regions:
        # tag what core attention saves (seen only outside a recompute region); its inputs q, k, v
        # are kept either way (by the kernel, or by selective recompute), so they get their own tag
        def enter(mod, args):
            counter.region = "core_attention_input"
            for t in args:
                if isinstance(t, torch.Tensor):
                    counter._pack(t)
            counter.region = "core_attention"

        for mod in block.modules():
            if isinstance(mod, CoreAttention):
                handles += [mod.register_forward_pre_hook(enter),
                            mod.register_forward_hook(lambda *_: setattr(counter, "region", None))]
    with counter:
        out = block(x)
    for h in handles:  # not during the recomputation in backward
        h.remove()
    out.sum().backward()  # the graph is sound
    return counter


def test_full_recompute_keeps_only_chunk_inputs():
    none = decoder_saved("none").nbytes()
    per_layer = none // L
    assert none == L * per_layer and per_layer > 10 * SBH_BYTES  # a layer saves much more than its input
    # uniform: the input of every chunk of k layers, nothing else
    assert decoder_saved("uniform-1").nbytes() == L * SBH_BYTES
    assert decoder_saved("uniform-2").nbytes() == (L // 2) * SBH_BYTES
    # block: the first 2 layers keep their inputs, the other 2 everything (their inputs included)
    assert decoder_saved("block-2").nbytes() == 2 * SBH_BYTES + 2 * per_layer
    saved = decoder_saved("uniform-1")
    assert {(shape, dtype) for shape, dtype, nbytes, _ in saved.records if nbytes} == {((S, B, H), torch.float32)}


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_selective_drops_exactly_core_attention(dropout):
    none = decoder_saved("none", dropout, regions=True)
    selective = decoder_saved("selective", dropout, regions=True)
    inside = none.nbytes("core_attention")  # what core attention saves beyond its inputs q, k, v
    assert inside > 0 and selective.nbytes("core_attention") == 0
    probs = [r for r in none.records if r[0][-2:] == (S, S)]  # [b, a, s, s]-shaped
    if dropout > 0:
        # SDPA's math path (CPU, with dropout) materialises the attention probabilities and the
        # dropout's output: Megatron's 5·a·s/h term. Selective recompute keeps none of them.
        assert sum(r[2] for r in probs) >= 2 * L * B * 4 * S * S * 4
        assert all(r[3] == "core_attention" for r in probs)
        assert selective.nbytes() == none.nbytes() - inside
    else:
        # The fused (flash) CPU kernel keeps no s x s tensor, only its output and logsumexp
        # [b, a, s]; the output projection keeps the output anyway (a view of the kernel's output
        # without recompute, its own [s, b, h] storage with it), so selective saves only logsumexp.
        assert probs == []
        assert selective.nbytes() == none.nbytes() - inside + L * SBH_BYTES
        assert none.nbytes() - selective.nbytes() == L * B * 4 * S * 4  # L x logsumexp [b, a, s] fp32
    assert not [r for r in selective.records if r[0][-2:] == (S, S)]


def test_full_recompute_lowers_peak_activation_memory_of_a_whole_model():
    """A model whose activations dominate (smaller than the benchmark's 8 x 256 x 512 x 8, see
    benchmarks/RESULTS_activation_memory.md): saved bytes of the whole GPT forward, loss included."""
    cfg = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, padded_vocab_size=128,
               seq_length=256, max_position_embeddings=256, hidden_dropout=0.1, attention_dropout=0.1)
    data = build_batch(torch.randint(0, 128, (4, 257), generator=torch.Generator().manual_seed(0)))
    result = {}
    for name, rc in (("none", {}), ("selective", dict(recompute_granularity="selective")),
                     ("full", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))):
        arch, execution = model_configs(**cfg, **rc)
        model = GPTModel(arch, None, seed_everything(1, 0, 0, torch.device("cpu")), execution=execution)
        model.initialize(1)
        model.train()
        with SavedActivations(model.parameters()) as saved:
            loss = model(data["input_ids"], data["position_ids"], labels=data["labels"]).sum()
        loss.backward()
        result[name] = saved.nbytes()
    assert result["full"] < 0.15 * result["none"], result
    assert result["full"] < result["selective"] < 0.6 * result["none"], result
