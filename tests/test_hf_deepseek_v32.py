"""DeepSeek-V3.2 (DeepSeek-V3 with DeepSeek Sparse Attention) to and from Hugging Face's
DeepseekV32ForCausalLM (issue 44).

A random transformers model (top-k 6 of 40 keys, so the indexer's choice matters; YaRN; a dense first
layer; grouped sigmoid routing) imports with the same logits (fp32, 1e-5) and exports back to the
same tensors; greedy generation with the caches (the latent, the rotated key, the indexer's keys)
equals transformers' and megalite's uncached decoding token for token; a random megalite DSA model
exports to a model transformers computes the same logits with, and imports back to the same
tensors. With an MTP module (the released checkpoint's layout: decoder layer num_hidden_layers, its
indexer too, which transformers neither writes nor loads, so the test adds it from transformers' own
V3.2 decoder layer): imports with megalite's MTP loss equal to a plain-PyTorch reference built on
that layer (transformers' MtpModel needs num_mtp_layers and mtp_layer_types, which DeepseekV32Config
does not have), and exports back to the same tensors. Cost: ~10 s (the MTP case ~1 s of it).
"""
import json
import os

import pytest
import torch

from hf_helpers import convert_tool, export_back, mtp_loss, printed_run, run_convert, safetensors_of

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("transformers without DeepseekV32ForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV32Model  # noqa: E402

from megalite.checkpoint.offline import save_full_state_dict  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.generation import generate, load_model, next_token_logits  # noqa: E402
from megalite.model import GPTConfig, GPTModel  # noqa: E402
from tolerances import logits_atol  # noqa: E402

convert = convert_tool()

VOCAB = 96
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
BASE = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=64, vocab_size=VOCAB, intermediate_size=56, moe_intermediate_size=24,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, rms_norm_eps=1e-6, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, tie_word_embeddings=False,
            rope_parameters=YARN, index_n_heads=3, index_head_dim=10, index_topk=6)


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.25)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model.eval()


def _hf_model(path):
    model = _randomize(DeepseekV32ForCausalLM(DeepseekV32Config(**BASE)))
    model.save_pretrained(path)
    return model



def _ids(seed=0, seq=40):
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))



def test_imports_with_equal_logits_exports_back_and_generates_the_same(tmp_path, capsys):
    reference = _hf_model(tmp_path / "hf")
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    printed = capsys.readouterr().out
    model, meta = load_model(ck)
    ids = _ids()
    with torch.no_grad():
        theirs = reference(ids).logits.float()
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    assert diff < 1e-5, diff
    # the indexer's choice matters: every key (top-k = s) gives other logits
    for m in model.modules():
        if hasattr(m, "topk") and hasattr(m, "indexer"):
            m.topk = 10 ** 6
    assert (next_token_logits(model, ids) - theirs).abs().max().item() > 1e-3
    model = load_model(ck)[0]
    prompt = ids[0, :9].tolist()
    ours = generate(model, prompt, 12, greedy=True)
    assert ours == generate(model, prompt, 12, greedy=True, use_cache=False)
    with torch.no_grad():
        tokens = torch.tensor([prompt])
        hf_out = reference.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=12,
                                    do_sample=False)
    assert ours == hf_out[0, len(prompt):].tolist()
    # the printed flags build this very model
    run = printed_run(printed)
    cfg = meta["model_config"]
    for key in ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
                "q_lora_rank", "num_experts", "moe_layer_freq"):
        assert getattr(run.model, key) == cfg[key], key
    back, _, _ = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    assert type(AutoModelForCausalLM.from_pretrained(back, local_files_only=True)).__name__ == "DeepseekV32ForCausalLM"


