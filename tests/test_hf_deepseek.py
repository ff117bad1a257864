"""DeepSeek-V3 (multi-latent attention, sigmoid routing with an expert bias in groups, a shared
expert, dense first layers, YaRN) to and from Hugging Face's DeepseekV3ForCausalLM.

A random transformers model imports with the same logits (fp32, 1e-5) and exports back to the
same tensors; a random megalite MLA model exports to a model transformers computes the same with,
and imports back to the same tensors; MLA's cached generation equals recomputation token for
token and caches kv_lora_rank + qk_pos_emb_head_dim values per token and layer.
"""
import os

import pytest
import torch

from hf_helpers import convert_tool, export_back, mtp_loss, printed_run, run_convert, safetensors_of

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("transformers without DeepseekV3ForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from megalite.checkpoint.hf.config import ConversionError, hf_architecture  # noqa: E402
from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.generation import generate, kv_cache, load_model, next_token_logits  # noqa: E402
from megalite.model import GPTConfig, GPTModel  # noqa: E402
from tolerances import logits_atol  # megalite's logits against transformers' for the same weights

convert = convert_tool()

VOCAB = 96
BASE = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, vocab_size=VOCAB,
            intermediate_size=56, moe_intermediate_size=24, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6,
            v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
HF_CASES = {
    # query compression, YaRN, one dense layer, 2 groups with group top-1, scaled routing, untied
    "q-lora-yarn-groups": dict(q_lora_rank=16, rope_parameters=YARN, first_k_dense_replace=1, n_group=2, topk_group=1,
                               routed_scaling_factor=2.5, tie_word_embeddings=False),
    # no query compression, plain RoPE, every layer MoE, no groups, top-1 (not normalised), tied
    "no-q-lora-rope-top1": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                first_k_dense_replace=0, n_group=1, topk_group=1, num_experts_per_tok=1,
                                norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=True),
}


def _hf_model(path, **kw):
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**dict(BASE, **kw)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.25)
        for name, b in model.named_buffers():  # the expert bias moves the choice: make it matter
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    model.eval().save_pretrained(path)
    return model



def _ids(seed=0, seq=40):
    return torch.randint(0, VOCAB, (3, seq), generator=torch.Generator().manual_seed(seed))


def _logit_diff(ck, hf_model, ids):
    with torch.no_grad():
        theirs = hf_model(ids).logits.float()
    ours = next_token_logits(load_model(ck)[0], ids)
    return (ours - theirs).abs().max().item() / logits_atol(theirs)  # of the rounding bound



@pytest.mark.parametrize("case", list(HF_CASES))
def test_deepseek_imports_with_equal_logits_and_exports_back(case, tmp_path, capsys):
    reference = _hf_model(tmp_path / "hf", **HF_CASES[case])
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    printed = capsys.readouterr().out
    diff = _logit_diff(ck, reference, _ids())
    print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff
    cfg = load_model(ck)[1]["model_config"]
    # transformers writes num_nextn_predict_layers 1 (its default) but no MTP weights: none imported
    assert reference.config.num_mtp_layers == 1 and cfg.get("mtp_num_layers") is None
    # the printed flags build this very model
    run = printed_run(printed)
    for key in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim", "rope_type", "mscale", "mscale_all_dim", "rotary_scaling_factor", "num_experts",
                "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias", "qk_layernorm"):
        assert getattr(run.model, key) == cfg[key], key
    assert run.model.yarn() == GPTConfig.from_dict(cfg).yarn()
    # and back: the same tensors under the same names
    back, _, _ = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    loaded = AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    with torch.no_grad():
        assert (loaded(_ids(1)).logits - reference(_ids(1)).logits).abs().max() < 1e-5


def _megalite_mla(root, **kw):
    base = dict(num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                seq_length=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.25, position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6,
                swiglu=True, add_bias_linear=False, ffn_hidden_size=56, rotary_base=5000.0, qk_layernorm=True,
                multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=6, v_head_dim=10,
                untie_embeddings_and_output_weights=True)
    config = GPTConfig(**dict(base, **kw))
    model = GPTModel(config)
    model.initialize(11)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    # norms away from their init of ones: a swapped norm shows. The MTP modules draw from their own
    # generator: the main model is the same with and without them
    main, mtp = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    state = {n: torch.rand(p.shape, generator=mtp if n.startswith("mtp.") else main) + 0.5
             if n.endswith("norm.weight") else p for n, p in state.items()}
    state.update({n: torch.randn(b.shape, generator=mtp if n.startswith("mtp.") else main) * 0.3
                  for n, b in model.global_named_buffers()})
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            state[name] = state[name][:VOCAB]
    save_full_state_dict(str(root), state, config.to_dict(), RunConfig().to_dict())
    return str(root)


DEEPSEEK_MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq="[0,1,1]",
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                    moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
                    moe_shared_expert_intermediate_size=48)
