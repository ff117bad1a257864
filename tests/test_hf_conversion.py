"""Checkpoint conversion: offline resharding, and export to / import from Hugging Face transformers.

The exported directory must load with AutoModelForCausalLM / AutoTokenizer and compute the same
function (logits within 1e-4, the same greedy continuation as tools/generate.py), for both
architectures; the import must give the same weights back; models transformers cannot express
must be refused, naming the setting.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT, run_pretrain

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megalite.checkpointing import load_full_state_dict, read_metadata, save_full_state_dict  # noqa: E402
from megalite.generation import build_tokenizer_for, generate, load_model, next_token_logits  # noqa: E402
from megalite.hf_conversion import ConversionError, hf_architecture, pretrain_flags  # noqa: E402
from megalite.model import GPTConfig, GPTModel, pad_vocab_size  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        # a wide init: sharp, position-dependent logits, so greedy continuations are not one repeated token
        "--init-method-std", "0.3", "--mock-data"]
LLAMA = ["--position-embedding-type", "rope", "--rotary-base", "5000", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6", "--ffn-hidden-size", "96"]
PROMPT = "The quick brown fox jumps over"


def _load_tool(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _load_tool("tools/checkpoint/convert.py", "megalite_convert")
generate_cli = _load_tool("tools/generate.py", "megalite_generate")


def corpus_lines():
    """A few KB of varied English-like text, for training the tokenizers."""
    g = torch.Generator().manual_seed(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex unusual zebras at "
             "noon and rain falls on green hills as rivers run to the sea").split()
    lines = []
    for i in range(120):
        n = int(torch.randint(4, 16, (1,), generator=g))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))
        lines.append(f"{text.capitalize()}, {i} times.")
    return lines


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    """A GPT-2 style model trained 2 iterations with a GPT-2 byte-level BPE (vocab/merges trained here)."""
    from tokenizers import ByteLevelBPETokenizer

    tmp = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_lines(), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(tmp), "tiny")
    vocab, merges = str(tmp / "tiny-vocab.json"), str(tmp / "tiny-merges.txt")
    size = len(json.load(open(vocab)))
    ck = str(tmp / "ck")
    run_pretrain(1, TINY + ["--vocab-size", str(size), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                            "--merge-file", merges, "--save", ck], tmp, "gpt2")
    return ck


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """A Llama style model (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) with a SentencePiece
    tokenizer trained here by tools/train_tokenizer.py."""
    tmp = tmp_path_factory.mktemp("llama")
    with open(tmp / "corpus.jsonl", "w") as f:
        for line in corpus_lines():
            f.write(json.dumps({"text": line}) + "\n")
    train_tokenizer = _load_tool("tools/train_tokenizer.py", "megalite_train_tokenizer")
    train_tokenizer.main(["--input", str(tmp / "corpus.jsonl"), "--model-prefix", str(tmp / "sp"),
                          "--vocab-size", "360", "--num-threads", "1"])
    ck = str(tmp / "ck")
    run_pretrain(1, TINY + LLAMA + ["--vocab-size", "360", "--tokenizer-type", "SentencePieceTokenizer",
                                    "--tokenizer-model", str(tmp / "sp.model"), "--save", ck], tmp, "llama")
    return ck


def export(ck, out, *extra):
    assert convert.main(["--model-type", "GPT", "--loader", "megalite", "--saver", "hf", "--load-dir", ck,
                         "--save-dir", str(out), *extra]) == 0
    return str(out)


def max_logit_diff(ck, hf_dir, seed=0):
    model, meta = load_model(ck)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    cfg = meta["model_config"]
    ids = torch.randint(0, cfg["vocab_size"], (3, min(40, cfg["max_position_embeddings"])),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, theirs = next_token_logits(model, ids), hf(ids).logits.float()
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item(), hf


def check_export(ck, out, arch, capsys):
    hf_dir = export(ck, out)
    diff, hf = max_logit_diff(ck, hf_dir)
    print(f"{arch}: max |logit difference| megalite vs transformers = {diff:.3e}")
    assert type(hf).__name__ == arch
    assert diff < 1e-4, diff
    # the tokenizer: AutoTokenizer gives megalite's ids
    meta = read_metadata(ck)
    ours, theirs = build_tokenizer_for(meta), AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    text = PROMPT + ".\nSeven wizards,  at noon; 42 zebras!"
    assert ours.tokenize(text) == theirs(text).input_ids
    # greedy continuation: transformers' generate == tools/generate.py --greedy
    prompt = ours.tokenize(PROMPT)
    out_ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    model, _ = load_model(ck)
    assert generate(model, prompt, 12, greedy=True, eod=ours.eod) == out_ids
    assert len(set(out_ids)) > 2, f"degenerate continuation {out_ids}: the comparison would prove little"
    capsys.readouterr()
    assert generate_cli.main(["--load", ck, "--prompt", PROMPT, "--max-new-tokens", "12", "--greedy"]) == 0
    printed = capsys.readouterr().out
    # (decoded by megalite's tokenizer: on byte-fallback pieces that are not valid UTF-8, as a random
    # model emits, SentencePiece and Hugging Face substitute U+FFFD differently)
    assert printed == ours.detokenize([t for t in out_ids if t != ours.eod]) + "\n"
    return hf_dir, out_ids


def test_gpt2_export_matches_transformers(gpt2_ckpt, tmp_path, capsys):
    hf_dir, _ = check_export(gpt2_ckpt, tmp_path / "hf", "GPT2LMHeadModel", capsys)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"] is True
    assert config["vocab_size"] == read_metadata(gpt2_ckpt)["model_config"]["vocab_size"]  # unpadded


def test_llama_export_matches_transformers_and_imports_back(llama_ckpt, tmp_path, capsys):
    hf_dir, out_ids = check_export(llama_ckpt, tmp_path / "hf", "LlamaForCausalLM", capsys)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert (config["num_key_value_heads"], config["tie_word_embeddings"], config["attention_bias"]) == (2, False, False)

    # import the export back, on another layout: the same tensors, so the same logits
    back = str(tmp_path / "back")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir,
                         "--save-dir", back, "--target-tensor-parallel-size", "2"]) == 0
    _, original = load_full_state_dict(llama_ckpt)
    meta, imported = load_full_state_dict(back)
    assert sorted(original) == sorted(imported)
    for name in original:
        assert torch.equal(original[name], imported[name]), name
    assert meta["layout"]["tp"] == 2 and meta["args"]["tokenizer_type"] == "HuggingFaceTokenizer"
    ids = torch.randint(0, 360, (2, 30), generator=torch.Generator().manual_seed(1))
    assert torch.equal(next_token_logits(load_model(llama_ckpt)[0], ids), next_token_logits(load_model(back)[0], ids))

    # generate.py with the imported checkpoint (the HF directory as tokenizer), as a script
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools/generate.py"), "--load", back, "--prompt", PROMPT,
                           "--max-new-tokens", "12", "--greedy"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    theirs = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert proc.stdout == theirs.decode([t for t in out_ids if t != theirs.eos_token_id]) + "\n"

    # ... and pretrain_gpt.py continues from it (an Adam step of lr 1e-30 is below the fp32 spacing of every
    # weight, so the weights it saves are the ones it loaded; --lr must be > 0)
    ft = str(tmp_path / "ft")
    flags = TINY + pretrain_flags(meta["model_config"]) + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--lr", "1e-30", "--train-iters", "1",
        "--load", back, "--finetune", "--save", ft]
    records, proc = run_pretrain(1, flags, tmp_path, "finetune")
    assert "loaded weights from" in proc.stdout and [r["iteration"] for r in records if "lm_loss" in r] == [1]
    _, after = load_full_state_dict(ft)
    for name in original:
        assert torch.equal(original[name], after[name]), name


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_reshard_roundtrip_is_exact(which, gpt2_ckpt, llama_ckpt, tmp_path):
    ck = gpt2_ckpt if which == "gpt2" else llama_ckpt
    meta, original = load_full_state_dict(ck)
    sharded, back = str(tmp_path / "tp2pp2"), str(tmp_path / "back")
    for src, dst, t, p in ((ck, sharded, 2, 2), (sharded, back, 1, 1)):
        assert convert.main(["--model-type", "GPT", "--loader", "megalite", "--saver", "megalite", "--load-dir", src,
                             "--save-dir", dst, "--target-tensor-parallel-size", str(t),
                             "--target-pipeline-parallel-size", str(p)]) == 0
    m = read_metadata(sharded)
    assert (m["layout"]["tp"], m["layout"]["pp"], m["iteration"]) == (2, 2, meta["iteration"])
    assert len([f for f in os.listdir(m["dir"]) if f.startswith("rank_")]) == 4  # one data file per (tp, pp) rank
    # a 2-way TP shard really is half: the padded vocabulary and the heads are split
    from safetensors.torch import load_file  # rank files are plain safetensors
    shard0 = load_file(os.path.join(m["dir"], "rank_00000.safetensors"))
    emb = shard0["param/embedding.word_embeddings.weight/0"]
    assert emb.numel() == pad_vocab_size(meta["model_config"]["vocab_size"], 128, 2) // 2 * 64
    for d in (sharded, back):
        _, state = load_full_state_dict(d)
        assert sorted(state) == sorted(original)
        for name in original:
            assert torch.equal(original[name], state[name]), (d, name)


def test_reshard_refuses_a_layout_that_does_not_divide(llama_ckpt, tmp_path, capsys):
    assert convert.main(["--model-type", "GPT", "--loader", "megalite", "--saver", "megalite", "--load-dir", llama_ckpt,
                         "--save-dir", str(tmp_path / "x"), "--target-tensor-parallel-size", "4"]) == 2
    assert "--target-tensor-parallel-size 4 does not divide the model's --num-query-groups (2)" in capsys.readouterr().err


def _config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, padded_vocab_size=128,
                seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.3)
    base.update(kw)
    return GPTConfig(**base)


def _random_checkpoint(root, config):
    model = GPTModel(config)
    model.initialize(7)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][: config.vocab_size]
    if "output_layer.weight" in state:
        state["output_layer.weight"] = state["output_layer.weight"][: config.vocab_size]
    save_full_state_dict(str(root), state, config.to_dict(), {"make_vocab_size_divisible_by": 128})
    return str(root)


ROPE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)


@pytest.mark.parametrize("kw", [
    dict(untie_embeddings_and_output_weights=True, norm_epsilon=1e-3),  # GPT-2 style, untied output layer
    dict(ROPE, add_bias_linear=True),  # Llama style: MHA, biases, tied
    dict(ROPE, add_bias_linear=False, num_query_groups=1, kv_channels=24, rotary_base=500.0,
         untie_embeddings_and_output_weights=True),  # multi-query, head_dim != hidden / heads
], ids=["gpt2-untied", "llama-mha-bias-tied", "llama-mqa-headdim"])
def test_variants_match_transformers(kw, tmp_path):
    ck = _random_checkpoint(tmp_path / "ck", _config(**kw))
    diff, hf = max_logit_diff(ck, export(ck, tmp_path / "hf", "--no-tokenizer"))
    print(f"{type(hf).__name__} {kw}: max |logit difference| = {diff:.3e}")
    assert diff < 1e-4, diff
    back = str(tmp_path / "back")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", back, "--target-pipeline-parallel-size", "2"]) == 0
    (_, a), (meta, b) = load_full_state_dict(ck), load_full_state_dict(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert "tokenizer_type" not in meta["args"]  # no tokenizer files were exported


@pytest.mark.parametrize("kw, message", [
    (dict(position_embedding_type="rope"), "--normalization LayerNorm with --position-embedding-type rope"),
    (dict(position_embedding_type="rope", normalization="RMSNorm"), "a GeLU MLP (no --swiglu)"),
    (dict(ROPE, rotary_percent=0.5), "--rotary-percent 0.5"),
    (dict(num_query_groups=2), "--num-query-groups 2 (grouped-query attention) with learned absolute positions"),
    (dict(add_bias_linear=False), "--disable-bias-linear with learned absolute positions"),
    (dict(swiglu=True), "--swiglu with learned absolute positions"),
    (dict(normalization="RMSNorm"), "--normalization RMSNorm with learned absolute positions"),
    (dict(kv_channels=8), "--kv-channels 8"),
])
def test_unexpressible_models_are_refused(kw, message):
    with pytest.raises(ConversionError, match="cannot export to Hugging Face") as e:
        hf_architecture(_config(**kw).to_dict())
    assert message in str(e.value)


def test_unexpressible_export_writes_nothing(tmp_path, capsys):
    ck = _random_checkpoint(tmp_path / "ck", _config(position_embedding_type="rope", swiglu=True))
    out = tmp_path / "hf"
    assert convert.main(["--model-type", "GPT", "--loader", "megalite", "--saver", "hf", "--load-dir", ck,
                         "--save-dir", str(out), "--no-tokenizer"]) == 2
    assert "--normalization LayerNorm with --position-embedding-type rope" in capsys.readouterr().err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("hf.tmp")]


def test_import_refuses_what_megalite_cannot_compute(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2's own tanh-approximated GeLU ("gelu_new") is not megalite's exact GeLU
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=8)).save_pretrained(
        tmp_path / "hf")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    assert "activation_function 'gelu_new'" in capsys.readouterr().err


def test_gpt2_reference_vocabulary_exports(tmp_path):
    """The real GPT-2 vocabulary (when the shared copy is present) round-trips through AutoTokenizer."""
    vocab = os.path.join(ROOT, "..", "shared", "tokenizers", "gpt2-vocab.json")
    merges = os.path.join(ROOT, "..", "shared", "tokenizers", "gpt2-merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        pytest.skip("../shared/tokenizers/gpt2-vocab.json / gpt2-merges.txt not present")
    from megalite.data.tokenizers import GPT2BPETokenizer
    from megalite.hf_conversion import SAMPLE_TEXT, export_tokenizer

    ours = GPT2BPETokenizer(vocab, merges)
    export_tokenizer(ours, str(tmp_path))  # checks the ids itself; check again here, independently
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert theirs(SAMPLE_TEXT).input_ids == ours.tokenize(SAMPLE_TEXT)
    assert theirs("Hello world").input_ids == [15496, 995]  # GPT-2's published ids
    assert theirs.eos_token_id == ours.eod == 50256
