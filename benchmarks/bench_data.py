"""Data pipeline benchmarks (numbers go to benchmarks/RESULTS_data.md; tests never assert times).

    python benchmarks/bench_data.py [--skip-index] [--skip-preprocess]

(a) GPTDataset index build on a synthetic corpus of 1M documents / ~1B tokens. Only the .idx is
    real; the .bin is a sparse file of the right size (ftruncate), so it costs no disk time.
(b) tools/preprocess_data.py throughput with GPT2BPETokenizer on a >= 100 MB corpus built from
    ../shared/corpora/tinyshakespeare.txt (one paragraph per JSONL document, repeated with
    variations), the tool at --baseline-rev (checked out from git with its library) and the
    current one back to back, at each worker count; the outputs must be byte-identical. Skipped
    when ../shared is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("MEGALITE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
sys.path.insert(0, ROOT)

from megalite.data.gpt_dataset import GPTDataset  # noqa: E402
from megalite.data.indexed_dataset import IndexedDataset, write_index  # noqa: E402


def bench_index(tmp, num_docs=1_000_000, seq_length=2048, num_samples=1_000_000):
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 2000, size=num_docs).astype(np.int64)  # mean ~1000 -> ~1B tokens
    prefix = os.path.join(tmp, "synthetic")
    t0 = time.perf_counter()
    write_index(prefix + ".idx", np.uint16, lengths, np.arange(num_docs + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 2)  # sparse: no data written
    t_write = time.perf_counter() - t0
    idx = IndexedDataset(prefix)
    cache = os.path.join(tmp, "cache")
    t0 = time.perf_counter()
    ds = GPTDataset(idx, 0, num_docs, num_samples, seq_length, 1234, cache)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ds2 = GPTDataset(IndexedDataset(prefix), 0, num_docs, num_samples, seq_length, 1234, cache)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in np.random.RandomState(1).randint(0, len(ds2), size=2000):
        ds2[int(i)]
    t_get = (time.perf_counter() - t0) / 2000
    print(f"(a) {num_docs} docs, {int(lengths.sum())} tokens/epoch, seq_length {seq_length}, "
          f"num_samples {num_samples} -> {len(ds)} samples, {len(ds.document_index) // num_docs} epochs")
    print(f"    synthetic .idx write {t_write:.2f} s | index build (cold, incl. save) {t_build:.2f} s | "
          f"load from cache {t_load * 1e3:.1f} ms | ds[i] {t_get * 1e6:.0f} us/sample "
          f"(first touches of a sparse file: page-fault bound, not representative)")


def bench_getitem(tmp, prefix=os.path.join(ROOT, "data", "build", "corpus_text_document"), seq_length=1024):
    if not os.path.isfile(prefix + ".idx"):
        print("(c) skipped: run data/prepare.sh first")
        return
    idx = IndexedDataset(prefix)
    ds = GPTDataset(idx, 0, len(idx), 100_000, seq_length, 1234, os.path.join(tmp, "cache_c"))
    ds[0]
    t0 = time.perf_counter()
    for i in np.random.RandomState(1).randint(0, len(ds), size=5000):
        ds[int(i)]
    t_get = (time.perf_counter() - t0) / 5000
    print(f"(c) ds[i] on the bundled corpus (page cache warm), seq_length {seq_length}: {t_get * 1e6:.0f} us/sample")


def build_corpus(path, min_mb):
    """tinyshakespeare repeated with variations until the JSONL holds at least `min_mb` MB: each
    pass shuffles the paragraphs (seeded) and rewrites them one way (case changes, accented vowels,
    words reversed per line, numbered lines), so the tokenizer sees more than one copy of each word."""
    import random

    with open(os.path.join(SHARED, "corpora", "tinyshakespeare.txt"), encoding="utf-8") as f:
        paras = [p for p in f.read().split("\n\n") if p.strip()]
    variants = [lambda p: p, str.upper, str.lower, str.swapcase,
                lambda p: p.translate(str.maketrans("aeiou", "àéîõü")),
                lambda p: "\n".join(" ".join(reversed(ln.split(" "))) for ln in p.split("\n")),
                lambda p: "\n".join(f"{i}. {ln}" for i, ln in enumerate(p.split("\n"), 1))]
    size, r = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while size < min_mb * 1e6:
            order = list(paras)
            random.Random(r).shuffle(order)
            for p in order:
                line = json.dumps({"text": variants[r % len(variants)](p)}, ensure_ascii=False) + "\n"
                out.write(line)
                size += len(line.encode("utf-8"))
            r += 1
    return size, r


def bench_preprocess(tmp, workers, baseline_rev, min_mb, formats):
    vocab = os.path.join(SHARED, "tokenizers", "gpt2-vocab.json")
    merges = os.path.join(SHARED, "tokenizers", "gpt2-merges.txt")
    if not all(os.path.isfile(p) for p in (os.path.join(SHARED, "corpora", "tinyshakespeare.txt"), vocab, merges)):
        print("(b) skipped: ../shared corpora/tokenizers not found")
        return
    jsonl = os.path.join(tmp, "corpus.jsonl")
    size, passes = build_corpus(jsonl, min_mb)
    print(f"(b) corpus: tinyshakespeare x {passes} passes with variations, {size / 1e6:.1f} MB of JSONL")
    # the baseline: the tool *and* the library as they were at baseline_rev, from git
    base = os.path.join(tmp, "baseline")
    os.makedirs(base)
    archive = subprocess.run(["git", "-C", ROOT, "archive", baseline_rev, "megalite", "tools"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
    tools = {"baseline": os.path.join(base, "tools", "preprocess_data.py"),
             "new": os.path.join(ROOT, "tools", "preprocess_data.py")}
    inputs = {"jsonl": jsonl}
    if "parquet" in formats:
        import pyarrow as pa
        import pyarrow.parquet as pq
        with open(jsonl, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        inputs["parquet"] = os.path.join(tmp, "corpus.parquet")
        pq.write_table(pa.table({"text": texts}), inputs["parquet"], row_group_size=50_000)
        del texts
    if "zst" in formats:
        import zstandard
        inputs["zst"] = jsonl + ".zst"
        with open(jsonl, "rb") as src, open(inputs["zst"], "wb") as dst:
            zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
    runs = [(w, "baseline", "jsonl") for w in workers]
    runs += [(w, "new", fmt) for w in workers for fmt in inputs]
    results, outputs = {}, {}
    for w, which, fmt in sorted(runs, key=lambda r: (r[0], r[2], r[1])):  # old and new back to back
        prefix = os.path.join(tmp, f"{which}_{fmt}_{w}")
        cmd = [sys.executable, tools[which], "--input", inputs[fmt], "--output-prefix", prefix,
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
               "--workers", str(w), "--log-interval", "1000000000"]
        env = dict(os.environ, PYTHONPATH=base if which == "baseline" else ROOT, OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        wall = time.perf_counter() - t0
        done = [ln for ln in p.stderr.splitlines() if ln.startswith("done:")][0]
        mbs = float(re.search(r"([\d.]+) MB/s\)", done).group(1))
        results[(w, which, fmt)] = (mbs, wall)
        with open(prefix + "_text_document.bin", "rb") as f1, open(prefix + "_text_document.idx", "rb") as f2:
            outputs[(w, which, fmt)] = (hash(f1.read()), hash(f2.read()))
        for ext in (".bin", ".idx"):
            os.remove(prefix + "_text_document" + ext)
        print(f"    {which:8s} {fmt:7s} workers={w}: {mbs:6.2f} MB/s in the tokenize loop, {wall:6.1f} s wall "
              f"({size / wall / 1e6:.2f} MB/s incl. start-up)", flush=True)
    same = len(set(outputs.values())) == 1
    print(f"    outputs byte-identical across tools, formats and worker counts: {same}")
    for w in workers:
        old, new = results[(w, "baseline", "jsonl")][0], results[(w, "new", "jsonl")][0]
        print(f"    workers={w}: new/baseline = {new / old:.2f}x ({new / w:.2f} MB/s per worker)")
    if not same:
        raise SystemExit("outputs differ")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--baseline-rev", default="057264b", help="git revision of the preprocessing to compare against")
    p.add_argument("--corpus-mb", type=float, default=100.0, help="(b) corpus size, MB of JSONL")
    p.add_argument("--formats", nargs="*", default=["parquet", "zst"], choices=["parquet", "zst"],
                   help="(b) also time these inputs (the new tool only)")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_index:
            bench_index(tmp)
            bench_getitem(tmp)
        if not args.skip_preprocess:
            bench_preprocess(tmp, args.workers, args.baseline_rev, args.corpus_mb, args.formats)


if __name__ == "__main__":
    main()
