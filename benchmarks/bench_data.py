"""Data pipeline benchmarks (numbers go to benchmarks/RESULTS_data.md; tests never assert times).

    python benchmarks/bench_data.py [--skip-index] [--skip-preprocess]

(a) GPTDataset index build on a synthetic corpus of 1M documents / ~1B tokens. Only the .idx is
    real; the .bin is a sparse file of the right size (ftruncate), so it costs no disk time.
(b) tools/preprocess_data.py throughput on ../shared/corpora/tinyshakespeare.txt (one paragraph per
    JSONL document) with GPT2BPETokenizer. Skipped when ../shared is absent.
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
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
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


def bench_preprocess(tmp, workers):
    corpus = os.path.join(SHARED, "corpora", "tinyshakespeare.txt")
    vocab = os.path.join(SHARED, "tokenizers", "gpt2-vocab.json")
    merges = os.path.join(SHARED, "tokenizers", "gpt2-merges.txt")
    if not all(os.path.isfile(p) for p in (corpus, vocab, merges)):
        print("(b) skipped: ../shared corpora/tokenizers not found")
        return
    jsonl = os.path.join(tmp, "tinyshakespeare.jsonl")
    with open(corpus, encoding="utf-8") as f, open(jsonl, "w", encoding="utf-8") as out:
        for para in f.read().split("\n\n"):
            if para.strip():
                out.write(json.dumps({"text": para}) + "\n")
    for w in workers:
        cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
               "--output-prefix", os.path.join(tmp, f"ts{w}"), "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(w)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        done = [ln for ln in p.stderr.splitlines() if ln.startswith("done:")][0]
        m = re.search(r"\(([\d.]+) docs/s, ([\d.]+) MB/s\)", done)
        print(f"(b) workers={w}: {done}\n    process wall time incl. start-up {wall:.2f} s "
              f"({m.group(2)} MB/s in the tokenize loop)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_index:
            bench_index(tmp)
            bench_getitem(tmp)
        if not args.skip_preprocess:
            bench_preprocess(tmp, args.workers)


if __name__ == "__main__":
    main()
