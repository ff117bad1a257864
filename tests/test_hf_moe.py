"""Mixture-of-Experts models to and from Hugging Face: MixtralForCausalLM, Qwen2MoeForCausalLM and
Qwen3MoeForCausalLM.

A random transformers model imports with the same logits (fp32, 1e-5) and exports back to the
same tensors; a random megalite MoE model exports to a model transformers computes the same
with, and imports back to the same tensors; KV-cached greedy decoding of an MoE model is what
recomputation and transformers' generate give; what neither side can express is refused, named.
"""
import importlib.util
import json
import os

import pytest
import torch

from dist_helpers import ROOT
from hf_helpers import convert_tool, export_back, printed_run, run_convert

import transformers
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from megalite.checkpoint.hf.config import ConversionError, hf_architecture
from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict
from megalite.config import RunConfig
from megalite.generation import generate, load_model, next_token_logits
from megalite.model import GPTConfig, GPTModel
from tolerances import logits_atol  # megalite's logits against transformers' for the same weights

convert = convert_tool()
spec = importlib.util.spec_from_file_location("megalite_generate_moe", os.path.join(ROOT, "tools/generate.py"))
generate_cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate_cli)

VOCAB = 96
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
LLAMA_LIKE = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, vocab_size=VOCAB, rms_norm_eps=1e-6)
ROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}) if TRANSFORMERS_5 else dict(rope_theta=5000.0)


