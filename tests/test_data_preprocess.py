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
SHARED = os.environ.get("MEGALITE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
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
    # an existing output is refused up front (nothing is overwritten) ...
    p = run("--input", tmp_path / "good.jsonl", "--output-prefix", tmp_path / "out", *NULL, check=False)
    assert p.returncode == 2 and "out_text_document.bin already exists" in p.stderr
    # ... and a run that fails half-way beside it leaves no file of its own
    p = run("--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "other", "--workers", 2, *NULL,
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
    try:
        import tiktoken  # noqa: F401
        assert tok.backend == "tiktoken"  # so the ids above were tiktoken's
    except ImportError:
        assert tok.backend == "tokenizers"
    tok._tiktoken = None  # the tokenizers library's batch path gives the same ids
    assert tok.tokenize_batch(paras) == [ids[:-1] for ids in got]
    assert tok.detokenize(got[0][:-1]) == paras[0]


# ---- input formats, batching and workers: the same bytes whatever the input ------------------

FORMAT_DOCS = [{"text": f"{i % 97} {(i * 7) % 89} " * (i % 5 + 1) + str(i % 50), "id": i} for i in range(2500)]
SP_TEXTS = [{"text": STORIES[i % 3] + f" ({i})", "id": i} for i in range(1500)]


def write_input(path, docs, fmt):
    """`docs` as `fmt`: jsonl (with a blank line, which is dropped), jsonl.gz, jsonl.zst (two zstd
    frames, as parallel compressors write) or parquet (several row groups)."""
    lines = [json.dumps(d, ensure_ascii=False) + "\n" for d in docs]
    if fmt == "jsonl":
        path.write_text("".join(lines[:10]) + "\n" + "".join(lines[10:]), encoding="utf-8")
    elif fmt == "jsonl.gz":
        write_jsonl(path, docs)
    elif fmt == "jsonl.zst":
        zstd = pytest.importorskip("zstandard")
        half = len(lines) // 2
        with open(path, "wb") as f:
            for part in (lines[:half], lines[half:]):
                f.write(zstd.ZstdCompressor().compress("".join(part).encode("utf-8")))
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"id": [d["id"] for d in docs], "text": [d["text"] for d in docs]}), path,
                       row_group_size=700)
    return path


def output_bytes(prefix):
    return tuple(open(f"{prefix}_text_document{ext}", "rb").read() for ext in (".bin", ".idx"))


@pytest.mark.parametrize("tokenizer", ["null", "sentencepiece"])
def test_formats_and_workers_give_identical_bytes(tmp_path, tokenizer, request):
    if tokenizer == "null":
        docs, tok = FORMAT_DOCS, NULL
    else:
        docs, tok = SP_TEXTS, ["--tokenizer-type", "SentencePieceTokenizer",
                               "--tokenizer-model", request.getfixturevalue("sp_model")[0]]
    reference = None
    for fmt in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet"):
        src = write_input(tmp_path / f"in.{fmt}", docs, fmt)
        for workers in (1, 2):
            prefix = tmp_path / f"out_{fmt}_{workers}"
            p = run("--input", src, "--output-prefix", prefix, "--append-eod", "--workers", workers, *tok)
            assert f"done: {len(docs)} documents" in p.stderr
            got = output_bytes(prefix)
            if reference is None:
                reference = got
                ids, _ = read(f"{prefix}_text_document")
                assert len(ids) == len(docs) and ids[5][-1] == (100 if tokenizer == "null" else 2)
            assert got == reference, (fmt, workers)


def test_parquet_errors_name_the_row_and_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["1 2", None, "3"], "n": [1, 2, 3]}), tmp_path / "in.parquet")
    p = run("--input", tmp_path / "in.parquet", "--output-prefix", tmp_path / "out", *NULL, check=False)
    assert p.returncode != 0 and "row 2: value of column(s) ['text'] is not a string (null)" in p.stderr
    assert "--skip-bad-lines" in p.stderr and not (tmp_path / "out_text_document.bin").exists()
    p = run("--input", tmp_path / "in.parquet", "--output-prefix", tmp_path / "out", "--skip-bad-lines", *NULL)
    assert "skipped bad rows: 1" in p.stderr
    assert read(tmp_path / "out_text_document")[0] == [[1, 2], [3]]
    p = run("--input", tmp_path / "in.parquet", "--output-prefix", tmp_path / "out", "--json-keys", "body", *NULL,
            check=False)
    assert p.returncode != 0 and "no column(s) ['body'] (--json-keys body); its columns are ['text', 'n']" in p.stderr


