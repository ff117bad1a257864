"""tools/generate.py and megalite/generation.py: loading, decoding rules and clear errors.
(Agreement with transformers' generate is tested in test_hf_conversion.py.)"""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from dist_helpers import ROOT

from megalite.checkpointing import save_full_state_dict
from megalite.generation import generate, load_model, next_token_logits
from megalite.model import GPTConfig, GPTModel

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
    save_full_state_dict(root, state, config.to_dict(), {"make_vocab_size_divisible_by": 128, "vocab_size": VOCAB},
                         tp=2)
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
