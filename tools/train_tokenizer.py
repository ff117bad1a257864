"""Train a SentencePiece tokenizer on a JSONL corpus, so a run can start from raw text.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix build/tokenizer \\
        --vocab-size 4096 --model-type bpe

writes ``build/tokenizer.model`` (use it with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model build/tokenizer.model``) and ``build/tokenizer.vocab``. Text is streamed to
SentencePiece line by line (no temporary text file). Ids: unk=0, bos=1, eos=2 (the eod used by
``--append-eod``), no pad piece. Newlines are kept as a piece of their own, so detokenize(tokenize(x))
gives back multi-paragraph documents.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="JSONL file(s), optionally .gz")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="fraction of characters covered by pieces; rarer ones fall back to bytes")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of this many lines (0: all); bounds memory on big corpora")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input {path}: file not found")
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
                    raise SystemExit(f"error: {path} line {lineno}: invalid JSON ({e})")
                for key in keys:
                    if key not in doc:
                        raise SystemExit(f"error: {path} line {lineno}: missing key {key!r} (--json-keys)")
                    for line in doc[key].split("\n"):
                        if line.strip():
                            yield line


def main(argv=None):
    args = get_args(argv)
    try:
        import sentencepiece as spm
    except ImportError:
        raise SystemExit("error: tools/train_tokenizer.py needs sentencepiece: pip install sentencepiece")
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    try:
        _train(spm, args)
    except RuntimeError as e:  # SentencePiece reports bad settings (e.g. vocab too large) this way
        raise SystemExit(f"error: SentencePiece training failed: {e}")
    print(f"wrote {args.model_prefix}.model and {args.model_prefix}.vocab", file=sys.stderr)


def _train(spm, args):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(args.input, args.json_keys),
        model_prefix=args.model_prefix,
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
    main()
