"""Continue a prompt with a trained checkpoint, on one process or a tensor-parallel group.

    python tools/generate.py --load checkpoints/run1 --prompt "Once upon a time" --max-new-tokens 50 \\
        [--greedy | --temperature 0.8 --top-k 40 --seed 1]
    torchrun --nproc_per_node 2 tools/generate.py --load checkpoints/run1 --prompt "..."   # TP = 2

The tokenizer is the one saved in the checkpoint's arguments (--tokenizer-type, --vocab-file,
--merge-file, --tokenizer-model); give those flags here to override it, or when the run had none
(--mock-data). Prints only the continuation, to stdout (rank 0); stops early at the
end-of-document token. Decoding uses a key/value cache; --no-kv-cache recomputes the whole
sequence for every token (slower, same tokens). Under torchrun every process holds one
tensor-parallel shard of the model (TP = the number of processes), whatever layout it was saved in.
Bad input (a flag, a missing or corrupt checkpoint, a tokenizer that does not fit) ends with one
`error:` line and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments.parser import add_config_args, section_values  # noqa: E402
from megalite.config import TokenizerConfig  # noqa: E402
from megalite.errors import ArgumentParser, UserError, cli  # noqa: E402

PROG = "tools/generate.py"


def get_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (its latest iteration)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (>= 0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores --temperature / --top-k)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (>= 0; 0: all)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (>= 0)")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole sequence for every new token (the reference; slower)")
    add_config_args(p, TokenizerConfig, "tokenizer", "tokenizer (default: as saved in the checkpoint; "
                    "NullTokenizer's --vocab-size: the model's vocabulary - 1, its eod)")
    args = p.parse_args(argv)
    args.tokenizer = section_values(args, "tokenizer")  # the overrides of the saved tokenizer
    # refused here, before the model is loaded
    if args.max_new_tokens < 0:
        p.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.greedy and not args.temperature > 0:
        p.error(f"--temperature must be > 0, got {args.temperature} (use --greedy for argmax decoding)")
    if args.top_k < 0:
        p.error(f"--top-k must be >= 0 (0: no top-k filter), got {args.top_k}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.tokenizer.get("vocab_size") is not None and args.tokenizer["vocab_size"] < 1:
        p.error(f"--vocab-size must be >= 1, got {args.tokenizer['vocab_size']}")
    return args


@cli(PROG)
def main(argv=None) -> int:
    args = get_args(argv)
    import time

    import torch
    import torch.distributed as dist

    from megalite.data.saved_tokenizer import build_tokenizer_for
    from megalite.generation import generate, load_model

    tp_group, rank, tp = None, 0, 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # under torchrun: TP = world
        dist.init_process_group("gloo")
        tp_group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    try:
        with torch.no_grad():  # scoped: main() is also called in-process (tests)
            model, meta = load_model(args.load, tp_group=tp_group)
            tokenizer = build_tokenizer_for(meta, args.tokenizer)
            prompt = tokenizer.tokenize(args.prompt) or [tokenizer.eod]  # as Megatron: an empty prompt starts a document
            if max(prompt) >= model.config.vocab_size:
                raise UserError(f"--prompt gives token id {max(prompt)}, outside the model's vocabulary "
                                f"({model.config.vocab_size})")
            start = time.perf_counter()
            new = generate(model, prompt, args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                           top_k=args.top_k, seed=args.seed, eod=tokenizer.eod, use_cache=args.kv_cache)
            elapsed = time.perf_counter() - start
    finally:
        if tp_group is not None:
            dist.destroy_process_group()
    if rank == 0:
        print(f"> {len(new)} tokens after a {len(prompt)}-token prompt in {elapsed:.2f} s "
              f"({len(new) / max(elapsed, 1e-9):.1f} tokens/s; key/value cache {'on' if args.kv_cache else 'off'}; "
              f"TP {tp})",
              file=sys.stderr)
        if new and new[-1] == tokenizer.eod:
            new = new[:-1]  # the end-of-document token is a stop, not text
        sys.stdout.write(tokenizer.detokenize(new) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
