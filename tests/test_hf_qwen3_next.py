"""Gated DeltaNet hybrids to and from Hugging Face: Qwen3-Next (MoE, dense layers), Qwen3.5 (dense)
and Qwen3.5-MoE (issue 44).

A random transformers model imports with the same logits (fp32, 1e-5) and exports back to the same
tensors; a random megalite model exports to a model transformers computes the same logits with, and
imports back exactly; greedy generation (with the DeltaNet state and convolution cache) equals
transformers' and megalite's uncached decoding token for token. Multi-token prediction: a released
checkpoint's MTP module (mtp.*) imports with the loss computed from transformers' own decoder layer,
norm and plain torch, and exports back exactly (Qwen3-Next); Qwen3.5-MoE's round trips, Qwen3.5's
setting without weights imports none, and megalite models with an MTP module come back exactly.
"""
import json
import os

import pytest
import torch

from hf_helpers import convert_tool, export_back, mtp_loss, printed_run, run_convert, safetensors_of

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, n) for n in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")):
    pytest.skip("transformers without Qwen3-Next / Qwen3.5", allow_module_level=True)
from transformers import AutoModelForCausalLM  # noqa: E402

from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.generation import generate, load_model, next_token_logits  # noqa: E402
from megalite.model import GPTConfig, GPTModel  # noqa: E402

convert = convert_tool()

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=40, max_position_embeddings=64, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=3, linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=16)
HF_CASES = {  # class, config class, settings
    "qwen3_next-moe-dense-layer": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                                   dict(MOE, mlp_only_layers=[2], decoder_sparse_step=1, norm_topk_prob=True,
                                        tie_word_embeddings=False)),
    "qwen3_next-pre-softmax-tied": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                                    dict(MOE, decoder_sparse_step=1, norm_topk_prob=False, tie_word_embeddings=True)),
    # mtp_num_hidden_layers as transformers saves it: the setting, not the weights (none imported)
    "qwen3_5-dense": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(tie_word_embeddings=False,
                                                                       mtp_num_hidden_layers=1)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(MOE, tie_word_embeddings=False)),
}


def _hf_model(path, cls, config_cls, **kw):
    config = getattr(transformers, config_cls)(**dict(BASE, **kw))
    model = getattr(transformers, cls)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred (1 + w) norms and the plain gated one
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + (0.75 if name.endswith("linear_attn.norm.weight")
                                                                  else -0.25))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).mul(3).add(0.5).log())
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    model.eval().save_pretrained(path)
    return model



def _add_mtp(path, reference, seed=7):
    """A released checkpoint's MTP module added to a saved model (vLLM's qwen3_next_mtp.py reads it):
    mtp.fc [h, 2h], the zero-centred mtp.pre_fc_norm_embedding / pre_fc_norm_hidden / norm, and
    mtp.layers.0.*, a full-attention decoder layer of transformers' own class (MoE as the model's
    last layer), its experts one by one as in the files; mtp_num_hidden_layers 1 in config.json.
    Returns (layer, norms, fc) for the reference."""
    from safetensors.torch import save_file
    config = reference.config
    full = config.layer_types.index("full_attention")
    layer = type(reference.model.layers[full])(config, full).eval()
    norms = {n: type(reference.model.norm)(config.hidden_size, eps=config.rms_norm_eps)
             for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    fc = torch.empty(config.hidden_size, 2 * config.hidden_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*layer.parameters(), *(m.weight for m in norms.values()), fc]:
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 - 0.25 if p.dim() == 1 else
                    torch.randn(p.shape, generator=g) * 0.08)
    tensors = safetensors_of(path)
    for name, t in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # transformers 5's fused experts: per expert in the files
            for e in range(t.size(0)):
                for kind, part in zip(("gate_proj", "up_proj"), t[e].chunk(2)):
                    tensors[f"mtp.layers.0.mlp.experts.{e}.{kind}.weight"] = part.contiguous()
        elif name == "mlp.experts.down_proj":
            for e in range(t.size(0)):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors["mtp.layers.0." + name] = t
    tensors.update({f"mtp.{n}.weight": m.weight.detach() for n, m in norms.items()}, **{"mtp.fc.weight": fc})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(raw, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False), f)
    return layer, norms, fc