def test_megalite_dsa_model_exports_with_equal_logits_and_imports_back(tmp_path):
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                       seq_length=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                       init_method_std=0.2, position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6,
                       swiglu=True, add_bias_linear=False, ffn_hidden_size=48, qk_layernorm=True,
                       multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                       qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope", experimental_attention_variant="dsa",
                       dsa_indexer_n_heads=2, dsa_indexer_head_dim=12, dsa_indexer_topk=5,
                       untie_embeddings_and_output_weights=True)
    model = GPTModel(config)
    model.initialize(4)
    g = torch.Generator().manual_seed(5)
    state = {n: (torch.rand(p.shape, generator=g) + 0.5 if n.endswith("norm.weight") else p.detach().clone())
             for n, p in model.global_named_parameters()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[name] = state[name][:VOCAB]
    save_full_state_dict(str(tmp_path / "ck"), state, config.to_dict(), RunConfig().to_dict())
    out = run_convert(convert, "megalite", "hf", tmp_path / "ck", tmp_path / "hf", "--no-tokenizer")
    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ours = load_model(str(tmp_path / "ck"))[0]
    ids = _ids(3)
    with torch.no_grad():
        diff = (next_token_logits(ours, ids) - theirs(ids).logits.float()).abs().max().item()
    assert diff < 1e-5, diff
    back = load_model(run_convert(convert, "hf", "megalite", out, tmp_path / "back"))[0]
    mine = dict(ours.global_named_parameters())
    for name, p in back.global_named_parameters():
        assert torch.equal(p, mine[name]), name


def _add_mtp_module(path, main):
    """MTP module 0 written into `path` as DeepSeek-V3.2's checkpoint stores it (model.layers.3.*:
    enorm, hnorm, eh_proj, an MoE decoder layer with its indexer, shared_head.norm, copies of the
    embedding and lm_head; num_nextn_predict_layers 1). Its layer is transformers' own: a 1-layer
    DeepseekV32Model whose final norm is shared_head.norm. Returns it and the three MTP weights."""
    from safetensors.torch import save_file
    block = _randomize(DeepseekV32Model(DeepseekV32Config(**dict(BASE, num_hidden_layers=1, first_k_dense_replace=0))), 1)
    block.save_pretrained(path / "block")  # transformers' file layout of the layer (its experts included)
    g, h = torch.Generator().manual_seed(2), BASE["hidden_size"]
    own = {"enorm.weight": torch.rand(h, generator=g) + 0.5, "hnorm.weight": torch.rand(h, generator=g) + 0.5,
           "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.25}
    tensors = safetensors_of(path)
    for name, t in safetensors_of(path / "block").items():
        name = name.removeprefix("model.")
        tensors["model.layers.3.shared_head.norm.weight" if name == "norm.weight" else
                "model.layers.3." + name.removeprefix("layers.0.")] = t
    tensors.pop("model.layers.3.embed_tokens.weight")  # the block's own: replaced by the main model's copy
    tensors.update({"model.layers.3." + k: v for k, v in own.items()})
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    assert any(k.startswith("model.layers.3.self_attn.indexer.") for k in tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json") as f:
        config = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump(dict(config, num_nextn_predict_layers=1), f)
    return block, own


def _reference_mtp(main, block, own, tokens):
    """MTP module 1's loss and hidden states [b, s-1, h], in plain PyTorch around transformers' layer
    (DeepSeek-V3, Sec. 2.2): h_1 = norm(layer(eh_proj([enorm(Emb(t_{i+1})); hnorm(h_0[i])]))). Over
    all s positions as megalite (Megatron-LM's roll_tensor: token 0 enters at the end, its position
    out of the loss): causal, the last changes no other, but the indexer's top-k among keys tied at
    ReLU's 0 goes by column, and torch.topk breaks ties alike only over rows of the same length."""
    def rms(x, w):
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + BASE["rms_norm_eps"]))
    b, s = tokens.size(0), tokens.size(1) - 1
    rolled = torch.cat([tokens[:, 1:-1], torch.zeros_like(tokens[:, :1])], dim=1)  # [b, s]
    with torch.no_grad():
        h0 = main.model(tokens[:, :-1]).last_hidden_state  # the final-normed h_0
        x = torch.cat([rms(main.model.embed_tokens(rolled), own["enorm.weight"]), rms(h0, own["hnorm.weight"])],
                      dim=-1) @ own["eh_proj.weight"].T
        out = block(inputs_embeds=x, position_ids=torch.arange(s).expand(b, s)).last_hidden_state[:, :-1]
        logits = main.lm_head(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten()).item(), out


def test_released_layout_with_an_mtp_module_imports_with_its_loss_and_exports_back(tmp_path, capsys):
    main = _hf_model(tmp_path / "hf")
    block, own = _add_mtp_module(tmp_path / "hf", main)
    ck = run_convert(convert, "hf", "megalite", tmp_path / "hf", tmp_path / "ck")
    assert "--mtp-num-layers 1" in capsys.readouterr().out
    model, meta = load_model(ck)
    assert meta["model_config"]["mtp_num_layers"] == 1
    tokens = _ids(4, 41)
    ours, ours_h = mtp_loss(model, tokens)
    theirs, theirs_h = _reference_mtp(main, block, own, tokens)
    h_diff = (ours_h.transpose(0, 1)[:, :-1] - theirs_h).abs().max().item()
    with capsys.disabled():
        print(f"V3.2 MTP loss megalite {ours:.7f} reference {theirs:.7f}; max |h_1 difference| {h_diff:.3e}")
    assert abs(ours - theirs) < logits_atol(torch.tensor(ours)) and h_diff < logits_atol(theirs_h)
    # the indexer's choice matters in the MTP layer too: every key gives another loss
    model.mtp.layers[0].transformer_layer.self_attention.core_attention.topk = 10 ** 6
    assert abs(mtp_loss(model, tokens)[0] - ours) > 1e-4
    back, _, config = export_back(convert, ck, tmp_path / "hf", tmp_path / "back")
    assert config["num_nextn_predict_layers"] == 1
    again = load_model(run_convert(convert, "hf", "megalite", back, tmp_path / "again"))[0]
    mine = dict(load_model(ck)[0].global_named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in again.global_named_parameters())