def _randomize(model):
    """Weights far from transformers' init (whose routers start at zero): every expert and
    gate matters, and routing differs from token to token."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return model.eval()


def _hf_model(path, arch, **kw):
    if arch == "mixtral":
        config = MixtralConfig(**dict(LLAMA_LIKE, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                                      **ROPE) | kw)
        model = MixtralForCausalLM(config)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**dict(LLAMA_LIKE, intermediate_size=56, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                       **ROPE) | kw)
        model = Qwen2MoeForCausalLM(config)
    else:  # head_dim 16 != hidden / heads (12), as Qwen3-30B-A3B's 128 != 2048 / 32
        config = Qwen3MoeConfig(**dict(LLAMA_LIKE, head_dim=16, intermediate_size=56, moe_intermediate_size=24,
                                       num_experts=4, num_experts_per_tok=2, **ROPE) | kw)
        model = Qwen3MoeForCausalLM(config)
    model = _randomize(model)
    model.save_pretrained(path)
    return model



def _ids(seed=0, seq=40):
    return torch.randint(0, VOCAB, (3, seq), generator=torch.Generator().manual_seed(seed))


def _logit_diff(ck, hf_model, ids):
    with torch.no_grad():
        theirs = hf_model(ids).logits.float()
    ours = next_token_logits(load_model(ck)[0], ids)
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item() / logits_atol(theirs)  # of the rounding bound



HF_CASES = {
    "mixtral": ("mixtral", dict()),
    "mixtral-tied-top1": ("mixtral", dict(tie_word_embeddings=True, num_experts_per_tok=1)),
    # shared expert, pre-softmax routing, a dense middle layer, q/k/v biases, untied
    "qwen2_moe": ("qwen2_moe", dict(mlp_only_layers=[1])),
    # renormalised top-k, decoder_sparse_step 2 (layer 1 alone is MoE), no q/k/v bias, tied
    "qwen2_moe-step2-norm": ("qwen2_moe", dict(decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False,
                                               tie_word_embeddings=True)),
    # QK-norm, no shared expert; top-k of the softmax (norm_topk_prob false), a dense middle layer, untied
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=False)),
    # renormalised top-k, decoder_sparse_step 2 (layer 1 alone is MoE), tied, top-1
    "qwen3_moe-step2-norm-tied": ("qwen3_moe", dict(decoder_sparse_step=2, norm_topk_prob=True,
                                                    tie_word_embeddings=True, num_experts_per_tok=1)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_moe_imports_with_equal_logits_and_exports_back(case, tmp_path, capsys):
    arch, kw = HF_CASES[case]
    reference = _hf_model(tmp_path / "hf", arch, **kw)
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    printed = capsys.readouterr().out
    cfg = load_model(ck)[1]["model_config"]
    diff = _logit_diff(ck, reference, _ids())
    print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff

    # the printed flags build this very model
    run = printed_run(printed)
    for key in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "add_qkv_bias", "ffn_hidden_size",
                "untie_embeddings_and_output_weights", "qk_layernorm", "kv_channels"):
        assert getattr(run.model, key) == cfg[key], key
    assert [run.model.is_moe_layer(i) for i in range(3)] == [GPTConfig.from_dict(cfg).is_moe_layer(i) for i in range(3)]

    # and back: the same tensors under the same names, the same config where it matters
    back, _, raw_back = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    raw = json.load(open(os.path.join(tmp_path / "hf", "config.json")))
    assert raw_back["architectures"] == raw["architectures"]
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "qkv_bias", "tie_word_embeddings", "attention_bias"):
        assert raw_back.get(key) == raw.get(key), key
    # the same sparse layers, though perhaps said another way (decoder_sparse_step 2 -> mlp_only_layers [0, 2])
    sparse = [[i not in (r.get("mlp_only_layers") or []) and (i + 1) % r.get("decoder_sparse_step", 1) == 0
               for i in range(3)] for r in (raw, raw_back)]
    assert sparse[0] == sparse[1]
    if arch == "qwen3_moe":
        assert raw_back["head_dim"] == raw["head_dim"] == 16 and cfg["qk_layernorm"] and cfg["kv_channels"] == 16
    loaded = AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids(1)).logits, reference(_ids(1)).logits)


def _megalite_moe(root, **kw):
    base = dict(num_layers=3, hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                padded_vocab_size=128, seq_length=64, max_position_embeddings=64, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.25, position_embedding_type="rope", normalization="RMSNorm",
                swiglu=True, add_bias_linear=False, ffn_hidden_size=56, num_experts=4, moe_router_topk=2,
                untie_embeddings_and_output_weights=True, rotary_base=5000.0)
    config = GPTConfig(**dict(base, **kw))
    model = GPTModel(config)
    model.initialize(11)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    g = torch.Generator().manual_seed(5)  # norms away from their init of ones: a swapped norm shows
    state = {n: torch.rand(p.shape, generator=g) + 0.5 if n.endswith("layernorm.weight") else p
             for n, p in state.items()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            state[name] = state[name][:VOCAB]
    save_full_state_dict(str(root), state, config.to_dict(), RunConfig().to_dict())
    return str(root)


QWEN_LIKE = dict(moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)
MEGALITE_CASES = {
    "mixtral": ("MixtralForCausalLM", dict(moe_ffn_hidden_size=32)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(QWEN_LIKE, moe_router_pre_softmax=True, moe_layer_freq="[1,0,1]",
                                              add_qkv_bias=True)),
    "qwen2_moe-tied": ("Qwen2MoeForCausalLM", dict(QWEN_LIKE, moe_layer_freq="2", num_query_groups=4,
                                                   untie_embeddings_and_output_weights=False, moe_router_topk=3)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(qk_layernorm=True, moe_ffn_hidden_size=24, kv_channels=16,
                                              moe_router_pre_softmax=True, moe_layer_freq="[1,0,1]")),
    "qwen3_moe-tied": ("Qwen3MoeForCausalLM", dict(qk_layernorm=True, untie_embeddings_and_output_weights=False,
                                                   moe_router_topk=3)),
}


@pytest.mark.parametrize("case", list(MEGALITE_CASES))
def test_megalite_moe_exports_with_equal_logits_and_imports_back(case, tmp_path):
    cls, kw = MEGALITE_CASES[case]
    ck = _megalite_moe(tmp_path / "ck", **kw)
    hf_dir = run_convert(convert, "megalite", "hf", ck, tmp_path / "hf", "--no-tokenizer")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf).__name__ == cls
    diff = _logit_diff(ck, hf, _ids())
    print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff
    # imported back on another layout: the same tensors
    back = run_convert(convert, "hf", "megalite", hf_dir, tmp_path / "back", "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "3")
    (_, a), (_, b) = load_full_state_dict(ck), load_full_state_dict(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_kv_cached_generation_of_an_moe_model(arch, tmp_path, capsys):
    """Greedy decoding of an imported Qwen2-MoE model (MoE and dense layers, shared expert) or
    Qwen3-MoE model (QK-norm): with the key/value cache, recomputing every step, and transformers'
    generate agree token for token."""
    reference = _hf_model(tmp_path / "hf", arch, mlp_only_layers=[1])
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    model, _ = load_model(ck)
    assert not model.training and all(not layer.training for _, layer in model.moe_layers())
    prompt = [5, 17, 3, 88, 41, 9]
    cached = generate(model, prompt, 24, greedy=True)
    assert cached == generate(model, prompt, 24, greedy=True, use_cache=False)
    assert len(set(cached)) > 5, cached  # not one repeated token: the comparison proves something
    theirs = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert cached == theirs
    # sampling follows the same path either way
    assert generate(model, prompt, 16, seed=3) == generate(model, prompt, 16, seed=3, use_cache=False)
    # eval mode computes no router loss
    assert all(layer.router.aux_loss_sum is None and layer.router.z_loss_sum is None for _, layer in model.moe_layers())
    # tools/generate.py prints the same continuation, with the cache and without
    eod = VOCAB - 1  # NullTokenizer's: its ids and its eod fill the vocabulary
    expected = " ".join(str(t) for t in (cached[:cached.index(eod)] if eod in cached else cached)) + "\n"
    for extra in ([], ["--no-kv-cache"]):
        capsys.readouterr()
        assert generate_cli.main(["--load", ck, "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "24",
                                  "--greedy", "--tokenizer-type", "NullTokenizer", *extra]) == 0
        assert capsys.readouterr().out == expected


def _tp_generate(rank, world_size, root):
    import torch.distributed as dist

    model, _ = load_model(root, tp_group=dist.group.WORLD)
    return generate(model, [5, 17, 3, 88], 12, greedy=True), generate(model, [5, 17, 3, 88], 12, greedy=True,
                                                                        use_cache=False)


def test_moe_generation_under_tensor_parallelism(tmp_path):
    """TP 2: q/k/v biases sharded with their heads, each expert's fc1/fc2 split, the same tokens."""
    from dist_helpers import spawn

    _hf_model(tmp_path / "hf", "qwen2_moe", mlp_only_layers=[1])
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck", "--target-tensor-parallel-size", "2")
    expected = generate(load_model(ck)[0], [5, 17, 3, 88], 12, greedy=True, use_cache=False)
    for cached, recomputed in spawn(_tp_generate, 2, ck):
        assert cached == recomputed == expected


