"""tools/generate.py and megalite/generation.py: loading, decoding rules and clear errors.
(Agreement with transformers' generate is tested in test_hf_conversion.py.)"""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from dist_helpers import ROOT

from megalite.checkpoint.offline import save_full_state_dict
from megalite.config import RunConfig
from megalite.generation import generate, load_model, next_token_logits
from megalite.model import GPTConfig, GPTModel
from tolerances import assert_close_fp32, fp32_atol

spec = importlib.util.spec_from_file_location("megalite_generate", os.path.join(ROOT, "tools/generate.py"))
generate_cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate_cli)

VOCAB = 50


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A randomly initialised model saved at TP 2 without a tokenizer (as a --mock-data run)."""
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                       seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                       init_method_std=0.3)
    model = GPTModel(config)
    model.initialize(3)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][:VOCAB]
    root = str(tmp_path_factory.mktemp("gen") / "ck")
    save_full_state_dict(root, state, config.to_dict(), RunConfig().to_dict(), tp=2)
    model.eval()
    return root, model


def test_loaded_model_computes_the_saved_model(checkpoint):
    root, reference = checkpoint
    model, meta = load_model(root)
    assert meta["layout"]["tp"] == 2 and model.config.padded_vocab_size == 128  # re-padded for TP 1
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, torch.arange(10).expand(2, 10)).transpose(0, 1)[..., :VOCAB]
    assert torch.allclose(next_token_logits(model, ids), expected, atol=1e-6)


def test_sampling_rules(checkpoint):
    model, _ = load_model(checkpoint[0])
    prompt = [1, 2, 3]
    greedy = generate(model, prompt, 8, greedy=True)
    assert len(greedy) == 8 and len(set(greedy)) > 1
    assert generate(model, prompt, 8, top_k=1, temperature=0.7) == greedy  # top-1 sampling is argmax
    a, b = (generate(model, prompt, 12, seed=s) for s in (1, 1))
    assert a == b  # the seed decides
    assert any(generate(model, prompt, 12, seed=s) != a for s in range(2, 6))
    stop = greedy.index(greedy[-1])
    assert generate(model, prompt, 8, greedy=True, eod=greedy[-1]) == greedy[:stop + 1]  # stops after eod
    with pytest.raises(ValueError, match="--max-new-tokens 14 exceeds"):
        generate(model, prompt, 14, greedy=True)  # 3 + 14 > 16 learned positions
    with pytest.raises(ValueError, match="--temperature must be > 0"):
        generate(model, prompt, 2, temperature=0)
    with pytest.raises(ValueError, match="--top-k must be >= 0"):
        generate(model, prompt, 2, top_k=-1)


class PaddingLovingModel(torch.nn.Module):
    """Logits where the padded vocabulary rows (ids 5..7) are by far the largest."""
    config = SimpleNamespace(vocab_size=5, position_embedding_type="rope", max_position_embeddings=8)

    def forward(self, ids, position_ids):
        s, b = ids.shape[1], ids.shape[0]
        logits = torch.zeros(s, b, 8)
        logits[..., 5:] = 100.0
        logits[..., 2] = 1.0
        return logits


def test_padded_vocabulary_is_never_generated():
    model = PaddingLovingModel()
    assert generate(model, [0], 20, greedy=True) == [2] * 20
    sampled = generate(model, [0], 200, temperature=5.0, seed=0)
    assert max(sampled) < 5 and len(set(sampled)) == 5


def test_cli_errors_name_the_problem(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    # a user error: one `error:` line on stderr, status 2
    assert generate_cli.main(["--load", str(tmp_path / "nowhere"), "--prompt", "1 2"]) == 2
    assert f"--load {tmp_path / 'nowhere'}: directory not found" in capsys.readouterr().err
    assert generate_cli.main(["--load", str(tmp_path), "--prompt", "1 2"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
    assert generate_cli.main(["--load", root, "--prompt", "1 2"]) == 2
    err = capsys.readouterr().err
    assert "saved without a tokenizer" in err and "give --tokenizer-type" in err
    # a tokenizer given on the command line; NullTokenizer reads and writes ids
    assert generate_cli.main(["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "5", "--greedy",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]) == 0
    model, _ = load_model(root)
    expected = generate(model, [1, 2, 3], 5, greedy=True, eod=VOCAB - 1)
    assert capsys.readouterr().out.split() == [str(t) for t in expected if t != VOCAB - 1]
    # a tokenizer larger than the model's vocabulary is not this model's
    assert generate_cli.main(["--load", root, "--prompt", "1", "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", str(VOCAB + 10)]) == 2
    assert "more than the model's vocabulary (50)" in capsys.readouterr().err
    # without --vocab-size, NullTokenizer fills the model's vocabulary: ids 0..48 and eod 49
    assert generate_cli.main(["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "5", "--greedy",
                              "--tokenizer-type", "NullTokenizer"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected if t != VOCAB - 1]


# ---- key/value cache: the same tokens as recomputing the whole sequence -----------------------

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, use_rope_scaling=True,
             rope_scaling_original_max_position_embeddings=16, rotary_base=500.0)


def _model(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=128,
                seq_length=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.3)
    model = GPTModel(GPTConfig(**dict(base, **kw)))
    model.initialize(5)
    return model.eval()


# YaRN stretching a 16-position original context 4x (cos/sin scaled by 0.1·ln 4 + 1)
YARN = dict(LLAMA, position_embedding_type="yarn", use_rope_scaling=False, rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=16)


# cached attention sums keys in other blocks than the whole sequence does (tests/tolerances.py):
# two layers of some nine reductions (norms, projections over 64, QK^T, softmax and PV over up to
# 58 positions, the MLP's 256), the final norm and the logits: the probable bound of a deep chain
ROUNDING = dict(k=256, chain=20, bound="probable")


@pytest.mark.parametrize("kw", [{}, LLAMA, YARN], ids=["gpt2", "llama-gqa-rope-scaling", "yarn"])
def test_kv_cache_generates_what_recomputation_does(kw):
    from megalite.generation import kv_cache

    model = _model(**kw)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cached = generate(model, prompt, 50, greedy=True)
    # greedy decoding picks the same tokens either way only if every step's best logit leads the
    # next by more than the two paths' rounding can move them: the data must allow the equality
    whole = next_token_logits(model, torch.tensor([prompt + cached]))
    best = whole[0, len(prompt) - 1:-1].topk(2, -1).values  # the logits each new token was chosen from
    assert float((best[:, 0] - best[:, 1]).min()) > 2 * fp32_atol(scale=float(whole.abs().max()), **ROUNDING)
    assert cached == generate(model, prompt, 50, greedy=True, use_cache=False)
    assert len(set(cached)) > 5, cached  # not one repeated token: the comparison proves something
    assert generate(model, prompt, 30, seed=7) == generate(model, prompt, 30, seed=7, use_cache=False)
    # step by step, the cached logits are the recomputed ones; a chunk of several new tokens too
    ids = torch.tensor([prompt + cached[:20]])
    full = next_token_logits(model, ids)
    with kv_cache(model, 40) as layers:
        parts = [next_token_logits(model, ids[:, :8]), next_token_logits(model, ids[:, 8:9], 8),
                 next_token_logits(model, ids[:, 9:20], 9), next_token_logits(model, ids[:, 20:], 20)]
        assert layers[0].inference_cache.length == 28
    assert_close_fp32(torch.cat(parts, dim=1), full, **ROUNDING)
    assert all(layer.inference_cache is None for layer in layers)  # the cache is gone afterwards


def _tp_generate(rank, world_size, root):
    import torch.distributed as dist

    model, _ = load_model(root, tp_group=dist.group.WORLD)
    heads = model.decoder.layers[0].self_attention.num_groups
    prompt = [7, 3, 3, 8]
    return (heads, generate(model, prompt, 12, greedy=True), generate(model, prompt, 12, greedy=True, use_cache=False),
            generate(model, prompt, 12, seed=3))


def test_kv_cache_under_tensor_parallelism(checkpoint):
    from dist_helpers import spawn

    root, _ = checkpoint
    reference, _ = load_model(root)
    expected = generate(reference, [7, 3, 3, 8], 12, greedy=True, use_cache=False)  # 4 + 12 = 16 positions
    results = spawn(_tp_generate, 2, root)
    for heads, cached, recomputed, sampled in results:
        assert heads == 2  # each rank caches its own half of the 4 heads
        assert cached == recomputed == expected
    assert results[0][3] == results[1][3]  # sampling: every rank draws the same tokens
    assert len(set(expected)) > 3, expected


def test_cli_under_torchrun_shards_the_model(checkpoint, tmp_path):
    """tools/generate.py on 2 processes (TP 2) writes what one process does, with the cache or without."""
    import subprocess
    import sys

    from dist_helpers import free_port

    root, _ = checkpoint
    flags = ["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "10", "--greedy", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    outs = []
    for nproc, extra in ((1, []), (1, ["--no-kv-cache"]), (2, [])):
        cmd = [sys.executable, os.path.join(ROOT, "tools/generate.py"), *flags, *extra]
        if nproc > 1:
            cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port",
                        str(free_port())]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        assert f"TP {nproc})" in p.stderr and ("cache off" in p.stderr) == bool(extra)
        outs.append(p.stdout)
    assert outs[0] == outs[1] == outs[2] and len(outs[0].split()) >= 5
