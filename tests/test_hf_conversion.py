"""Checkpoint conversion: offline resharding, and export to / import from Hugging Face transformers.

The exported directory must load with AutoModelForCausalLM / AutoTokenizer and compute the same
function (logits within fp32 rounding of a deep chain, tests/tolerances.py; the same greedy continuation as tools/generate.py), for both
architectures; the import must give the same weights back; models transformers cannot express
must be refused, naming the setting.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT, run_pretrain

# transformers (and safetensors, which the conversion writes) are what this file tests against:
# `make test` installs them (.[hf]), so their absence is an error, not a skip
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from megalite.arguments import parse_args, validate_args
from megalite.checkpoint.files import read_metadata
from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict
from megalite.config import RunConfig
from megalite.data.saved_tokenizer import build_tokenizer_for
from megalite.generation import generate, load_model, next_token_logits
from megalite.checkpoint.hf.config import ConversionError, hf_architecture, pretrain_flags
from megalite.model import GPTConfig, GPTModel, pad_vocab_size
from tiny import tiny
from tolerances import logits_atol  # megalite's logits against transformers' for the same weights

TINY = tiny(max_position_embeddings=64, global_batch_size=None, train_iters=2, log_interval=1, eval_iters=0) + [
        "--hidden-dropout", "0", "--attention-dropout", "0",
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



def tiny_bpe(directory, vocab_size: int) -> tuple[str, str, int]:
    """A GPT-2-style byte-level BPE trained on the test corpus: (vocab.json, merges.txt, size)."""
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_lines(), vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(directory), "tiny")
    vocab = str(directory / "tiny-vocab.json")
    return vocab, str(directory / "tiny-merges.txt"), len(json.load(open(vocab)))

@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    """A GPT-2 style model trained 2 iterations with a GPT-2 byte-level BPE (vocab/merges trained here)."""
    tmp = tmp_path_factory.mktemp("gpt2")
    vocab, merges, size = tiny_bpe(tmp, 400)
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
    return (ours - theirs).abs().max().item() / logits_atol(theirs), hf  # within the bound: below 1


def check_export(ck, out, arch, capsys):
    hf_dir = export(ck, out)
    diff, hf = max_logit_diff(ck, hf_dir)
    print(f"{arch}: max |logit difference| megalite vs transformers = {diff:.3e} of the rounding bound")
    assert type(hf).__name__ == arch
    assert diff < 1, diff
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
    assert config["activation_function"] == "gelu" and config.get("tie_word_embeddings", True) is True  # 4.x omits defaults
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
    assert meta["layout"]["tp"] == 2 and meta["config"]["tokenizer"]["tokenizer_type"] == "HuggingFaceTokenizer"
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


def _random_checkpoint(root, config, random_norms=False):
    """A checkpoint of `config` with random weights (with `random_norms`, the norm weights too,
    instead of their init of ones, so that a mapping that swaps two norms shows)."""
    model = GPTModel(config)
    model.initialize(7)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    if random_norms:
        g = torch.Generator().manual_seed(3)
        state = {n: torch.rand(p.shape, generator=g) + 0.5 if n.endswith("layernorm.weight") else p
                 for n, p in state.items()}
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][: config.vocab_size]
    if "output_layer.weight" in state:
        state["output_layer.weight"] = state["output_layer.weight"][: config.vocab_size]
    save_full_state_dict(str(root), state, config.to_dict(), RunConfig().to_dict())
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
    print(f"{type(hf).__name__} {kw}: max |logit difference| = {diff:.3e} of the rounding bound")
    assert diff < 1, diff
    back = str(tmp_path / "back")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", back, "--target-pipeline-parallel-size", "2"]) == 0
    (_, a), (meta, b) = load_full_state_dict(ck), load_full_state_dict(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert meta["config"]["tokenizer"]["tokenizer_type"] is None  # no tokenizer files were exported


@pytest.mark.parametrize("kw, message", [
    (dict(position_embedding_type="rope"), "--normalization LayerNorm with --position-embedding-type rope"),
    (dict(position_embedding_type="rope", normalization="RMSNorm"), "a GeLU MLP (no --swiglu)"),
    (dict(ROPE, rotary_percent=0.5), "--rotary-percent 0.5"),
    (dict(num_query_groups=2), "--num-query-groups 2 (grouped-query attention) with learned absolute positions"),
    (dict(add_bias_linear=False), "--disable-bias-linear with learned absolute positions"),
    (dict(swiglu=True), "--swiglu with learned absolute positions"),
    (dict(normalization="RMSNorm"), "--normalization RMSNorm with learned absolute positions"),
    (dict(kv_channels=8), "--kv-channels 8"),
    (dict(qk_layernorm=True), "--qk-layernorm with learned absolute positions"),
    (dict(ROPE, qk_layernorm=True), "--qk-layernorm without --disable-bias-linear"),
    (dict(ROPE, qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True), "--add-qkv-bias with --qk-layernorm"),
    (dict(ROPE, window_size="128,0"), "--window-size 128,0, which"),
    (dict(ROPE, softmax_type="off-by-one"), "--softmax-type off-by-one, which"),
    (dict(ROPE, swiglu=False, quick_geglu=True), "--quick-geglu, which"),
    (dict(ROPE, glu_linear_offset=1.0), "--glu-linear-offset 1.0, which"),
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

    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                               activation_function="relu")).save_pretrained(tmp_path / "hf")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    assert "activation_function 'relu'" in capsys.readouterr().err


def _import(hf_dir, out, capsys, *extra):
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir", str(hf_dir),
                         "--save-dir", str(out), *extra]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    line = printed.split("pretrain_gpt.py --load ")[1].splitlines()[0].removesuffix(" ...")
    return str(out), line.split()[1:]  # the flags after --load DIR


def _hf_logits(model, vocab, seq, seed=0):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ids, model(ids).logits.float()


def test_real_gpt2_imports_trains_and_exports(tmp_path, capsys):
    """GPT2LMHeadModel as transformers builds GPT-2 itself (activation_function gelu_new, the tanh
    GeLU): exact import with --openai-gelu, training continues from it, and it exports back."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, merges, size = tiny_bpe(tmp_path, 300)
    # a wide init: large pre-activations, where the tanh approximation and exact GeLU differ visibly
    config = GPT2Config(vocab_size=size, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2)
    assert config.activation_function == "gelu_new"  # GPT-2's own
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    ck, flags = _import(tmp_path / "hf", tmp_path / "ck", capsys)
    assert "--openai-gelu" in flags
    ids, theirs = _hf_logits(reference, size, 40)
    model, meta = load_model(ck)
    assert meta["model_config"]["openai_gelu"] is True
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    print(f"GPT-2 (gelu_new) import: max |logit difference| = {diff:.3e}")
    assert diff < logits_atol(theirs), diff
    # exact GeLU instead would be a different function: the comparison can fail
    for layer in model.decoder.layers:
        layer.mlp.activation = lambda y: torch.nn.functional.gelu(y, approximate="none")
    assert (next_token_logits(model, ids) - theirs).abs().max().item() > 2 * logits_atol(theirs)

    # continue training it with the printed flags, on a small real corpus (the loss must fall)
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in corpus_lines() * 4))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/preprocess_data.py"), "--input", str(data),
                    "--output-prefix", str(tmp_path / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", vocab, "--merge-file", merges, "--append-eod"], check=True, capture_output=True)
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    train = ["--data-path", str(tmp_path / "corpus_text_document"), "--split", "100,0,0", "--seq-length", "32",
             "--micro-batch-size", "8", "--train-iters", "30", "--lr", "3e-3", "--log-interval", "1",
             "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", *tok]
    ft = str(tmp_path / "ft")
    records, proc = run_pretrain(1, flags + train + ["--load", ck, "--finetune", "--save", ft], tmp_path, "ft")
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert "loaded weights from" in proc.stdout and len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses

    # a run without --openai-gelu is a different model: refused, naming the flag
    without = [f for f in flags if f != "--openai-gelu"]
    _, proc = run_pretrain(1, without + train + ["--load", ck, "--finetune"], tmp_path, "bad", check=False)
    assert proc.returncode != 0 and "--openai-gelu is True in the checkpoint and False in this run" in proc.stderr

    # and back to GPT2LMHeadModel, activation gelu_new, same logits as megalite's
    hf_dir = export(ft, tmp_path / "hf_back")
    back = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(back).__name__ == "GPT2LMHeadModel" and back.config.activation_function == "gelu_new"
    ids, theirs = _hf_logits(back, size, 40, seed=1)
    diff = (next_token_logits(load_model(ft)[0], ids) - theirs).abs().max().item()
    assert diff < logits_atol(theirs), diff


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _llama_dir(path, **rope):
    """A random LlamaForCausalLM with rope theta 5e5 and `rope` scaling, saved by the installed
    transformers (in its own config layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layout = (dict(rope_parameters=dict(rope or {"rope_type": "default"}, rope_theta=500000.0)) if TRANSFORMERS_5
              else dict(rope_theta=500000.0, rope_scaling=rope or None))
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, **layout)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _with_layout(src, dst, layout, key="rope_type"):
    """A copy of a Llama directory whose config.json states RoPE in one layout only: "5"
    (rope_parameters) or "4" (rope_theta + rope_scaling, the type under `key`)."""
    shutil.copytree(src, dst)
    raw = json.load(open(os.path.join(dst, "config.json")))
    params = raw.pop("rope_parameters", None) or dict(raw.get("rope_scaling") or {}, rope_theta=raw["rope_theta"])
    raw.pop("rope_theta", None), raw.pop("rope_scaling", None)
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if layout == "5":
        raw["rope_parameters"] = dict(params, rope_type=kind)
    else:
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = dict(params, **{key: kind}) if kind != "default" else None
    json.dump(raw, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_llama3_rope_scaling_imports_in_both_config_layouts(tmp_path, capsys):
    reference = _llama_dir(tmp_path / "hf", **LLAMA3_ROPE)
    ck, flags = _import(tmp_path / "hf", tmp_path / "ck", capsys)
    assert flags[flags.index("--rotary-base") + 1] == "500000.0"
    assert "--use-rope-scaling" in flags and flags[flags.index("--rope-scaling-factor") + 1] == "8.0"
    assert flags[flags.index("--rope-scaling-original-max-position-embeddings") + 1] == "16"
    ids, theirs = _hf_logits(reference, 100, 100)  # beyond original_max_position_embeddings
    model, meta = load_model(ck)
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    print(f"Llama, rope theta 5e5 + llama3 scaling: max |logit difference| = {diff:.3e}")
    assert diff < logits_atol(theirs), diff
    # the scaling matters at these positions: without it the logits differ
    model.rotary = type(model.rotary)(model.config.kv_channels, 1.0, 500000.0)
    assert (next_token_logits(model, ids) - theirs).abs().max().item() > 1e-3

    # the same model written in either transformers layout (4.x: "rope_type" or the older "type") imports the same
    for layout, key in (("5", None), ("4", "rope_type"), ("4", "type")):
        d = _with_layout(tmp_path / "hf", tmp_path / f"hf{layout}_{key}", layout, key)
        assert ("rope_parameters" in json.load(open(os.path.join(d, "config.json")))) == (layout == "5")
        ck2, flags2 = _import(d, tmp_path / f"ck{layout}_{key}", capsys)
        assert flags2 == flags
        assert read_metadata(ck2)["model_config"] == meta["model_config"]

    # exported back: both layouts in config.json, and transformers computes the same
    hf_dir = export(ck, tmp_path / "hf_back", "--no-tokenizer")
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    if TRANSFORMERS_5:
        assert raw["rope_parameters"] == dict(LLAMA3_ROPE, rope_theta=500000.0)
    assert (raw["rope_theta"], raw["rope_scaling"]) == (500000.0, LLAMA3_ROPE)
    back = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert (back(ids).logits - theirs).abs().max().item() < 1e-5


def test_linear_rope_scaling_round_trips(tmp_path, capsys):
    reference = _llama_dir(tmp_path / "hf", rope_type="linear", factor=4.0)
    ck, flags = _import(tmp_path / "hf", tmp_path / "ck", capsys)
    assert flags[flags.index("--rotary-seq-len-interpolation-factor") + 1] == "4.0"
    ids, theirs = _hf_logits(reference, 100, 60)
    assert (next_token_logits(load_model(ck)[0], ids) - theirs).abs().max().item() < logits_atol(theirs)
    raw = json.load(open(os.path.join(export(ck, tmp_path / "back", "--no-tokenizer"), "config.json")))
    assert raw["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# gpt-oss's YaRN (no rounding of the ramp) on a 16-position original context; and DeepSeek's
# mscale / mscale_all_dim, with an attention_factor only --mscale can give
YARN_ROPES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.9, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 1.3},
]


@pytest.mark.parametrize("rope", YARN_ROPES, ids=["gpt-oss", "mscale", "attention-factor"])
def test_yarn_rope_imports_and_exports(rope, tmp_path, capsys):
    reference = _llama_dir(tmp_path / "hf", **rope)
    ck, flags = _import(tmp_path / "hf", tmp_path / "ck", capsys)
    assert flags[flags.index("--position-embedding-type") + 1] == "yarn"
    assert flags[flags.index("--rotary-scaling-factor") + 1] == str(rope["factor"])
    assert flags[flags.index("--yarn-original-max-position-embeddings") + 1] == "16"
    assert ("--no-yarn-correction-range-round-to-int" in flags) == (rope.get("truncate") is False)
    ids, theirs = _hf_logits(reference, 100, 100)  # beyond original_max_position_embeddings
    model, meta = load_model(ck)
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    print(f"Llama with YaRN {rope}: max |logit difference| = {diff:.3e}")
    assert diff < logits_atol(theirs), diff
    assert model.rotary.attention_scaling != 1.0  # the concentration factor is in play
    yarn = model.rotary
    model.rotary = type(yarn)(model.config.kv_channels, 1.0, 500000.0)  # plain RoPE: other logits
    assert (next_token_logits(model, ids) - theirs).abs().max().item() > 1e-3
    model.rotary = yarn
    # the same flags build the same model from scratch
    c = validate_args(parse_args(tiny() + ["--mock-data"] + pretrain_flags(meta["model_config"])))
    assert c.model.yarn() == model.config.yarn()
    # exported back, transformers computes the same, and it imports back to the same megalite model
    hf_dir = export(ck, tmp_path / "hf_back", "--no-tokenizer")
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    assert raw["rope_scaling"]["rope_type"] == "yarn" and raw["rope_scaling"]["factor"] == rope["factor"]
    back = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert (back(ids).logits - theirs).abs().max().item() < 1e-5
    ck2, flags2 = _import(hf_dir, tmp_path / "ck2", capsys)
    assert flags2 == flags and read_metadata(ck2)["model_config"] == meta["model_config"]


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type 'yarn' without "
                                           "rope_scaling.original_max_position_embeddings"),
    ({"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic'"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, "rope_scaling.beta_fast = 32 with rope_type 'linear'"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "without rope_scaling.low_freq_factor"),
])
def test_unrepresentable_rope_is_refused_naming_the_field(rope, message, tmp_path, capsys):
    hf = _llama_dir(tmp_path / "hf")
    raw = json.load(open(tmp_path / "hf" / "config.json"))
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=10000.0, rope_scaling=rope)
    json.dump(raw, open(tmp_path / "hf" / "config.json", "w"))
    del hf
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "megalite does not implement" in err, err
    assert not (tmp_path / "out").exists()


def test_gpt2_reference_vocabulary_exports(tmp_path):
    """The real GPT-2 vocabulary (when the shared copy is present) round-trips through AutoTokenizer."""
    shared = os.environ.get("MEGALITE_SHARED", os.path.join(ROOT, "..", "shared"))
    vocab = os.path.join(shared, "tokenizers", "gpt2-vocab.json")
    merges = os.path.join(shared, "tokenizers", "gpt2-merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        pytest.skip("../shared/tokenizers/gpt2-vocab.json / gpt2-merges.txt not present")
    from megalite.data.tokenizers import GPT2BPETokenizer
    from megalite.checkpoint.hf.tokenizer import SAMPLE_TEXT, export_tokenizer

    ours = GPT2BPETokenizer(vocab, merges)
    export_tokenizer(ours, str(tmp_path))  # checks the ids itself; check again here, independently
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert theirs(SAMPLE_TEXT).input_ids == ours.tokenize(SAMPLE_TEXT)
    assert theirs("Hello world").input_ids == [15496, 995]  # GPT-2's published ids
    assert theirs.eos_token_id == ours.eod == 50256


def test_checkpoints_refuse_another_activation_or_rope_scaling():
    from megalite.checkpoint.native.state import check_model_config
    from megalite.errors import CheckpointError

    scaled = _config(**ROPE, use_rope_scaling=True).to_dict()
    check_model_config(scaled, dict(scaled), "ck")
    for key, value, flag in (("use_rope_scaling", False, "--use-rope-scaling"),
                             ("rope_scaling_factor", 32.0, "--rope-scaling-factor"),
                             ("rope_scaling_original_max_position_embeddings", 4096,
                              "--rope-scaling-original-max-position-embeddings"),
                             ("rotary_seq_len_interpolation_factor", 2.0, "--rotary-seq-len-interpolation-factor")):
        with pytest.raises(CheckpointError, match=f"{flag} is "):
            check_model_config(scaled, dict(scaled, **{key: value}), "ck")
    gpt2 = _config(openai_gelu=True).to_dict()
    with pytest.raises(CheckpointError, match="--openai-gelu is True in the checkpoint and False in this run"):
        check_model_config(gpt2, dict(gpt2, openai_gelu=False), "ck")
    # a checkpoint written before these settings existed is a default (exact GeLU, unscaled) model
    new_keys = ("openai_gelu", "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
                "rotary_seq_len_interpolation_factor")
    for cfg in (_config().to_dict(), _config(**ROPE).to_dict()):
        check_model_config({k: v for k, v in cfg.items() if k not in new_keys}, cfg, "old")


# -- Qwen3 (dense): Llama with --qk-layernorm ------------------------------------------------------
def _randomize(model, seed=0):
    """Weights far from transformers' init (norm weights 1): swapping q_norm and k_norm, or a
    head's channels, would change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.25)
    return model.eval()


def _qwen3_dir(path, **kw):
    """A random Qwen3ForCausalLM saved by the installed transformers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rope = (dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}) if TRANSFORMERS_5
            else dict(rope_theta=5000.0))
    config = Qwen3Config(**dict(dict(vocab_size=100, hidden_size=48, intermediate_size=56, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=64, rms_norm_eps=1e-6, **rope), **kw))
    model = _randomize(Qwen3ForCausalLM(config))
    model.save_pretrained(path)
    return model


QWEN3_CASES = {
    # GQA, head_dim 16 != hidden / heads (12), untied (Qwen3's default)
    "gqa-headdim-untied": dict(),
    # multi-head attention, tied embeddings, head_dim = hidden / heads, Llama 3.1 RoPE scaling
    "mha-tied-llama3": dict(num_key_value_heads=4, head_dim=12, tie_word_embeddings=True,
                            **({"rope_parameters": dict(LLAMA3_ROPE, rope_theta=5000.0)} if TRANSFORMERS_5
                               else {"rope_scaling": LLAMA3_ROPE})),
}


@pytest.mark.parametrize("case", list(QWEN3_CASES))
def test_qwen3_imports_with_equal_logits_and_exports_back(case, tmp_path, capsys):
    from megalite.arguments import parse_config

    reference = _qwen3_dir(tmp_path / "hf", **QWEN3_CASES[case])
    ck, flags = _import(tmp_path / "hf", tmp_path / "ck", capsys)
    ids, theirs = _hf_logits(reference, 100, 40)
    model, meta = load_model(ck)
    diff = (next_token_logits(model, ids) - theirs).abs().max().item()
    print(f"Qwen3 {case} import: max |logit difference| = {diff:.3e}")
    assert diff < logits_atol(theirs), diff
    cfg = meta["model_config"]
    assert cfg["qk_layernorm"] and cfg["kv_channels"] == reference.config.head_dim
    # the q/k norms matter: without them the logits differ
    for layer in model.decoder.layers:
        layer.self_attention.q_layernorm = layer.self_attention.k_layernorm = None
    assert (next_token_logits(model, ids) - theirs).abs().max().item() > 1e-3

    # the printed flags build this very model
    assert "--qk-layernorm" in flags
    run = parse_config(flags + ["--load", ck, "--mock-data", "--seq-length", "64", "--micro-batch-size", "1",
                                "--train-iters", "1", "--lr", "1e-3"], 1, check_files=False)
    for key in ("qk_layernorm", "kv_channels", "num_query_groups", "add_bias_linear", "add_qkv_bias", "swiglu",
                "untie_embeddings_and_output_weights", "use_rope_scaling", "rotary_base", "ffn_hidden_size"):
        assert getattr(run.model, key) == cfg[key], key

    # and back: the same tensors under the same names, a Qwen3ForCausalLM that computes the same
    back = export(ck, tmp_path / "back", "--no-tokenizer")
    from safetensors.torch import load_file
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (tmp_path / "hf", back))
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    raw, raw_back = (json.load(open(os.path.join(d, "config.json"))) for d in (tmp_path / "hf", back))
    for key in ("architectures", "head_dim", "num_key_value_heads", "attention_bias", "tie_word_embeddings",
                "rope_parameters", "rms_norm_eps", "intermediate_size", "use_sliding_window"):
        assert raw_back.get(key) == raw.get(key), key
    loaded = AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, theirs)


@pytest.mark.parametrize("kw", [
    dict(num_query_groups=2, kv_channels=24, untie_embeddings_and_output_weights=True),
    dict(apply_layernorm_1p=True, norm_epsilon=1e-3),  # stored as w - 1: exported as w
], ids=["gqa-headdim-untied", "tied-layernorm-1p"])
def test_qwen3_export_matches_transformers_and_imports_back(kw, tmp_path):
    ck = _random_checkpoint(tmp_path / "ck", _config(**ROPE, add_bias_linear=False, qk_layernorm=True, **kw),
                            random_norms=True)
    diff, hf = max_logit_diff(ck, export(ck, tmp_path / "hf", "--no-tokenizer"))
    print(f"Qwen3 {kw} export: max |logit difference| = {diff:.3e}")
    assert type(hf).__name__ == "Qwen3ForCausalLM" and diff < 1, diff
    back = str(tmp_path / "back")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", back, "--target-tensor-parallel-size", "2"]) == 0
    (_, a), (meta, b) = load_full_state_dict(ck), load_full_state_dict(back)
    assert sorted(a) == sorted(b)
    one = 1.0 if kw.get("apply_layernorm_1p") else 0.0  # the import holds w itself (no --apply-layernorm-1p)
    assert all(torch.equal(a[n] + one if n.endswith("layernorm.weight") else a[n], b[n]) for n in a)
    assert meta["model_config"]["qk_layernorm"] is True


def _qwen3_tp_generate(rank, world_size, root):
    import torch.distributed as dist

    model, _ = load_model(root, tp_group=dist.group.WORLD)
    prompt = [5, 17, 3, 88, 41]
    return generate(model, prompt, 16, greedy=True), generate(model, prompt, 16, greedy=True, use_cache=False)


def test_qwen3_generation_equals_transformers(tmp_path, capsys):
    """Greedy decoding of an imported Qwen3: megalite's with the key/value cache, recomputing, and
    transformers' generate agree token for token; at TP 2 (each rank normalising its own heads) too."""
    from dist_helpers import spawn

    reference = _qwen3_dir(tmp_path / "hf")
    ck, _ = _import(tmp_path / "hf", tmp_path / "ck", capsys, "--target-tensor-parallel-size", "2")
    model, _ = load_model(ck)
    prompt = [5, 17, 3, 88, 41]
    cached = generate(model, prompt, 16, greedy=True)
    assert len(set(cached)) > 4, cached  # not one repeated token: the comparison proves something
    theirs = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert cached == theirs == generate(model, prompt, 16, greedy=True, use_cache=False)
    for tp_cached, tp_recomputed in spawn(_qwen3_tp_generate, 2, ck):
        assert tp_cached == tp_recomputed == theirs


@pytest.mark.parametrize("kw, message", [
    (dict(attention_bias=True), "attention_bias true"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "use_sliding_window"),
])
def test_qwen3_import_refuses_what_megalite_cannot_compute(kw, message, tmp_path, capsys):
    _qwen3_dir(tmp_path / "hf", **kw)
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot import qwen3 model: {message}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
