"""Train a SentencePiece tokenizer on a JSONL corpus, so a run can start from raw text.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix build/tokenizer \\
        --vocab-size 4096 --model-type bpe

writes ``build/tokenizer.model`` (use it with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model build/tokenizer.model``) and ``build/tokenizer.vocab``. Text is streamed to
SentencePiece line by line (no temporary text file). Ids: unk=0, bos=1, eos=2 (the eod used by
``--append-eod``), no pad piece. Newlines are kept as a piece of their own, so detokenize(tokenize(x))
gives back multi-paragraph documents. Existing outputs are refused (nothing is overwritten); bad
input ends with one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.errors import ArgumentParser, InputError, MissingPackage, cli  # noqa: E402

PROG = "tools/train_tokenizer.py"


def get_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="JSONL file(s), optionally .gz")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=4096, help="pieces in the model (at least the 256 byte pieces + specials)")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="fraction of characters covered by pieces, in (0, 1]; rarer ones fall back to bytes")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of this many lines (>= 0; 0: all); bounds memory on big corpora")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help=">= 1")
    args = p.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input {path}: file not found")
    if args.vocab_size < 1:  # too small for the corpus: SentencePiece says so, with the minimum
        p.error(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if not 0 < args.character_coverage <= 1:
        p.error(f"--character-coverage must be in (0, 1], got {args.character_coverage}")
    if args.input_sentence_size < 0:
        p.error(f"--input-sentence-size must be >= 0 (0: all), got {args.input_sentence_size}")
    if args.num_threads < 1:
        p.error(f"--num-threads must be >= 1, got {args.num_threads}")
    for ext in (".model", ".vocab"):
        if os.path.exists(args.model_prefix + ext):
            p.error(f"--model-prefix {args.model_prefix}: {args.model_prefix + ext} already exists; nothing is "
                    f"overwritten: remove it or choose another prefix")
    return args


def iter_lines(paths, keys):
    """Yield the non-empty lines of every document's text: SentencePiece trains on sentences and
    drops any longer than max_sentence_length, so whole documents would be lost."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    doc = json.loads(raw)
                except ValueError as e:
                    raise InputError(f"--input {path} line {lineno}: invalid JSON ({e})") from None
                for key in keys:
                    if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                        raise InputError(f"--input {path} line {lineno}: no string value for key {key!r} (--json-keys)")
                    for line in doc[key].split("\n"):
                        if line.strip():
                            yield line


@cli(PROG)
def main(argv=None):
    args = get_args(argv)
    try:
        import sentencepiece as spm
    except ImportError:
        raise MissingPackage("tools/train_tokenizer.py needs sentencepiece: pip install sentencepiece") from None
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    # written under a temporary prefix and renamed when complete: a failed run leaves nothing
    tmp = f"{args.model_prefix}.tmp-{os.getpid()}"
    input_errors = []
    try:
        _train(spm, args, _recording(iter_lines(args.input, args.json_keys), input_errors), tmp)
        if input_errors:  # SentencePiece ends the input at the error and may still train on the rest
            raise input_errors[0]
        for ext in (".model", ".vocab"):
            os.replace(tmp + ext, args.model_prefix + ext)
    except RuntimeError as e:  # SentencePiece reports bad settings (e.g. vocab too large) this way
        raise (input_errors[0] if input_errors else InputError(f"SentencePiece training failed: {e}")) from None
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
    print(f"wrote {args.model_prefix}.model and {args.model_prefix}.vocab", file=sys.stderr)
    return 0


def _recording(lines, errors: list):
    """`lines`, stopping at the first InputError, which is kept in `errors`: raised inside
    SentencePiece's reader it would come back wrapped in SentencePiece's own RuntimeError."""
    try:
        yield from lines
    except InputError as e:
        errors.append(e)


def _train(spm, args, sentences, model_prefix):
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_prefix=model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=args.num_threads,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # Any unseen character still encodes (as UTF-8 bytes) instead of becoming <unk>.
        byte_fallback=True,
        # Keep text as written: no NFKC rewrite, no whitespace collapsing, and "\n" as a piece,
        # so the model sees (and can generate) paragraph structure.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["\n"],
        minloglevel=2,
    )


if __name__ == "__main__":
    sys.exit(main())
