"""gpt-oss to and from Hugging Face (GptOssForCausalLM, a small random GptOssConfig): sinks,
alternating sliding windows, biased attention, router and experts, the clamped GLU with its
interleaved gate/up columns, YaRN and GQA.

A random transformers model imports with the same logits (fp32, 1e-5) and exports back to the same
tensors; a random megalite gpt-oss model exports to a model transformers computes the same with
and imports back to the same tensors; what GptOssForCausalLM cannot express is refused, named.
"""
import json
import os

import pytest
import torch

from hf_helpers import export_back, printed_run, run_convert
from test_hf_moe import VOCAB, _ids, _logit_diff, _randomize, convert

from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from megalite.checkpoint.hf.config import ConversionError, hf_architecture
from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict
from megalite.config import RunConfig
from megalite.model import GPTConfig, GPTModel

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}


def _hf_gpt_oss(path, **kw):
    config = GptOssConfig(**dict(num_hidden_layers=3, hidden_size=48, intermediate_size=24, head_dim=16,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64,
                                 sliding_window=6, rms_norm_eps=1e-6, rope_parameters=YARN) | kw)
    config._attn_implementation = "eager"  # the sinks: transformers' reference attention
    model = _randomize(GptOssForCausalLM(config))
    with torch.no_grad():  # large enough activations that the clamp at swiglu_limit bites
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(8.0)
    model.save_pretrained(path)
    return model


HF_CASES = {
    # YaRN, every other layer windowed (gpt-oss's layer_types), untied
    "yarn-alternating": dict(),
    # plain RoPE, the windows on layers 1 and 2, tied, top-1, a lower clamp
    "rope-windows-tied": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                              tie_word_embeddings=True, num_experts_per_tok=1, swiglu_limit=3.0),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_gpt_oss_imports_with_equal_logits_and_exports_back(case, tmp_path, capsys):
    reference = _hf_gpt_oss(tmp_path / "hf", **HF_CASES[case])
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    printed = capsys.readouterr().out
    from megalite.generation import load_model
    cfg = load_model(ck)[1]["model_config"]
    assert cfg["softmax_type"] == "learnable" and cfg["quick_geglu"] and cfg["add_bias_linear"]
    diff = _logit_diff(ck, reference, _ids())
    print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff

    # the printed flags build this very model
    run = printed_run(printed)
    for key in ("num_experts", "moe_router_topk", "ffn_hidden_size", "quick_geglu", "glu_linear_offset",
                "activation_func_clamp_value", "softmax_type", "window_size", "add_bias_linear", "kv_channels",
                "position_embedding_type", "untie_embeddings_and_output_weights"):
        assert getattr(run.model, key) == cfg[key], key
    assert [run.model.attention_window(i) for i in range(3)] == \
        [GPTConfig.from_dict(cfg).attention_window(i) for i in range(3)]

    # and back: the same tensors under the same names, the same layer types and window
    back, _, raw_back = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    raw = json.load(open(os.path.join(tmp_path / "hf", "config.json")))
    for key in ("architectures", "layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha", "num_local_experts",
                "num_experts_per_tok", "tie_word_embeddings", "attention_bias", "head_dim"):
        assert raw_back[key] == raw[key], key
    assert raw_back["rope_parameters"]["rope_type"] == raw["rope_parameters"]["rope_type"]
    loaded = AutoModelForCausalLM.from_pretrained(back, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids(1)).logits, reference(_ids(1)).logits)


def _megalite_gpt_oss(root, **kw):
    base = dict(num_layers=3, hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                vocab_size=VOCAB, padded_vocab_size=128, seq_length=64, max_position_embeddings=64, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.25, position_embedding_type="yarn", rotary_base=150000.0,
                rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
                yarn_correction_range_round_to_int=False, normalization="RMSNorm", quick_geglu=True,
                glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable", window_size="5,0",
                window_attn_skip_freq="2", add_bias_linear=True, ffn_hidden_size=24, num_experts=4, moe_router_topk=2,
                untie_embeddings_and_output_weights=True)
    config = GPTConfig(**dict(base, **kw))
    model = GPTModel(config)
    model.initialize(11)
    g = torch.Generator().manual_seed(5)  # biases and norms away from their init (zeros, ones)
    state = {}
    for n, p in model.global_named_parameters():
        p = p.detach().clone()
        if n.endswith("layernorm.weight"):
            p = torch.rand(p.shape, generator=g) + 0.5
        elif n.endswith(".bias") or n.endswith("softmax_offset"):
            p = torch.randn(p.shape, generator=g) * 0.5
        elif "linear_fc1" in n:
            p = p * 4.0
        state[n] = p[:VOCAB] if n in ("embedding.word_embeddings.weight", "output_layer.weight") else p
    save_full_state_dict(str(root), state, config.to_dict(), RunConfig().to_dict())
    return str(root)


