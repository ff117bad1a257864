"""Activation memory of one gated DeltaNet layer and one DSA (MLA) layer against the sequence length,
to 16k tokens, with the planner's figure beside each (issue 44; numbers go to
benchmarks/RESULTS_attention_2026_memory.md; tests never assert on them: tests/test_delta_rule_dsa.py
and tests/test_plan_attention_2026.py hold the shape of the growth and the planner at small sizes).

    OMP_NUM_THREADS=1 python benchmarks/bench_attention_2026_memory.py [--max-seq 16384] [--out FILE]

Measured: the bytes autograd still holds for backward at the end of one layer's forward (norms,
attention variant, MLP): every tensor saved through saved-tensor hooks and alive then, one count per
storage, parameters excluded (`HeldActivations`), bf16 activations, micro-batch 1, one process. Planned:
planning/memory.layer_activation_bytes of the same configuration (tools/plan.py's figure per layer).
Counts, not times: safe to run beside other work. The shapes are Qwen3-Next's and DeepSeek-V3.2's
heads scaled down (hidden 512): DeltaNet 4 key heads x 8 value heads of 64 and 64 channels; DSA
with 8 heads, q_lora 192, kv_lora 64, an indexer of 16 heads x 64 and top-k 256, and its loss on.
A dense-attention layer of the same shape (the DSA model with top-k >= s keeps its [s, s] scores
in the indexer loss only chunk by chunk) is the planner's 'unfused softmax' line for comparison.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import subprocess
import sys
import weakref

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

COMMON = ["--vocab-size", "1000", "--hidden-size", "512", "--num-attention-heads", "8", "--micro-batch-size", "1",
          "--global-batch-size", "1", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
          "--normalization", "RMSNorm", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
          "--num-layers", "1", "--ffn-hidden-size", "1024"]
MODELS = {
    "gated DeltaNet": ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "[1]",
                       "--linear-key-head-dim", "64", "--linear-value-head-dim", "64", "--linear-num-key-heads", "4",
                       "--linear-num-value-heads", "8"],
    "DSA (MLA, top-k 256)": ["--multi-latent-attention", "--q-lora-rank", "192", "--kv-lora-rank", "64",
                             "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32",
                             "--qk-layernorm", "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads",
                             "16", "--dsa-indexer-head-dim", "64", "--dsa-indexer-topk", "256",
                             "--dsa-indexer-loss-coeff", "0.01"],
}
# the same DSA layer with 4x the keys per query, to 4k tokens: its per-token share grows with k
MODELS["DSA (MLA, top-k 1024)"] = [a if a != "256" else "1024" for a in MODELS["DSA (MLA, top-k 256)"]]
MAX_SEQ = {"DSA (MLA, top-k 1024)": 4096}


def measure(argv: list[str], seq: int) -> tuple[float, float]:
    """(measured, planned) bytes one layer keeps for backward."""
    import plan
    from megalite.model import GPTModel
    from megalite.model.config import ExecutionConfig
    from megalite.planning.attention_variant import linear_pattern
    from megalite.planning.memory import layer_activation_bytes
    c, _ = plan.parse(argv + ["--seq-length", str(seq), "--max-position-embeddings", str(seq), "--world-size", "1"])
    planned = layer_activation_bytes(c, False, None, linear_pattern(c)[0])[0]
    model = GPTModel(c.model, execution=ExecutionConfig(params_dtype=torch.bfloat16))
    model.train()
    layer = model.decoder.layers[0]
    x = torch.randn(seq, 1, c.model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rotary, mask = model._rotary_and_mask(x, None, None)
    with HeldActivations(list(model.parameters())) as held:
        y = layer(x, rotary, mask)
    measured = held.nbytes()  # the layer's input included, as in the plan's figure
    del y
    return float(measured), float(planned)


class HeldActivations:
    """What the graph still holds at the end of the forward: every tensor saved for backward, one count
    per storage, parameters excluded, and only those still alive (SavedActivations counts each save,
    including the local graphs DSA's indexer loss builds and frees chunk by chunk within forward)."""

    def __init__(self, params=()):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.refs = []

    def _pack(self, t):
        self.refs.append(weakref.ref(t))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    def nbytes(self) -> int:
        gc.collect()
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in self.exclude:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-seq", type=int, default=16384)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS_attention_2026_memory.md"))
    args = p.parse_args()
    torch.manual_seed(0)
    seqs = [s for s in (1024, 2048, 4096, 8192, 16384) if s <= args.max_seq]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# The 2026 attention's activation memory per layer ({datetime.date.today()}, commit {commit})", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}. Command: "
             "`OMP_NUM_THREADS=1 python benchmarks/bench_attention_2026_memory.py`.", "",
             "MiB one layer holds for backward at the end of its forward (bf16 activations, micro-batch 1; the "
             "DeltaNet's chunked rule and DSA's scores run in fp32): the tensors saved through saved-tensor hooks "
             "and still alive, one count per storage, parameters excluded; beside tools/plan.py's figure "
             "(planning/memory.py layer_activation_bytes).", ""]
    for name, flags in MODELS.items():
        lines += [f"## {name}", "", "| seq | measured MiB | planned MiB | measured / planned | MiB per 1k tokens |",
                  "|---:|---:|---:|---:|---:|"]
        for s in (s for s in seqs if s <= MAX_SEQ.get(name, s)):
            got, want = measure(COMMON + flags, s)
            lines.append(f"| {s} | {got / 2**20:.1f} | {want / 2**20:.1f} | {got / want:.3f} | "
                         f"{got / 2**20 / (s / 1024):.2f} |")
            print(name, s, got, want, flush=True)
        lines.append("")
    lines += ["Linear in the sequence: the MiB per 1k tokens stay flat from 1k to 16k for both (an [s, s] tensor "
              "would double them with each doubling of s; a dense softmax layer of DSA's shape that kept its "
              "fp32 scores would hold 8 heads x s x 4 bytes per token: 512 MiB per 1k tokens at 16k). DSA's per-token "
              "share is the selected keys' indices (k int64 each) and the indexer's outputs: O(s·k), the top-k "
              "1024 table's per-token figure above the top-k 256 one by 768 x 8 bytes. The "
              "indexer's cost is in FLOPs, not memory: H·D·s² multiply-adds for its scores (x4 with its loss, "
              "and the loss's dense target n·(d + dr)·s², each computed in chunks of queries and dropped).", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