MEGALITE_CASES = {
    "q-lora-yarn-moe": dict(DEEPSEEK_MOE, q_lora_rank=16, rope_type="yarn", rotary_scaling_factor=4.0,
                            yarn_original_max_position_embeddings=16, mscale=0.7, mscale_all_dim=0.9),
    "dense-rope-tied": dict(rope_type="rope", untie_embeddings_and_output_weights=False),
}


# MTP module 0 of a 3-layer model: megalite's names and DeepSeek-V3's (the released checkpoint's
# model.layers.{num_hidden_layers + k}.*; vLLM's deepseek_mtp.py reads the same), for the tensors
# that travel unchanged (the rotary rows of q_b_proj / kv_a_proj_with_mqa are permuted)
MTP_SAME = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
            ("final_layernorm.weight", "shared_head.norm.weight"),
            ("transformer_layer.input_layernorm.weight", "input_layernorm.weight"),
            ("transformer_layer.pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            ("transformer_layer.self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
            ("transformer_layer.self_attention.linear_proj.weight", "self_attn.o_proj.weight")]
MTP_MOE = [("transformer_layer.mlp.router.weight", "mlp.gate.weight"),
           ("transformer_layer.mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
           ("transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight", "mlp.experts.1.down_proj.weight")]


def _transformers_mtp(hf_dir, hf, tokens):
    """The same through transformers' own MTP module (modeling_layers.MtpModel, which speculative
    decoding loads from the checkpoint's layers past the last): loss and hidden states [b, s-1, h]."""
    from transformers.modeling_layers import MtpModel
    # DeepseekV3ForCausalLM ignores (and MtpModel finds) model.layers.61.*: DeepSeek-V3's depth
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    b, s = tokens.size(0), tokens.size(1) - 1
    with torch.no_grad():
        h = hf.model(tokens[:, :-1]).last_hidden_state  # the final-normed h_0
        out = mtp.forward_layer(0, h[:, :-1], torch.arange(1, s).expand(b, s - 1), None, input_ids=tokens[:, 1:-1])
        logits = hf.lm_head(out)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())
    return loss.item(), out


@pytest.mark.parametrize("case", list(MEGALITE_CASES))
def test_megalite_mla_exports_with_equal_logits_and_imports_back(case, tmp_path, capsys):
    """With an MTP module: DeepSeek-V3's layer num_layers (which DeepseekV3ForCausalLM skips), whose
    loss transformers' MtpModel computes the same, and which imports back exactly."""
    ck = _megalite_mla(tmp_path / "ck", mtp_num_layers=1, **MEGALITE_CASES[case])
    hf_dir = run_convert(convert, "megalite", "hf", ck, tmp_path / "hf", "--no-tokenizer")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    diff = _logit_diff(ck, hf, _ids())
    with capsys.disabled():
        print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert diff < 1, diff
    # the MTP module under DeepSeek-V3's names, with copies of the embedding and the output layer
    (meta, a), exported = load_full_state_dict(ck), safetensors_of(hf_dir)
    assert hf.config.num_mtp_layers == 1 and hf.config.to_dict()["num_nextn_predict_layers"] == 1
    moe = bool(meta["model_config"].get("num_experts"))
    for ours, theirs in MTP_SAME + (MTP_MOE if moe else []):
        assert torch.equal(exported["model.layers.3." + theirs], a["mtp.layers.0." + ours]), theirs
    head = a.get("output_layer.weight", a["embedding.word_embeddings.weight"])
    assert torch.equal(exported["model.layers.3.embed_tokens.weight"], a["embedding.word_embeddings.weight"])
    assert torch.equal(exported["model.layers.3.shared_head.head.weight"], head)
    tokens = _ids(2, 41)
    ours, ours_h = mtp_loss(load_model(ck)[0], tokens)
    if moe:  # MtpModel builds an MTP layer as MoE always (DeepSeek-V3's is)
        theirs, theirs_h = _transformers_mtp(hf_dir, hf, tokens)
        h_diff = (ours_h.transpose(0, 1)[:, :-1] - theirs_h).abs().max().item()
        with capsys.disabled():
            print(f"{case}: MTP loss megalite {ours:.7f} transformers {theirs:.7f}; max |h_1 difference| {h_diff:.3e}")
        assert abs(ours - theirs) < logits_atol(torch.tensor(ours)) and h_diff < logits_atol(theirs_h)
    capsys.readouterr()
    back = run_convert(convert, "hf", "megalite", hf_dir, tmp_path / "back", "--target-tensor-parallel-size", "2")
    assert "--mtp-num-layers 1" in capsys.readouterr().out
    meta_b, b = load_full_state_dict(back)
    assert meta_b["model_config"]["mtp_num_layers"] == 1
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert mtp_loss(load_model(back)[0], tokens)[0] == ours
    if moe:  # an MTP module whose copy of the embedding is not the embedding: refused, not dropped
        exported["model.layers.3.embed_tokens.weight"] = exported["model.layers.3.embed_tokens.weight"] + 1
        from safetensors.torch import save_file
        save_file(exported, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
        assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir,
                             "--save-dir", str(tmp_path / "bad")]) == 2
        assert "model.layers.3.embed_tokens.weight differs" in capsys.readouterr().err


