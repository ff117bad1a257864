"""tools/checkpoint/convert.py --loader megatron --saver hf, judged by megatron-core itself: a
torch_dist checkpoint that megatron-core saves, converted, gives transformers' logits equal to
megatron-core's on the same corpus tokens (GPT-2 style, Llama style, Mixtral style)."""
import json
import os

import pytest
import torch

import megatron_core_ref as ref
from tolerances import logits_atol

pytestmark = pytest.mark.skipif(not ref.available(), reason=ref.MISSING)

# megatron-core's run (one subprocess for the three models) and the conversions are shared by the tests
CASES = {
    "gpt2": ref.Spec(),  # learned positions, LayerNorm, GeLU, biases, tied
    "llama": ref.Spec(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=96,
                      num_query_groups=2, untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "mixtral": ref.Spec(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
                        untie_embeddings_and_output_weights=True, add_bias_linear=False, num_experts=4),
}


@pytest.fixture(scope="module")
def megatron_runs(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_hf")
    data = corpus[corpus.index("--data-path") + 1]
    tokens = ref.corpus_tokens(data, 2, 32)[:, :-1]
    # the Llama-style run names the corpus's SentencePiece model in its args, as Megatron-LM records it
    sp = {"tokenizer_type": "SentencePieceTokenizer", "vocab_size": None,
          "tokenizer_model": corpus[corpus.index("--tokenizer-model") + 1]}
    jobs = [(spec, [ref.save_torch_dist(tmp / name, iteration=5, extra_args=sp if name == "llama" else None),
                    ref.logits(tokens)]) for name, spec in CASES.items()]
    results = ref.run_many(jobs)
    return tmp, tokens, {name: r[1] for name, r in zip(CASES, results)}


def convert(src, dst, *extra, tokenizer=False):
    import convert as tool  # tools/checkpoint/convert.py, in this process
    return tool.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", str(src),
                      "--save-dir", str(dst), *extra] + ([] if tokenizer else ["--no-tokenizer"]))


@pytest.fixture(scope="module", autouse=True)
def _tool_path():
    import sys
    path = os.path.join(ref.ROOT, "tools", "checkpoint")
    sys.path.insert(0, path)
    yield
    sys.path.remove(path)


@pytest.mark.launches
@pytest.mark.parametrize("name", list(CASES))
def test_converted_checkpoint_gives_megatron_core_logits_in_transformers(megatron_runs, name):
    from transformers import AutoModelForCausalLM
    tmp, tokens, logits = megatron_runs
    out = tmp / f"{name}_hf"
    # a small shard limit: the sharded layout (several files and the index) is what transformers reads
    assert convert(tmp / name, out, "--max-shard-size", "100KB", tokenizer=name == "llama") == 0
    if name == "llama":  # the tokenizer the checkpoint's args name, exported (and checked to give its ids)
        from transformers import AutoTokenizer
        assert AutoTokenizer.from_pretrained(out).vocab_size == 512
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = logits[name]
    assert theirs.shape == ours.shape == (2, 32, CASES[name].vocab_size)
    diff = (theirs - ours).abs().max().item()  # transformers' logits against megatron-core's (tolerances.py)
    assert diff < logits_atol(ours), (name, diff)


@pytest.mark.launches
def test_refusals_name_the_problem(megatron_runs, tmp_path, capsys):
    tmp, _, _ = megatron_runs
    assert convert(tmp / "gpt2", tmp_path / "x", "--max-shard-size", "lots") == 2
    assert "--max-shard-size: not a size: 'lots'" in capsys.readouterr().err
    # the checkpoint's args name the NullTokenizer: no Hugging Face tokenizer to write, so the
    # weights go alone, with a notice (no --no-tokenizer needed)
    import convert as tool
    code = tool.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp / "gpt2"),
                      "--save-dir", str(tmp_path / "y")])
    out = capsys.readouterr().out
    assert code == 0 and "NullTokenizer of" in out and "exported without a tokenizer" in out
    assert (tmp_path / "y" / "config.json").exists() and not (tmp_path / "y" / "tokenizer.json").exists()