def test_megalite_gpt_oss_exports_with_equal_logits_and_imports_back(tmp_path):
    ck = _megalite_gpt_oss(tmp_path / "ck")
    hf_dir = run_convert(convert, "megalite", "hf", ck, tmp_path / "hf", "--no-tokenizer")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.config.sliding_window == 6
    diff = _logit_diff(ck, hf, _ids())
    print(f"gpt-oss: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff
    # imported back on another layout: the same tensors
    back = run_convert(convert, "hf", "megalite", hf_dir, tmp_path / "back", "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "3")
    (_, a), (_, b) = load_full_state_dict(ck), load_full_state_dict(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


GPT_OSS_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                   ffn_hidden_size=16, vocab_size=VOCAB, position_embedding_type="rope", normalization="RMSNorm",
                   quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable",
                   add_bias_linear=True, num_experts=4, moe_router_topk=2, untie_embeddings_and_output_weights=True,
                   rotary_percent=1.0)


@pytest.mark.parametrize("change, message", [
    (dict(add_bias_linear=False), "--disable-bias-linear"),
    (dict(softmax_type="vanilla"), "--softmax-type vanilla"),
    (dict(glu_linear_offset=0.0), "--glu-linear-offset 0.0"),
    (dict(activation_func_clamp_value=None), "no --activation-func-clamp-value"),
    (dict(moe_layer_freq="[1,0]"), r"--moe-layer-freq \[1,0\]"),
    (dict(moe_shared_expert_intermediate_size=8), "--moe-shared-expert-intermediate-size"),
    (dict(window_size="4,2"), "--window-size 4,2"),
    (dict(moe_router_score_function="sigmoid"), "routing other than"),
])
def test_what_gpt_oss_cannot_express_is_refused(change, message):
    with pytest.raises(ConversionError, match=f"cannot export to Hugging Face: {message}.*GptOssForCausalLM"):
        hf_architecture(dict(GPT_OSS_CFG, **change))
    assert hf_architecture(GPT_OSS_CFG) == "gpt_oss"


@pytest.mark.parametrize("kw, message", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha 1.5"),
    (dict(attention_bias=False), "attention_bias false"),
])
def test_gpt_oss_configs_megalite_cannot_compute_are_refused(kw, message, tmp_path, capsys):
    _hf_gpt_oss(tmp_path / "hf", **kw)
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot import gpt_oss model: " in err and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# -- the released checkpoints' MXFP4 experts ---------------------------------------------------------
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _quantize_mxfp4(hf_dir):
    """gpt-oss's released form: the experts' gate_up_proj and down_proj ([E, in, out] in memory) as
    <name>_blocks [E, out, in / 32, 16] (two e2m1 codes a byte, low nibble first) and <name>_scales
    [E, out, in / 32] (e8m0), each group of 32 scaled by the power of two that brings its largest
    value to at most 6 and rounded to the nearest e2m1 value; quantization_config mxfp4. Returns
    the packed tensors by name."""
    import json
    from safetensors.torch import load_file, save_file
    path = os.path.join(hf_dir, "model.safetensors")
    tensors, packed = load_file(path), {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).float().transpose(1, 2)  # [E, out, in]
        groups = w.reshape(*w.shape[:2], -1, 32)
        exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))  # [E, out, in / 32]
        codes = (groups / exp.exp2().unsqueeze(-1)).unsqueeze(-1).sub(_E2M1).abs().argmin(-1).to(torch.uint8)
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, (exp + 127).to(torch.uint8)
        packed[name] = (tensors[name + "_blocks"], tensors[name + "_scales"])
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return packed


def test_released_mxfp4_experts_import_dequantized(tmp_path):
    """An MXFP4 checkpoint imports with the logits of transformers' model holding the experts
    transformers' own MXFP4 dequantization (integrations/mxfp4.py) makes of it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    reference = _hf_gpt_oss(tmp_path / "hf", hidden_size=64, intermediate_size=32)  # in sizes of 32-groups
    packed = _quantize_mxfp4(tmp_path / "hf")
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    state = {name.removeprefix("model."): convert_moe_packed_tensors(*pair, dtype=torch.float32)
             for name, pair in packed.items()}
    moved = max((reference.model.state_dict()[k] - v).abs().max().item() for k, v in state.items())
    assert moved > 1e-2  # FP4 moved the experts: the logits below see the dequantized ones
    reference.model.load_state_dict(state, strict=False)
    assert _logit_diff(ck, reference.eval(), _ids()) < 1
