"""Tokenize a JSONL corpus into Megatron ``.bin/.idx`` datasets, one per JSON key.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix out/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 8

writes ``out/corpus_text_document.{bin,idx}``. Flags keep Megatron-LM's names. Input is streamed
(memory stays flat whatever its size) and output is written under temporary names, renamed into
place only after the whole input succeeded, so a failed run never leaves a half-written dataset.
An output that already exists is refused (nothing is overwritten). Bad input ends with one
`error:` line and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype  # noqa: E402
from megalite.data.tokenizers import (TOKENIZER_TYPES, TOKENIZER_TYPES_HELP, add_tiktoken_args,  # noqa: E402
                                      build_tokenizer)
from megalite.errors import ArgumentParser, cli  # noqa: E402

PROG = "tools/preprocess_data.py"

_CHUNK_LINES = 64  # lines per task sent to a worker: large enough to amortise IPC


def get_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file (one document per line), optionally .gz")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one dataset per key")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines / lines missing a key (counted in the summary) "
                        "instead of stopping with an error")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES, help=TOKENIZER_TYPES_HELP)
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file, or HuggingFace tokenizer directory")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    add_tiktoken_args(g)
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        p.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: file not found")
    for key in args.json_keys:
        for ext in (".bin", ".idx"):
            path = f"{args.output_prefix}_{key}_document{ext}"
            if os.path.exists(path):
                p.error(f"--output-prefix {args.output_prefix}: {path} already exists; nothing is overwritten: "
                        f"remove it or choose another prefix")
    return args


# ---- worker side: each process builds its own tokenizer once ---------------------------------

_worker = {}


def _init_worker(args):
    # The Rust tokenizers' own thread pool is pointless inside a process pool and warns after fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker["tokenizer"] = build_tokenizer(args)
    _worker["keys"] = args.json_keys
    _worker["append_eod"] = args.append_eod


def _encode_chunk(chunk):
    """[(line_number, raw_bytes)] -> [(line_number, nbytes, {key: int array} or error string)]."""
    tok, keys, append_eod = _worker["tokenizer"], _worker["keys"], _worker["append_eod"]
    out = []
    for lineno, raw in chunk:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            out.append((lineno, len(raw), f"invalid JSON ({e})"))
            continue
        if not isinstance(doc, dict):
            out.append((lineno, len(raw), f"expected a JSON object, got {type(doc).__name__}"))
            continue
        missing = [k for k in keys if k not in doc]
        if missing:
            out.append((lineno, len(raw), f"missing key(s) {missing} (--json-keys {' '.join(keys)})"))
            continue
        bad = [k for k in keys if not isinstance(doc[k], str)]
        if bad:
            out.append((lineno, len(raw), f"value of key(s) {bad} is not a string"))
            continue
        encoded = {}
        for k in keys:
            ids = tok.tokenize(doc[k])
            # Megatron appends eod only to non-empty documents; an empty one stays empty.
            if append_eod and ids:
                ids.append(tok.eod)
            encoded[k] = np.asarray(ids, dtype=np.int64)
        out.append((lineno, len(raw), encoded))
    return out


# ---- main process -----------------------------------------------------------------------------

def _open_input(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _chunks(path, stats, throttle=None, stop=None):
    """Yield chunks of (line_number, bytes), streaming; blank lines are counted and dropped.

    ``throttle`` bounds the chunks in flight: Pool.imap reads its input eagerly, so without it a
    large file would be pulled into the task queue faster than the workers tokenize it.
    """
    chunk = []
    with _open_input(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                stats["blank"] += 1
                continue
            chunk.append((lineno, raw))
            if len(chunk) == _CHUNK_LINES:
                if throttle is not None:
                    throttle.acquire()
                    if stop.is_set():
                        return
                yield chunk
                chunk = []
    if chunk:
        if throttle is not None:
            throttle.acquire()
            if stop.is_set():
                return
        yield chunk


def _results(args, stats):
    if args.workers == 1:
        _init_worker(args)
        for chunk in _chunks(args.input, stats):
            yield _encode_chunk(chunk)
        return
    throttle, stop = threading.Semaphore(4 * args.workers), threading.Event()
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
        try:
            for result in pool.imap(_encode_chunk, _chunks(args.input, stats, throttle, stop)):
                throttle.release()
                yield result
        finally:
            # On early exit (a bad line), unblock the pool's feeder thread so terminate() can join it.
            stop.set()
            for _ in range(4 * args.workers + 1):
                throttle.release()


@cli(PROG)
def main(argv=None):
    args = get_args(argv)
    tokenizer = build_tokenizer(args)  # fail fast on bad tokenizer flags, before any worker starts
    dtype = best_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    finals, temps, builders = {}, {}, {}
    for key in args.json_keys:
        final = f"{args.output_prefix}_{key}_document"
        tmp = f"{final}.tmp-{os.getpid()}"
        finals[key], temps[key] = final, tmp
        builders[key] = IndexedDatasetBuilder(tmp + ".bin", dtype)

    stats = {"blank": 0, "skipped": 0, "docs": 0, "bytes": 0, "tokens": 0}
    start = time.time()
    ok = False
    results = _results(args, stats)
    try:
        for result in results:
            for lineno, nbytes, encoded in result:
                stats["bytes"] += nbytes
                if isinstance(encoded, str):
                    if not args.skip_bad_lines:
                        raise SystemExit(f"error: {args.input} line {lineno}: {encoded} "
                                         f"(pass --skip-bad-lines to skip such lines)")
                    stats["skipped"] += 1
                    continue
                for key in args.json_keys:
                    builders[key].add_document(encoded[key])
                    stats["tokens"] += encoded[key].size
                stats["docs"] += 1
                if stats["docs"] % args.log_interval == 0:
                    el = max(time.time() - start, 1e-9)
                    print(f"processed {stats['docs']} documents ({stats['docs'] / el:.0f} docs/s, "
                          f"{stats['bytes'] / el / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
        for key in args.json_keys:
            builders[key].finalize(temps[key] + ".idx")
        # Rename only after every output is complete. .bin first: a reader racing the swap sees
        # a size mismatch against the old .idx (a clear error), never silently wrong offsets.
        for key in args.json_keys:
            os.replace(temps[key] + ".bin", finals[key] + ".bin")
            os.replace(temps[key] + ".idx", finals[key] + ".idx")
        ok = True
    finally:
        results.close()
        if not ok:
            for key in args.json_keys:
                builders[key]._file.close()
                for ext in (".bin", ".idx"):
                    if os.path.exists(temps[key] + ext):
                        os.remove(temps[key] + ext)
    el = max(time.time() - start, 1e-9)
    print(f"done: {stats['docs']} documents, {stats['tokens']} tokens ({np.dtype(dtype).name}), "
          f"{stats['bytes'] / 1e6:.2f} MB in {el:.2f} s ({stats['docs'] / el:.0f} docs/s, "
          f"{stats['bytes'] / el / 1e6:.2f} MB/s); skipped bad lines: {stats['skipped']}; "
          f"blank lines: {stats['blank']}", file=sys.stderr)
    for key in args.json_keys:
        print(f"wrote {finals[key]}.bin / .idx", file=sys.stderr)
    return stats


if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)  # main returns its statistics on success
