"""Greedy generation with and without the key/value cache, on CPU (numbers go to docs/checkpoints.md,
"Generating text").

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py [--new-tokens 256] [--layers 4 --hidden 256 ...]

A randomly initialised GPT-2 style model (weights do not change the cost); the same prompt is
continued by megalite.generation.generate with use_cache=True and False, and the two must give
the same tokens. Prints tokens/s of each and the speed-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.generation import generate  # noqa: E402
from megalite.model import GPTConfig, GPTModel, pad_vocab_size  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rope", action="store_true", help="a Llama style model (RoPE, RMSNorm, SwiGLU) instead")
    args = p.parse_args()
    positions = args.prompt_tokens + args.new_tokens
    extra = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True) if args.rope else {}
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       vocab_size=args.vocab, padded_vocab_size=pad_vocab_size(args.vocab, 128, 1),
                       seq_length=positions, max_position_embeddings=positions, hidden_dropout=0.0,
                       attention_dropout=0.0, init_method_std=0.3, **extra)
    model = GPTModel(config)
    model.initialize(1)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, args.vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); model: {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads, vocab {args.vocab}, {n_params / 1e6:.1f}M parameters"
          f"{', RoPE' if args.rope else ''}; prompt {args.prompt_tokens} tokens, {args.new_tokens} new (greedy)")
    generate(model, prompt, 4, greedy=True)  # warm-up
    out, rate = {}, {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        out[use_cache] = generate(model, prompt, args.new_tokens, greedy=True, use_cache=use_cache)
        elapsed = time.perf_counter() - t0
        rate[use_cache] = len(out[use_cache]) / elapsed
        print(f"  key/value cache {'on ' if use_cache else 'off'}: {elapsed:7.2f} s, {rate[use_cache]:7.1f} tokens/s")
    assert out[True] == out[False], "cached and recomputed generation differ"
    print(f"  same tokens: True; speed-up {rate[True] / rate[False]:.1f}x")


if __name__ == "__main__":
    main()