@pytest.mark.parametrize("kw, message", [
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor 1.0"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-group-topk 1"),
    (dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor 2.5"),
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax without a shared expert"),
    (dict(moe_layer_freq="2"), "--moe-layer-freq 2 (dense layers) without a shared expert"),
    (dict(add_qkv_bias=True), "--add-qkv-bias without a shared expert"),
    (dict(moe_shared_expert_intermediate_size=40), "--moe-shared-expert-intermediate-size without "
                                                   "--moe-shared-expert-gate"),
    (dict(QWEN_LIKE, kv_channels=16), "--kv-channels 16"),
    (dict(num_experts=None, add_qkv_bias=True), "--add-qkv-bias with --disable-bias-linear"),
    (dict(add_bias_linear=True), "--num-experts without --disable-bias-linear"),
    (dict(QWEN_LIKE, qk_layernorm=True), "--moe-shared-expert-intermediate-size with --qk-layernorm"),
    (dict(qk_layernorm=True, add_qkv_bias=True), "--add-qkv-bias with --qk-layernorm"),
    (dict(qk_layernorm=True, moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
          add_bias_linear=True), "--num-experts 4 with learned absolute positions"),
])
def test_unexpressible_moe_models_are_refused(kw, message, tmp_path):
    base = dict(num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, num_experts=4)
    with pytest.raises(ConversionError, match="cannot export to Hugging Face") as e:
        hf_architecture(GPTConfig(**dict(base, **kw)).to_dict())
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("arch, kw, message", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    ("mixtral", dict(sliding_window=16), "sliding_window 16 < max_position_embeddings 64"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ("qwen2_moe", dict(mlp_only_layers=[0, 1, 2]), "no sparse layer"),
    ("qwen2_moe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias true"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ("qwen3_moe", dict(decoder_sparse_step=4), "no sparse layer"),
])
def test_import_refuses_what_megalite_cannot_compute(arch, kw, message, tmp_path, capsys):
    _hf_model(tmp_path / "hf", arch, **kw)
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{convert.PROG}: error: cannot import {arch} model: ") and message in err, err
    assert "megalite does not implement" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_add_qkv_bias_is_on_qkv_only_and_checked_on_load():
    from megalite.checkpoint.native.state import check_model_config
    from megalite.errors import CheckpointError

    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                       seq_length=8, max_position_embeddings=8, add_bias_linear=False, add_qkv_bias=True)
    names = [n for n, _ in GPTModel(config).named_parameters() if n.endswith("bias")]
    assert [n for n in names if "layernorm" not in n] == ["decoder.layers.0.self_attention.linear_qkv.bias"]
    saved = config.to_dict()
    with pytest.raises(CheckpointError, match="--add-qkv-bias is True in the checkpoint and False in this run"):
        check_model_config(saved, dict(saved, add_qkv_bias=False), "ck")
    old = {k: v for k, v in saved.items() if k != "add_qkv_bias"}  # before the flag: no q/k/v bias
    check_model_config(old, dict(saved, add_qkv_bias=False), "old")