def _reference_mtp(reference, layer, norms, fc, tokens):
    """MTP module 1 computed as vLLM's Qwen3NextMultiTokenPredictor does, from transformers' modules:
    at position i, fc([norm_e(Emb(token i+1)); norm_h(h_0[i])]) -> the decoder layer -> mtp.norm ->
    lm_head, against token i+2. Returns (mean cross entropy, hidden states [b, s-1, h])."""
    b, s = tokens.size(0), tokens.size(1) - 1
    with torch.no_grad():
        h0 = reference.model(tokens[:, :-1]).last_hidden_state[:, :-1]  # the final-normed h_0
        emb = reference.model.embed_tokens(tokens[:, 1:-1])
        x = torch.cat([norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](h0)], dim=-1) @ fc.t()
        positions = torch.arange(1, s).expand(b, s - 1)
        causal = torch.full((s - 1, s - 1), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=reference.model.rotary_emb(x, positions), attention_mask=causal,
                    position_ids=positions)
        out = norms["norm"](out[0] if isinstance(out, tuple) else out)
        logits = reference.lm_head(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten()).item(), out


def test_released_mtp_module_imports_with_the_reference_loss_and_exports_back(tmp_path, capsys):
    cls, config_cls, kw = HF_CASES["qwen3_next-moe-dense-layer"]
    reference = _hf_model(tmp_path / "hf", cls, config_cls, **kw)
    layer, norms, fc = _add_mtp(tmp_path / "hf", reference)
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    assert "--mtp-num-layers 1" in capsys.readouterr().out
    model, meta = load_model(ck)
    assert meta["model_config"]["mtp_num_layers"] == 1
    tokens = _ids(2, 41)
    theirs, theirs_h = _reference_mtp(reference, layer, norms, fc, tokens)
    ours, ours_h = mtp_loss(model, tokens)
    h_diff = (ours_h.transpose(0, 1)[:, :-1] - theirs_h).abs().max().item()
    with capsys.disabled():
        print(f"MTP loss megalite {ours:.7f} reference {theirs:.7f}; max |h_1 difference| {h_diff:.3e}")
    assert abs(ours - theirs) < 1e-5 and h_diff < 1e-5, (ours, theirs, h_diff)
    back, exported, config = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    assert config["mtp_num_hidden_layers"] == 1
    # an MTP layer without the experts the last decoder layer has: refused, not half imported
    from safetensors.torch import save_file
    save_file({k: v for k, v in exported.items() if not k.startswith("mtp.layers.0.mlp.")},
              os.path.join(back, "model.safetensors"), metadata={"format": "pt"})
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir", back,
                         "--save-dir", str(tmp_path / "bad")]) == 2
    assert "MTP layer 0 without experts, unlike the last decoder layer" in capsys.readouterr().err


def _ids(seed=0, seq=40):
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))



@pytest.mark.parametrize("case", list(HF_CASES))
def test_imports_with_equal_logits_exports_back_and_generates_the_same(case, tmp_path, capsys):
    cls, config_cls, kw = HF_CASES[case]
    reference = _hf_model(tmp_path / "hf", cls, config_cls, **kw)
    if case == "qwen3_5_moe":  # with a released checkpoint's MTP module (mtp.*), exported back below
        _add_mtp(tmp_path / "hf", reference)
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    printed = capsys.readouterr().out
    model, meta = load_model(ck)
    assert meta["model_config"].get("mtp_num_layers") == (1 if case == "qwen3_5_moe" else None)
    ids = _ids()
    with torch.no_grad():
        theirs = reference(ids).logits.float()
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    print(f"{case}: max |logit difference| megalite vs transformers = {diff:.3e}")
    assert diff < 1e-5, diff
    # greedy decoding: cached (DeltaNet state, conv cache, KV cache) = uncached = transformers'
    prompt = ids[0, :7].tolist()
    ours = generate(model, prompt, 12, greedy=True)
    assert ours == generate(model, prompt, 12, greedy=True, use_cache=False)
    with torch.no_grad():
        tokens = torch.tensor([prompt])  # (a 0 in the prompt is a token here, not padding)
        hf_out = reference.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=12,
                                    do_sample=False)
    assert ours == hf_out[0, len(prompt):].tolist()
    # the printed flags build this very model
    run = printed_run(printed)
    cfg = meta["model_config"]
    for key in ("experimental_attention_variant", "linear_attention_freq", "linear_num_value_heads",
                "attention_output_gate", "apply_layernorm_1p", "rotary_percent", "num_experts", "moe_layer_freq",
                "moe_router_pre_softmax", "moe_shared_expert_gate", "kv_channels", "num_query_groups",
                "mtp_num_layers"):
        assert getattr(run.model, key) == cfg[key], key
    # and back: the same tensors under the same names
    back, _, _ = export_back(convert, ck, tmp_path / "hf", tmp_path / "back",
                             *(["--hf-architecture", "qwen3_5_moe_text"] if case == "qwen3_5_moe" else []))
    loaded = AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    assert type(loaded).__name__ == cls


