"""tools/preprocess_data.py end to end (as a subprocess), and the tokenizers it uses."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def run(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(f"preprocess_data failed:\n{p.stderr}")
    return p


def write_jsonl(path, docs):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write((d if isinstance(d, str) else json.dumps(d)) + "\n")


def read(prefix):
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))], ds


NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", 100]


def test_null_tokenizer_two_keys_append_eod(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3", "title": "7"}, {"text": "4 5", "title": "8 9"},
                                        {"text": "", "title": "1"}])
    run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--json-keys", "text", "title",
        "--append-eod", *NULL)
    text, ds = read(tmp_path / "out_text_document")
    # eod = vocab_size (Megatron's NullTokenizer); an empty document stays empty.
    assert text == [[1, 2, 3, 100], [4, 5, 100], []]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]
    assert ds.dtype == np.uint16
    title, _ = read(tmp_path / "out_title_document")
    assert title == [[7, 100], [8, 9, 100], [1, 100]]


def test_workers_keep_order(tmp_path):
    docs = [{"text": " ".join(str((i * 7 + j) % 90) for j in range(i % 13 + 1))} for i in range(1000)]
    write_jsonl(tmp_path / "in.jsonl", docs)
    run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--workers", 2,
        "--log-interval", 300, *NULL)
    got, _ = read(tmp_path / "out_text_document")
    assert got == [[int(x) for x in d["text"].split()] for d in docs]


def test_gz_input(tmp_path):
    write_jsonl(tmp_path / "in.jsonl.gz", [{"text": "3 1"}, {"text": "4"}])
    run("--input", tmp_path / "in.jsonl.gz", "--output-prefix", tmp_path / "out", *NULL)
    assert read(tmp_path / "out_text_document")[0] == [[3, 1], [4]]


@pytest.mark.parametrize("bad", ['{"text": "1 2"', '["1"]', '{"other": "1"}', '{"text": 5}'])
def test_bad_line_is_an_error_and_leaves_no_output(tmp_path, bad):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}, {"text": "2"}, bad, {"text": "3"}])
    p = run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", *NULL, check=False)
    assert p.returncode != 0
    assert "line 3" in p.stderr and "--skip-bad-lines" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no final files, no temporaries


def test_failed_run_keeps_existing_dataset(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", [{"text": "1 2"}, {"text": "3"}])
    run("--input", tmp_path / "good.jsonl", "--output-prefix", tmp_path / "out", *NULL)
    before = {n: (tmp_path / n).read_bytes() for n in ("out_text_document.bin", "out_text_document.idx")}
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "9 9 9"}] * 200 + ["not json"])
    p = run("--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "out", "--workers", 2, *NULL,
            check=False)
    assert p.returncode != 0 and "line 201" in p.stderr
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl", "out_text_document.bin",
                                           "out_text_document.idx"]


def test_skip_bad_lines_counts(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}, "{oops", {"text": "2"}, {"nope": "x"}, "", {"text": "3"}])
    p = run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--skip-bad-lines", *NULL)
    assert "skipped bad lines: 2" in p.stderr and "blank lines: 1" in p.stderr
    assert read(tmp_path / "out_text_document")[0] == [[1], [2], [3]]


def test_missing_tokenizer_file_names_flag(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    p = run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "nope.model", check=False)
    assert p.returncode != 0 and "--tokenizer-model" in p.stderr and "nope.model" in p.stderr


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--vocab-file .*missing.json"):
        build_tokenizer(SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"),
                                        merge_file=str(tmp_path / "m.txt")))
    with pytest.raises(ValueError, match="--merge-file is required"):
        build_tokenizer(SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=__file__, merge_file=None))
    with pytest.raises(ValueError, match="--tokenizer-type 'Foo'"):
        build_tokenizer(SimpleNamespace(tokenizer_type="Foo"))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "x")))
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=10))
    assert (tok.vocab_size, tok.eod, tok.tokenize("3 4"), tok.detokenize([3, 4])) == (11, 10, [3, 4], "3 4")


STORIES = [
    "The quick brown fox jumps over the lazy dog.\n\nA second paragraph, with commas; and more words!",
    "Once upon a time there was a small cat. It liked milk. The cat slept all day.",
    "Numbers like 42 and 1234 appear here, and so do ünïcödé letters.",
] * 20


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm  # a dependency of megalite, not optional
    d = tmp_path_factory.mktemp("sp")
    write_jsonl(d / "corpus.jsonl", [{"text": t} for t in STORIES])
    tool = os.path.join(ROOT, "tools", "train_tokenizer.py")
    args = ["--input", d / "corpus.jsonl", "--model-prefix", d / "tok", "--vocab-size", 400, "--num-threads", 1]
    subprocess.run([sys.executable, tool, *map(str, args)], check=True, capture_output=True, cwd=ROOT)
    return str(d / "tok.model"), spm.SentencePieceProcessor(model_file=str(d / "tok.model"))


def test_sentencepiece_ids(tmp_path, sp_model):
    path, sp = sp_model
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in STORIES[:3]])
    run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--tokenizer-type",
        "SentencePieceTokenizer", "--tokenizer-model", path, "--append-eod", "--workers", 2)
    got, ds = read(tmp_path / "out_text_document")
    assert sp.eos_id() == 2 and sp.vocab_size() == 400
    assert got == [sp.encode(t) + [2] for t in STORIES[:3]]
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=path))
    # Newlines and double spaces survive (identity normalisation, "\n" piece).
    assert tok.detokenize(got[0][:-1]) == STORIES[0]


def _tinyshakespeare_paragraphs(n):
    with open(os.path.join(SHARED, "corpora", "tinyshakespeare.txt"), encoding="utf-8") as f:
        return [p for p in f.read().split("\n\n") if p.strip()][:n]


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED, "tokenizers")), reason="../shared/tokenizers absent")
def test_gpt2_bpe_matches_transformers(tmp_path):
    import transformers  # installed by `make test` (.[hf]); only the shared vocabulary may be absent
    vocab = os.path.join(SHARED, "tokenizers", "gpt2-vocab.json")
    merges = os.path.join(SHARED, "tokenizers", "gpt2-merges.txt")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(vocab, hf_dir / "vocab.json")
    shutil.copy(merges, hf_dir / "merges.txt")
    try:  # transformers >= 5 names the files vocab/merges; 4.x names them vocab_file/merges_file
        ref = transformers.GPT2TokenizerFast(vocab=str(hf_dir / "vocab.json"), merges=str(hf_dir / "merges.txt"))
    except TypeError:
        ref = transformers.GPT2TokenizerFast(vocab_file=str(hf_dir / "vocab.json"),
                                             merges_file=str(hf_dir / "merges.txt"))
    assert ref("Hello world")["input_ids"] == [15496, 995]  # the reference itself loaded correctly
    paras = _tinyshakespeare_paragraphs(200) + ["  leading spaces,\ttabs and\nnewlines  ", "émigré café 😀 ’quotes’"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": p} for p in paras])
    run("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", 2)
    got, ds = read(tmp_path / "out_text_document")
    assert len(got) == len(paras)
    for para, ids in zip(paras, got):
        assert ids == ref(para)["input_ids"] + [50256]
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    assert tok.detokenize(got[0][:-1]) == paras[0]