def test_add_documents_writes_what_add_document_writes(tmp_path):
    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    docs = [([1, 2, 3], [2, 1]), ([], None), ([4], None), ([5, 6, 7, 8], [1, 3])]
    one = IndexedDatasetBuilder(str(tmp_path / "one.bin"), np.uint16)
    for tokens, lengths in docs:
        one.add_document(np.array(tokens, dtype=np.int64), lengths)
    one.finalize(str(tmp_path / "one.idx"))
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), np.uint16)
    bulk.add_documents(np.array([1, 2, 3], dtype=np.int64), [2, 1], [2])
    bulk.add_documents(np.array([0, 4, 5, 6, 7, 8], dtype=np.int64)[1:], [0, 1, 1, 3], [1, 1, 2])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"one.{ext}").read_bytes() == (tmp_path / f"bulk.{ext}").read_bytes()
    with pytest.raises(ValueError, match="inconsistent"):
        bulk.add_documents(np.arange(3), [1, 1], [2])


# ---- --split-sentences: nltk's punkt data cannot be fetched offline, so a stub nltk stands in ----

STUB_PUNKT = '''
class PunktTokenizer:
    """Stand-in for nltk's punkt: sentences end at "|" (NullTokenizer text has no periods)."""
    def __init__(self, lang="english"):
        if lang != "english":
            raise LookupError(f"Resource punkt_tab/{lang} not found")

    def span_tokenize(self, text):
        start = 0
        for part in text.split("|"):
            a, b = start + len(part) - len(part.lstrip()), start + len(part.rstrip())
            if b > a:
                yield a, b
            start += len(part) + 1

    def tokenize(self, text):
        return [text[a:b] for a, b in self.span_tokenize(text)]
'''


def stub_nltk(root, body=STUB_PUNKT, init=""):
    pkg = root / "nltk"
    (pkg / "tokenize").mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "tokenize" / "__init__.py").write_text("")
    (pkg / "tokenize" / "punkt.py").write_text(body)
    return str(root)


def run_with(pythonpath, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([pythonpath, ROOT]))
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)


def test_split_sentences_with_a_stub_punkt(tmp_path):
    stub = stub_nltk(tmp_path / "stub")
    docs = [{"text": "1 2 | 3 4 5 | 6"}, {"text": "7"}, {"text": ""}, {"text": "8 | | 9 |"}] * 600
    write_jsonl(tmp_path / "in.jsonl", docs)
    outs = []
    for workers in (1, 2):
        prefix = tmp_path / f"out{workers}"
        p = run_with(stub, "--input", tmp_path / "in.jsonl", "--output-prefix", prefix, "--split-sentences",
                     "--append-eod", "--workers", workers, *NULL)
        assert p.returncode == 0, p.stderr
        ds = IndexedDataset(str(prefix) + "_text_sentence")
        outs.append(open(str(prefix) + "_text_sentence.bin", "rb").read())
    assert outs[0] == outs[1]
    # sentences are the sequences, documents group them; eod ends each document's last sentence
    seqs = [ds[i].tolist() for i in range(8)]
    assert seqs == [[1, 2], [3, 4, 5], [6, 100], [7, 100], [8], [9, 100], [1, 2], [3, 4, 5]]
    assert ds.document_indices[:6].tolist() == [0, 3, 4, 4, 6, 9]  # the empty document has no sentence


def test_split_sentences_names_what_is_missing(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "1 | 2"}])
    args = ("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out", "--split-sentences", *NULL)
    no_nltk = stub_nltk(tmp_path / "none", init="raise ImportError('No module named nltk')\n")
    p = run_with(no_nltk, *args)
    assert p.returncode != 0
    assert p.stderr.strip() == "error: --split-sentences needs the nltk package (pip install nltk)"
    p = run_with(stub_nltk(tmp_path / "nodata"), *args, "--lang", "klingon")
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == ("error: --split-sentences needs nltk's punkt_tab data for "
                                                 "'klingon' (python -m nltk.downloader punkt_tab)")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "nodata", "none"]


def test_gpt2_bpe_with_its_own_merge_order_keeps_the_tokenizers_library(tmp_path):
    """A byte-level BPE whose ids are not in merge order (special token first, as trainers write)
    cannot be run by tiktoken (it merges by id): the tokenizers library encodes it, in batches."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(STORIES, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(tmp_path), "t")
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "t-vocab.json"),
                                          merge_file=str(tmp_path / "t-merges.txt")))
    assert tok.backend == "tokenizers"
    texts = STORIES[:3] + ["", "  x"]
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts] == [bpe.encode(t).ids for t in texts]