def _megalite_model(root, share_mtp_fc=False, **kw):
    """A random megalite model saved; `share_mtp_fc`: every MTP module with module 0's fc and norms."""
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                kv_channels=8, vocab_size=VOCAB, padded_vocab_size=128, seq_length=64, max_position_embeddings=64,
                hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1, position_embedding_type="rope",
                rotary_percent=0.5, rotary_base=5000.0, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                add_bias_linear=False, ffn_hidden_size=40, qk_layernorm=True, attention_output_gate=True,
                experimental_attention_variant="gated_delta_net", linear_attention_freq="2", linear_conv_kernel_dim=4,
                linear_key_head_dim=6, linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=6,
                untie_embeddings_and_output_weights=True)
    config = GPTConfig(**dict(base, **kw))
    model = GPTModel(config)
    model.initialize(11)
    g = torch.Generator().manual_seed(5)
    state = {n: (torch.rand(p.shape, generator=g) * 0.5 - 0.25 if n.endswith("norm.weight") else p.detach().clone())
             for n, p in model.global_named_parameters()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:  # (tied: no output layer)
            state[name] = state[name][:VOCAB]
    for k in range(1, (config.mtp_num_layers or 0) * share_mtp_fc):
        for part in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            state[f"mtp.layers.{k}.{part}.weight"] = state[f"mtp.layers.0.{part}.weight"]
    save_full_state_dict(str(root), state, config.to_dict(), RunConfig().to_dict())
    return str(root)


MEGALITE_CASES = {  # (with MTP: Qwen3.5's and Qwen3-Next's mtp.* both ways)
    "dense-1p": dict(apply_layernorm_1p=True, mtp_num_layers=1),
    "dense-plain-norms-tied": dict(untie_embeddings_and_output_weights=False),
    "moe": dict(apply_layernorm_1p=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12,
                moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_layer_freq="[1,1,0,1]",
                mtp_num_layers=1),
}


@pytest.mark.parametrize("case", list(MEGALITE_CASES))
def test_megalite_model_exports_with_equal_logits_and_imports_back(case, tmp_path):
    ck = _megalite_model(tmp_path / "ck", **MEGALITE_CASES[case])
    out = run_convert(convert, "megalite", "hf", ck, tmp_path / "hf", "--no-tokenizer")
    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ours = load_model(ck)[0]
    ids = _ids(3)
    with torch.no_grad():
        diff = (next_token_logits(ours, ids) - theirs(ids).logits.float()).abs().max().item()
    assert diff < 1e-5, diff
    back = load_model(run_convert(convert, "hf", "megalite", out, tmp_path / "back"))[0]
    mine = dict(ours.global_named_parameters())
    # imports are zero-centred (--apply-layernorm-1p); a plain-norm model comes back with w - 1 stored
    shift = float(back.config.apply_layernorm_1p and not ours.config.apply_layernorm_1p)
    for name, p in back.global_named_parameters():
        want = mine[name] - shift if name.endswith("norm.weight") else mine[name]
        assert torch.allclose(p, want, atol=1e-6, rtol=0), name


def test_two_mtp_modules_share_the_fc_both_ways(tmp_path, capsys):
    """Qwen3-Next's D MTP layers share one fc and its norms: two modules with their own are refused;
    with the same ones they export once and import back into both modules exactly."""
    ck = _megalite_model(tmp_path / "ck", apply_layernorm_1p=True, mtp_num_layers=2)
    assert convert.main(["--model-type", "GPT", "--loader", "megalite", "--saver", "hf", "--load-dir", ck,
                         "--save-dir", str(tmp_path / "hf"), "--no-tokenizer"]) == 2
    assert "MTP module 1's mtp.pre_fc_norm_embedding.weight differs from module 0's" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "hf")
    ck = _megalite_model(tmp_path / "shared", share_mtp_fc=True, apply_layernorm_1p=True, mtp_num_layers=2)
    out = run_convert(convert, "megalite", "hf", ck, tmp_path / "hf", "--no-tokenizer")
    assert {k for k in safetensors_of(out) if k.startswith("mtp.") and ".layers." not in k} == {
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
    (_, a), (meta_b, b) = load_full_state_dict(ck), load_full_state_dict(
        run_convert(convert, "hf", "megalite", out, tmp_path / "back"))
    assert meta_b["model_config"]["mtp_num_layers"] == 2
    assert sorted(a) == sorted(b)
    # (exact but for the DeltaNet's plain out_norm, stored w + 1 there: fp32 rounding of w + 1 - 1)
    assert [n for n in a if not torch.equal(a[n], b[n]) and not n.endswith("out_norm.weight")] == []
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)
