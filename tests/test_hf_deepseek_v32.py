"""DeepSeek-V3.2 (DeepSeek-V3 with DeepSeek Sparse Attention) to and from Hugging Face's
DeepseekV32ForCausalLM (issue 44).

A random transformers model (top-k 6 of 40 keys, so the indexer's choice matters; YaRN; a dense first
layer; grouped sigmoid routing) imports with the same logits (fp32, 1e-5) and exports back to the
same tensors; greedy generation with the caches (the latent, the rotated key, the indexer's keys)
equals transformers' and megalite's uncached decoding token for token; a random megalite DSA model
exports to a model transformers computes the same logits with, and imports back to the same
tensors. Cost: ~10 s.
"""
import shlex

import pytest
import torch

from hf_helpers import convert_tool, run_convert, safetensors_of

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("transformers without DeepseekV32ForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from megalite.checkpoint.offline import save_full_state_dict  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.generation import generate, load_model, next_token_logits  # noqa: E402
from megalite.model import GPTConfig, GPTModel  # noqa: E402

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


def _hf_model(path):
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**BASE))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.25)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    model.eval().save_pretrained(path)
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
    from megalite.arguments import parse_config
    flags = shlex.split(printed.split("pretrain_gpt.py ")[1].splitlines()[0].removesuffix(" ..."))
    run = parse_config(flags + ["--mock-data", "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1",
                                "--lr", "1e-3"], 1, check_files=False)
    cfg = meta["model_config"]
    for key in ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
                "q_lora_rank", "num_experts", "moe_layer_freq"):
        assert getattr(run.model, key) == cfg[key], key
    back = run_convert(convert, "megalite", "hf", ck, tmp_path / "back", "--no-tokenizer")
    original, exported = safetensors_of(tmp_path / "hf"), safetensors_of(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
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
