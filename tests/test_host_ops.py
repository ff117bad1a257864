"""The step's host work (aten ops, torch.profiler CPU events, nested included) stays at the level of
a plain PyTorch training step and does not grow with the number of elements: the guard of the
headline figures in benchmarks/RESULTS_host_ops.md (benchmarks/bench_host_ops.py). Op counts do
not depend on the machine's speed; the shapes here keep GPT-2 125M's parameter tensors (12 layers,
148 tensors) at a width that costs nothing."""
import os
import sys

import pytest

from dist_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_host_ops import Megalite, Reference, count_step_ops  # noqa: E402


def _ops(contestant):
    try:
        return count_step_ops(contestant)
    finally:
        contestant.close()


# one bucket for both sizes: ZeRO-1 steps each bucket's slice as a flat tensor (a handful of ops per
# bucket; buckets are tens of millions of elements on NCCL)
@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer", "--ddp-bucket-size", "100000000"], ["--bf16"]],
                         ids=["no_shard", "zero1", "bf16-masters"])
def test_optimizer_ops_do_not_grow_with_elements(extra):
    """The optimizer's step (unscale, norm, overflow check, clip, update, master copies) over the
    same 12-layer tensors at 16x and 256x fewer elements per tensor: the same op count within a
    few ops (a flat buffer's row tail). Before the flat-buffer norm it was ~8 ops per 16K elements."""
    small = _ops(Megalite(12, 32, 4, 1, vocab=512, extra=extra))["optimizer"]
    large = _ops(Megalite(12, 256, 4, 1, vocab=8192, extra=extra))["optimizer"]
    assert large <= small + 8, (small, large)


def test_step_ops_at_most_a_plain_pytorch_step():
    """One micro-batch: at most 1.25x the reference's aten ops; each further micro-batch at most
    1.1x the reference's (the issue's bounds; measured 0.84x and 0.93x at the 125M shape)."""
    pytest.importorskip("transformers")
    ours = {m: _ops(Megalite(12, 64, 4, m, vocab=1024))["total"] for m in (1, 3)}
    ref = {m: _ops(Reference(12, 64, 4, m, vocab=1024))["total"] for m in (1, 3)}
    assert ours[1] <= 1.25 * ref[1], (ours, ref)
    assert ours[3] - ours[1] <= 1.1 * (ref[3] - ref[1]), (ours, ref)
