"""Attention activation memory with packed documents (--reset-attention-mask) against plain causal
attention and against the dense [s, s] document mask megalite built before (numbers go to
benchmarks/RESULTS_packed_documents.md; tests never assert on them). Memory only, not time.

    OMP_NUM_THREADS=1 python benchmarks/bench_packed_documents.py [--seq 2048 4096 8192] [--dense-up-to 4096]

One self-attention layer (QKV projection, core attention, output projection; fp32) runs one
forward and backward on a micro-batch built by data.batch.build_batch from tokens with an
end-of-document every ~`--doc-length` tokens (random lengths), each case in a fresh process:

- causal: no --reset-attention-mask; SDPA with is_causal (torch's CPU flash kernel: O(s) memory);
- packed: --reset-attention-mask as now: the loader's per-token document ids, attended tile by
  tile (model/varlen_attention.py);
- dense: the previous behaviour, for reference: the [b, 1, s, s] bool document mask handed to SDPA
  (only up to --dense-up-to: its memory grows with s²).

Per case: the bytes autograd keeps for backward (megalite.recompute.SavedActivations, one count per
storage, parameters excluded), the micro-batch's attention-mask bytes, and the peak resident set
of forward + backward minus the RSS before it (VmHWM reset through /proc/self/clear_refs; glibc's
mmap threshold pinned so freed blocks go back to the OS), as benchmarks/bench_activation_memory.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 2**20


def one_case(case: str, seq: int, args) -> dict:
    import gc

    import torch

    from bench_activation_memory import _reset_peak_rss, _status_kib
    from megalite.data.batch import build_batch
    from megalite.model import ExecutionConfig, GPTConfig
    from megalite.model.attention import SelfAttention
    from megalite.recompute import SavedActivations

    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                    num_query_groups=args.groups, vocab_size=64, padded_vocab_size=64, seq_length=seq,
                    max_position_embeddings=seq, attention_dropout=0.0, hidden_dropout=0.0)
    layer = SelfAttention(cfg, ExecutionConfig(), None).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    params = list(layer.parameters())
    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(1, 64, (args.micro_batch, seq + 1), generator=gen)
    ends = torch.rand(tokens.shape, generator=gen) < 1.0 / args.doc_length
    tokens[ends] = 0  # end-of-document tokens
    batch = build_batch(tokens, eod=0, reset_position_ids=True, reset_attention_mask=case != "causal")
    mask = batch["attention_mask"]
    if case == "dense":
        mask = mask.dense()
    mask_bytes = (0 if mask is None else mask.numel() * mask.element_size() if torch.is_tensor(mask)
                  else mask.doc_ids.numel() * mask.doc_ids.element_size())
    documents = int((tokens[:, :-1] == 0).sum()) + args.micro_batch

    def step(counter=None):
        x = torch.randn(seq, args.micro_batch, args.hidden, requires_grad=True)
        if counter is None:
            out = layer(x, None, mask)
        else:
            with counter:
                out = layer(x, None, mask)
        out.float().square().mean().backward()

    step()  # warm-up
    for p in params:
        p.grad = None
    gc.collect()
    counter = SavedActivations(params)
    exact = _reset_peak_rss()
    base = _status_kib("VmRSS") * 1024
    step(counter)
    peak = _status_kib("VmHWM") * 1024 - base
    return {"case": case, "seq": seq, "saved": counter.nbytes(), "peak": peak, "peak_exact": exact,
            "mask": mask_bytes, "documents": documents}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--dense-up-to", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--doc-length", type=int, default=1024, help="mean document length (tokens)")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_case(args.one[0], int(args.one[1]), args)))
        return
    # large blocks mmap'ed and unmapped on free, so RSS follows live memory
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    passthrough = ["--hidden", str(args.hidden), "--heads", str(args.heads), "--groups", str(args.groups),
                   "--micro-batch", str(args.micro_batch), "--doc-length", str(args.doc_length)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; commit {commit}; h {args.hidden}, heads {args.heads}, groups {args.groups}, "
          f"b {args.micro_batch}, mean document {args.doc_length} tokens, fp32")
    print("| s | case | documents | mask in the batch (MiB) | saved for backward (MiB) | peak fwd+bwd (MiB) | "
          "peak / causal |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.seq:
        causal_peak = None
        for case in ("causal", "packed", "dense"):
            if case == "dense" and seq > args.dense_up_to:
                continue
            out = subprocess.run([sys.executable, __file__, "--one", case, str(seq)] + passthrough, env=env,
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            causal_peak = r["peak"] if case == "causal" else causal_peak
            print(f"| {seq} | {case} | {r['documents'] if case != 'causal' else '-'} | {r['mask'] / MiB:.2f} | "
                  f"{r['saved'] / MiB:.1f} | {r['peak'] / MiB:.1f}{'' if r['peak_exact'] else ' (maxrss)'} | "
                  f"{r['peak'] / causal_peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