def test_mla_generation_caches_the_latent(tmp_path):
    """Greedy decoding with MLA's latent cache equals recomputing every step, token for token; the
    cache holds kv_lora_rank + qk_pos_emb_head_dim values per token and layer."""
    ck = _megalite_mla(tmp_path / "ck", **MEGALITE_CASES["q-lora-yarn-moe"])
    model, meta = load_model(ck)
    cfg = meta["model_config"]
    prompt = [5, 17, 3, 88, 41, 9]
    cached = generate(model, prompt, 20, greedy=True)
    assert cached == generate(model, prompt, 20, greedy=True, use_cache=False)
    assert len(set(cached)) > 4, cached  # not one repeated token: the comparison proves something
    with kv_cache(model, 32) as layers:
        next_token_logits(model, torch.tensor([prompt]))
        per_layer = [sum(t[:c.length].numel() for t in (c.k, c.v)) for c in (a.inference_cache for a in layers)]
    assert len(layers) == cfg["num_layers"]
    assert per_layer == [len(prompt) * (cfg["kv_lora_rank"] + cfg["qk_pos_emb_head_dim"])] * cfg["num_layers"]


@pytest.mark.parametrize("kw, message", [
    (dict(qk_layernorm=False), "--qk-layernorm"),
    (dict(DEEPSEEK_MOE, moe_router_score_function="softmax"), "--moe-router-score-function softmax"),
    (dict(DEEPSEEK_MOE, moe_router_topk=3, num_experts=6), "!= 2"),
    (dict(DEEPSEEK_MOE, moe_layer_freq="[1,0,1]"), "--moe-layer-freq [1,0,1]"),
    (dict(DEEPSEEK_MOE, moe_shared_expert_intermediate_size=None), "--moe-shared-expert-intermediate-size"),
    (dict(norm_epsilon=1e-5), "--norm-epsilon 1e-05"),
    (dict(multi_latent_attention=False, mtp_num_layers=1), "--mtp-num-layers 1 without --multi-latent-attention"),
])
def test_deepseek_export_refuses_what_it_cannot_express(kw, message):
    cfg = GPTConfig(**dict(dict(num_layers=3, hidden_size=48, num_attention_heads=4, seq_length=64,
                                position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6,
                                swiglu=True, add_bias_linear=False, qk_layernorm=True, multi_latent_attention=True),
                           **kw)).to_dict()
    with pytest.raises(ConversionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf_architecture(cfg)



# -- the released checkpoints' FP8 weights ---------------------------------------------------------
def _quantize_fp8(hf_dir, block):
    """DeepSeek-V3's released form: every projection weight in FP8 e4m3 with one fp32 scale per
    [block] tile (partial at the edges: 18 = kv_lora_rank + rope rows in tiles of 8), stored as
    <name>.weight_scale_inv, and config.json's quantization_config. Returns the dequantized weights
    by name, computed tile by tile (the reference). Routed experts stay unquantized: transformers
    holds them fused in memory, under other names."""
    import json
    from safetensors.torch import load_file, save_file
    path = os.path.join(hf_dir, "model.safetensors")
    tensors, reference = load_file(path), {}
    for name in [k for k, t in tensors.items() if k.endswith("proj.weight") and t.dim() == 2 and ".experts." not in k]:
        w = tensors[name].float()
        q, deq = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty_like(w)
        scales = torch.empty(-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
        for i in range(0, w.shape[0], block[0]):
            for j in range(0, w.shape[1], block[1]):
                tile = w[i:i + block[0], j:j + block[1]]
                scale = tile.abs().max() / 448.0  # e4m3's largest value
                q[i:i + block[0], j:j + block[1]] = (tile / scale).to(torch.float8_e4m3fn)
                deq[i:i + block[0], j:j + block[1]] = q[i:i + block[0], j:j + block[1]].float() * scale
                scales[i // block[0], j // block[1]] = scale
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"], reference[name] = q, scales, deq
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference


def test_released_fp8_weights_import_dequantized(tmp_path, capsys):
    """A block-scaled FP8 checkpoint imports with the logits of transformers' model holding the
    dequantized weights (not the unquantized ones it started from: FP8 moved them), and an
    unknown quantization is refused in one line."""
    original = _hf_model(tmp_path / "hf", **HF_CASES["q-lora-yarn-groups"])
    reference = _quantize_fp8(tmp_path / "hf", (8, 16))
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    ids = _ids()
    with torch.no_grad():
        before = original(ids).logits.float()
        original.load_state_dict(reference, strict=False)
    assert _logit_diff(ck, original, ids) < 1
    ours = next_token_logits(load_model(ck)[0], ids)
    assert (ours - before).abs().max() > 100 * logits_atol(before)  # the quantization shows in the logits
    import json
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    cfg["quantization_config"]["quant_method"] = "gptq"
    json.dump(cfg, open(tmp_path / "hf" / "config.json", "w"))
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --load-dir" in err[0] and "quant_method 'gptq'" in err[0], err
    assert not os.path.exists(tmp_path / "ck2")
