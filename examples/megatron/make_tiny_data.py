#!/usr/bin/env python3
"""Files the two Megatron-LM flag sets read, made small enough for a CPU: a byte-level BPE trained
on the first documents of the bundled corpus, written as GPT-2 vocab.json + merges.txt (for
GPT2BPETokenizer, the GPT-3 175B script's --vocab-file / --merge-file) and as a Hugging Face
tokenizer directory (for HuggingFaceTokenizer, the Llama-3 8B script's --tokenizer-model), plus the
JSONL those documents come from. tools/preprocess_data.py then makes the datasets.

    python examples/megatron/make_tiny_data.py OUT_DIR [--documents 200] [--vocab-size 512]

Needs the `tokenizers` and `transformers` packages (pip install -e '.[hf]').
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOD = "<|endoftext|>"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--documents", type=int, default=200, help="documents taken from data/corpus.jsonl")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary, <|endoftext|> included")
    args = p.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(args.out, exist_ok=True)
    texts = []
    with open(os.path.join(ROOT, "data", "corpus.jsonl"), encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == args.documents:
                break
    with open(os.path.join(args.out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    # GPT-2's recipe: byte-level pre-tokenisation without a prefix space, BPE merges
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.model.save(args.out)  # vocab.json + merges.txt, GPT-2's format
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, bos_token=EOD).save_pretrained(
        os.path.join(args.out, "hf_tokenizer"))
    print(f"{args.out}: corpus.jsonl ({len(texts)} documents), vocab.json + merges.txt, hf_tokenizer/ "
          f"({tok.get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
