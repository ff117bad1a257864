"""Tokenize a corpus into Megatron ``.bin/.idx`` datasets, one per JSON key (or Parquet column).

    python tools/preprocess_data.py --input corpus.jsonl[.gz|.zst] --output-prefix out/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 8
    python tools/preprocess_data.py --input train-00000.parquet --json-keys text ...

writes ``out/corpus_text_document.{bin,idx}`` (``_sentence`` with --split-sentences). Flags keep
Megatron-LM's names. Inputs: JSON lines (plain, gzip, or zstandard ``.zst``), or Parquet (the
--json-keys name its columns). Input is streamed (line by line; Parquet by record batches, a row
group at a time), so memory stays flat whatever its size. Documents are tokenized in batches (one
tokenizer call per chunk) across --workers processes and written in input order, so the output is
byte-identical whatever the input format and the worker count. Output is written under temporary
names and renamed into place only after the whole input succeeded: a failed run never leaves a
half-written dataset. An output that already exists is refused (nothing is overwritten). Bad
input ends with one `error:` line and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import gzip
import io
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype  # noqa: E402
from megalite.arguments.parser import add_config_args, section_from_namespace  # noqa: E402
from megalite.config import TokenizerConfig  # noqa: E402
from megalite.data.tokenizers import build_tokenizer  # noqa: E402
from megalite.errors import ArgumentParser, InputError, UserError, cli  # noqa: E402

PROG = "tools/preprocess_data.py"

# a task for a worker: up to this many documents or bytes, enough to amortise the IPC and the
# tokenizer call, small enough to keep every worker busy and memory flat
_CHUNK_DOCS, _CHUNK_BYTES = 1024, 1 << 20


def input_format(path: str) -> str:
    """"parquet", "zstd", "gzip" or "jsonl", from the file name."""
    name = path.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    if name.endswith(".gz"):
        return "gzip"
    return "jsonl"


def get_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="JSON lines (one document per line; .jsonl, .jsonl.gz, .jsonl.zst) or a Parquet file")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys (Parquet: columns) to extract; one dataset per key")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines / rows missing a key (counted in the summary) "
                        "instead of stopping with an error")
    g.add_argument("--split-sentences", action="store_true",
                   help="split documents into sentences with nltk's punkt (needs nltk and its punkt_tab data)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="--split-sentences: keep the whitespace and newlines between sentences")
    g.add_argument("--lang", default="english", help="--split-sentences: punkt's language")
    add_config_args(p, TokenizerConfig, "tokenizer", "tokenizer (--tokenizer-type is required)")
    g = p.add_argument_group("documents")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents")
    args = p.parse_args(argv)
    args.tokenizer = section_from_namespace(args, TokenizerConfig, "tokenizer")
    if args.tokenizer.tokenizer_type is None:
        p.error("the following arguments are required: --tokenizer-type")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        p.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: file not found")
    if args.keep_newlines and not args.split_sentences:
        p.error("--keep-newlines applies to --split-sentences only")
    level = "sentence" if args.split_sentences else "document"
    for key in args.json_keys:
        for ext in (".bin", ".idx"):
            path = f"{args.output_prefix}_{key}_{level}{ext}"
            if os.path.exists(path):
                p.error(f"--output-prefix {args.output_prefix}: {path} already exists; nothing is overwritten: "
                        f"remove it or choose another prefix")
    return args


# ---- sentence splitting -------------------------------------------------------------------------

def sentence_splitter(lang: str, keep_newlines: bool):
    """text -> list of sentences, with nltk's punkt (Kiss & Strunk 2006), as Megatron-LM's
    --split-sentences. Raises SystemExit with one line naming what is missing."""
    try:
        from nltk.tokenize.punkt import PunktTokenizer
    except ImportError:
        raise SystemExit("error: --split-sentences needs the nltk package (pip install nltk)") from None
    try:
        punkt = PunktTokenizer(lang)
    except LookupError:
        raise SystemExit(f"error: --split-sentences needs nltk's punkt_tab data for {lang!r} "
                         "(python -m nltk.downloader punkt_tab)") from None
    if not keep_newlines:
        return punkt.tokenize

    def split(text: str) -> list[str]:
        # each sentence runs to the start of the next, so the whitespace between stays with it
        starts = [s for s, _ in punkt.span_tokenize(text)]
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    return split


# ---- worker side: each process builds its own tokenizer once -----------------------------------

_worker = {}


def _init_worker(args, dtype, tokenizer=None):
    # The worker processes are the parallelism: the tokenizers' own thread pools would only compete.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=tokenizer or build_tokenizer(args.tokenizer), keys=args.json_keys, append_eod=args.append_eod, dtype=dtype,
                   split=sentence_splitter(args.lang, args.keep_newlines) if args.split_sentences else None)


_scan_json = json.JSONDecoder().scan_once
_JSON_SPACE = " \t\n\r"


def _parse_json(raw: bytes):
    """json.loads(raw), without its per-call overhead (encoding detection, two regex matches), which
    costs more than the parsing on short documents; anything unusual takes json.loads itself."""
    try:
        line = raw.decode("utf-8")
        stripped = line.lstrip(_JSON_SPACE)
        doc, end = _scan_json(stripped, 0)
        if not stripped[end:].strip(_JSON_SPACE):
            return doc
    except (UnicodeDecodeError, ValueError, StopIteration):
        pass
    return json.loads(raw)  # the reference behaviour, and its error message


def _check_json(raw: bytes, keys):
    """A JSON line -> (the document's texts by key, None) or (None, what is wrong with it)."""
    try:
        doc = _parse_json(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"invalid JSON ({e})"
    try:  # the common case, cheaply; the checks below name what is wrong
        texts = [doc[k] for k in keys]
        if type(doc) is dict and all(type(t) is str for t in texts):
            return texts, None
    except (KeyError, TypeError, IndexError):
        pass
    if not isinstance(doc, dict):
        return None, f"expected a JSON object, got {type(doc).__name__}"
    missing = [k for k in keys if k not in doc]
    if missing:
        return None, f"missing key(s) {missing} (--json-keys {' '.join(keys)})"
    bad = [k for k in keys if not isinstance(doc[k], str)]
    if bad:
        return None, f"value of key(s) {bad} is not a string"
    return [doc[k] for k in keys], None


def _check_row(values, keys):
    bad = [k for k, v in zip(keys, values) if not isinstance(v, str)]
    if bad:
        kinds = ", ".join("null" if v is None else type(v).__name__ for k, v in zip(keys, values) if k in bad)
        return None, f"value of column(s) {bad} is not a string ({kinds})"
    return list(values), None


def _encode_chunk(chunk):
    """A chunk of records -> (numbers, bytes, errors, {key: (tokens, sequence lengths, sequences per
    document)}) for its good documents, tokenized with one call per key."""
    kind, numbers, payload, nbytes = chunk
    tok, keys, split, dtype = _worker["tokenizer"], _worker["keys"], _worker["split"], _worker["dtype"]
    if kind == "json":
        checked = [_check_json(raw, keys) for raw in payload]
        nbytes = sum(map(len, payload))
    elif all(type(v) is str for column in payload for v in column):  # "rows": values by column
        checked = [(list(values), None) for values in zip(*payload)]
    else:
        checked = [_check_row(values, keys) for values in zip(*payload)]
    errors = [err for _, err in checked]
    good = [texts for texts, err in checked if err is None]
    encoded = {}
    for j, key in enumerate(keys):
        texts = [texts[j] for texts in good]
        if split is None:
            docs = [[ids] for ids in tok.tokenize_batch(texts)]
        else:
            sentences = [split(t) for t in texts]
            flat = iter(tok.tokenize_batch(list(itertools.chain.from_iterable(sentences))))
            # Megatron keeps a document's non-empty sentences only
            docs = [[ids for ids in itertools.islice(flat, len(s)) if ids] for s in sentences]
        if _worker["append_eod"]:
            for doc in docs:
                # Megatron appends eod only to non-empty documents; an empty one stays empty.
                if doc and doc[-1]:
                    doc[-1].append(tok.eod)
        seqs = list(itertools.chain.from_iterable(docs))
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
            raise ValueError(f"token ids [{tokens.min()}, {tokens.max()}] do not fit {np.dtype(dtype).name}")
        per_doc = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        encoded[key] = (tokens.astype(dtype), lengths, per_doc)
    return numbers, nbytes, errors, encoded


# ---- main process: read, dispatch in order, write ---------------------------------------------

def _open_lines(path: str, fmt: str):
    raw = open(path, "rb")
    if fmt == "gzip":
        return gzip.open(raw, "rb")
    if fmt == "zstd":
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise SystemExit(f"error: --input {path}: reading .zst needs the zstandard package "
                             "(pip install zstandard)") from None
        # read_across_frames: files written by parallel compressors hold many frames
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return raw


def _json_chunks(path: str, fmt: str, stats: dict):
    """Chunks of raw JSON lines with their 1-based line numbers; blank lines counted and dropped."""
    numbers, lines, size = [], [], 0
    with _open_lines(path, fmt) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                stats["blank"] += 1
                continue
            numbers.append(lineno)
            lines.append(raw)
            size += len(raw)
            if len(lines) == _CHUNK_DOCS or size >= _CHUNK_BYTES:
                yield "json", numbers, lines, None
                numbers, lines, size = [], [], 0
    if lines:
        yield "json", numbers, lines, None


def _parquet_chunks(path: str, keys: list[str]):
    """Chunks of rows (values per column) with their 1-based row numbers, a record batch at a time."""
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"error: --input {path}: reading Parquet needs the pyarrow package (pip install pyarrow)") \
            from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise SystemExit(f"error: --input {path}: no column(s) {missing} (--json-keys {' '.join(keys)}); "
                         f"its columns are {names}")
    row = 1
    for batch in pf.iter_batches(batch_size=_CHUNK_DOCS, columns=keys):
        columns = [batch.column(k).to_pylist() for k in keys]
        nbytes = sum(int(pc.sum(pc.binary_length(batch.column(k))).as_py() or 0)
                     for k in keys if pa_is_text(batch.column(k).type))
        yield "rows", list(range(row, row + batch.num_rows)), columns, nbytes
        row += batch.num_rows


def pa_is_text(t) -> bool:
    import pyarrow as pa
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _read_errors() -> tuple:
    """What a corrupt or truncated input raises while it is read: gzip (EOFError, BadGzipFile,
    zlib.error), zstandard (ZstdError), pyarrow (ArrowException; ArrowInvalid is a ValueError)."""
    kinds = [EOFError, OSError, zlib.error, ValueError]
    for module, name in (("zstandard", "ZstdError"), ("pyarrow", "ArrowException")):
        try:
            kinds.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(kinds)


def _chunks(args, stats, throttle=None, stop=None):
    """The input's chunks, streamed. ``throttle`` bounds the chunks in flight: Pool.imap reads its
    input eagerly, so without it a large file would be pulled into the task queue faster than the
    workers tokenize it. A file that cannot be decompressed or parsed ends the run with one line
    naming it (an InputError: Pool.imap hands an exception of its input on to the reader)."""
    fmt = input_format(args.input)
    source = _parquet_chunks(args.input, args.json_keys) if fmt == "parquet" else _json_chunks(args.input, fmt, stats)
    try:
        for chunk in source:
            if throttle is not None:
                throttle.acquire()
                if stop.is_set():
                    return
            yield chunk
    except UserError:
        raise
    except _read_errors() as e:
        raise InputError(f"--input {args.input}: cannot be read as {fmt} ({type(e).__name__}: {e}); is it corrupt "
                         f"or truncated?") from None


def _results(args, stats, dtype, tokenizer):
    if args.workers == 1:
        _init_worker(args, dtype, tokenizer)
        for chunk in _chunks(args, stats):
            yield _encode_chunk(chunk)
        return
    throttle, stop = threading.Semaphore(4 * args.workers), threading.Event()
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args, dtype)) as pool:
        try:
            for result in pool.imap(_encode_chunk, _chunks(args, stats, throttle, stop)):
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
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # --workers is the parallelism, in every process
    tokenizer = build_tokenizer(args.tokenizer)  # fail fast on bad tokenizer flags, before any worker starts
    if args.split_sentences:
        sentence_splitter(args.lang, args.keep_newlines)  # likewise: a missing nltk or punkt stops here
    dtype = best_dtype(tokenizer.vocab_size)
    fmt = input_format(args.input)
    unit = "row" if fmt == "parquet" else "line"
    print(f"> {args.input}: {fmt}; {tokenizer.name}"
          f"{' (' + tokenizer.backend + ')' if hasattr(tokenizer, 'backend') else ''}; {args.workers} worker(s)",
          file=sys.stderr, flush=True)

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    level = "sentence" if args.split_sentences else "document"
    finals, temps, builders = {}, {}, {}
    for key in args.json_keys:
        final = f"{args.output_prefix}_{key}_{level}"
        tmp = f"{final}.tmp-{os.getpid()}"
        finals[key], temps[key] = final, tmp
        builders[key] = IndexedDatasetBuilder(tmp + ".bin", dtype)

    stats = {"blank": 0, "skipped": 0, "docs": 0, "bytes": 0, "tokens": 0}
    start = time.time()
    next_log = args.log_interval
    ok = False
    results = _results(args, stats, dtype, tokenizer)
    try:
        for numbers, nbytes, errors, encoded in results:
            stats["bytes"] += nbytes
            for number, err in zip(numbers, errors):
                if err is not None:
                    if not args.skip_bad_lines:
                        raise SystemExit(f"error: {args.input} {unit} {number}: {err} "
                                         f"(pass --skip-bad-lines to skip such {unit}s)")
                    stats["skipped"] += 1
            for key in args.json_keys:
                tokens, lengths, per_doc = encoded[key]
                builders[key].add_documents(tokens, lengths, per_doc)
                stats["tokens"] += tokens.size
            stats["docs"] += len(encoded[args.json_keys[0]][2])
            if stats["docs"] >= next_log:
                next_log += args.log_interval * ((stats["docs"] - next_log) // args.log_interval + 1)
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
          f"{stats['bytes'] / el / 1e6:.2f} MB/s); skipped bad {unit}s: {stats['skipped']}; "
          f"blank lines: {stats['blank']}", file=sys.stderr)
    for key in args.json_keys:
        print(f"wrote {finals[key]}.bin / .idx", file=sys.stderr)
    return stats


if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)  # main returns its statistics on success
