"""--use-precision-aware-optimizer (Megatron-LM's flags): Adam computed in fp32 over state stored in
bf16 / fp16 against torch's AdamW and the rounding written out; the flags' rules; bytes per
parameter measured against plan.py's; bf16-moment checkpoints (Adam, Muon) that resume exactly on
another layout and load into fp32 moments."""
import json
import os
import sys

import pytest
import torch

from dist_helpers import ROOT, assert_loss_falls, assert_losses_close, run_pretrain, train_losses
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.optimizer.precision_adam import PrecisionAwareAdamW
from tiny import mock, tiny

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _run(optimizer_cls, params, grads, steps=3, **kw):
    opt = optimizer_cls([{"params": params, **HYPER}], **{**HYPER, **kw})
    for step in range(steps):
        for p, g in zip(params, grads):
            if optimizer_cls is PrecisionAwareAdamW:
                p.decoupled_grad = g * (step + 1)
            else:
                p.grad = g * (step + 1)
        opt.step()
    return opt


def test_fp32_storage_is_torch_adamw_to_the_bit():
    torch.manual_seed(0)
    grads = [torch.randn(5, 7), torch.randn(3)]
    ours, theirs = ([g.clone() * 0 + torch.randn_like(g) for g in grads] for _ in range(2))
    for a, b in zip(ours, theirs):
        b.copy_(a)
    _run(PrecisionAwareAdamW, ours, grads)
    _run(lambda groups, **kw: torch.optim.AdamW(groups, foreach=False, **kw), theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_bf16_moments_and_fp16_master_are_rounded_fp32_results():
    """One step from zero state: exp_avg = (1-β1)·g and exp_avg_sq = (1-β2)·g² computed in fp32
    and rounded to bf16; the fp16 master is the fp32 AdamW result rounded to fp16."""
    torch.manual_seed(1)
    g = torch.randn(64)
    master = torch.randn(64).half()
    start = master.float()
    opt = _run(PrecisionAwareAdamW, [master], [g], steps=1, exp_avg_dtype=torch.bfloat16,
               exp_avg_sq_dtype=torch.bfloat16)
    state = opt.state[master]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and master.dtype == torch.float16
    m, v = torch.zeros(64).lerp_(g, 0.1), torch.zeros(64).addcmul_(g, g, value=0.05)
    assert torch.equal(state["exp_avg"], m.bfloat16()) and torch.equal(state["exp_avg_sq"], v.bfloat16())
    p32 = start.mul_(1 - 1e-2 * 0.1).addcdiv_(m, (v.sqrt() / (1 - 0.95) ** 0.5).add_(1e-8), value=-1e-2 / (1 - 0.9))
    assert torch.equal(master, p32.half())


OK = mock(100) + tiny(seq_length=16, global_batch_size=None, train_iters=1)


@pytest.mark.parametrize("extra,pattern", [
    (["--exp-avg-dtype", "bf16"], r"--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--optimizer", "sgd"], r"--optimizer adam or muon"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], r"--exp-avg-sq-dtype fp8 is not supported"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp16"], r"--exp-avg-sq-dtype fp16 is not supported"),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], r"needs --bf16 or --fp16"),
    (["--use-precision-aware-optimizer", "--bf16", "--main-grads-dtype", "bf16"], r"needs --grad-reduce-in-bf16"),
    (["--qk-clip-threshold", "5"], r"--qk-clip-threshold needs --qk-clip"),
    (["--qk-clip", "--qk-layernorm"], r"--qk-clip with --qk-layernorm"),
    (["--qk-clip", "--qk-clip-alpha", "1"], r"--qk-clip-alpha must be in \(0, 1\)"),
])
def test_refused_combinations(extra, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(OK + extra), 1)


def test_plan_bytes_per_parameter_of_each_state_dtype():
    base = ["--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--world-size", "1"]
    n = plan.make_plan(base)["stages"][0]["num_params"]
    pa = ["--use-precision-aware-optimizer"]
    for flags, per_param in (([], 8), (pa + ["--exp-avg-dtype", "bf16"], 6),
                             (pa + ["--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "bf16"], 4),
                             (["--bf16"], 12), (["--bf16"] + pa + ["--main-params-dtype", "fp16"], 10),
                             (["--bf16"] + pa + ["--main-params-dtype", "fp16", "--exp-avg-dtype", "bf16",
                                                 "--exp-avg-sq-dtype", "bf16"], 6)):
        assert plan.make_plan(base + flags)["stages"][0]["optimizer_bytes"] == per_param * n, flags


# -- runs: measured bytes, exact resume across a layout change, loading across dtypes ---------------
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
MODEL = tiny(lr=5e-3, train_iters=6, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear"]


def footprint(records) -> list[dict]:
    (record,) = [r for r in records if r.get("event") == "memory_footprint"]
    return record["ranks"]


def test_bf16_moments_bytes_and_load_into_fp32_moments_on_another_layout(corpus, tmp_path):
    """One process, bf16 moments, 6 iterations, saved at 3: its optimizer holds 4 bytes per
    parameter (plan.py's number) and the checkpoint stores the moments in bf16. Resumed at DP2
    with ZeRO-1 and fp32 moments (no precision flags): the bf16 moments load, widened (exactly),
    iteration 4 is the uninterrupted run's and 5-6 stay within bf16's rounding of it. (The exact
    resume with bf16 moments across a layout change: the Muon test below, whose scalar Adam
    steps the embedding and norms with bf16 moments.)"""
    save = tmp_path / "ckpt"
    full, proc = run_pretrain(1, corpus + MODEL + BF16_MOMENTS + ["--save", str(save), "--save-interval", "3"],
                              tmp_path, "full")
    assert_loss_falls(train_losses(full), 0.3)
    assert "precision-aware: exp_avg bf16, exp_avg_sq bf16" in proc.stdout
    (rank,) = footprint(full)
    assert rank["optimizer_bytes"] == 4 * rank["num_params"]
    vocab = int(proc.stdout.split("vocab ")[1].split(" ")[0])
    p = plan.make_plan(MODEL + BF16_MOMENTS + ["--vocab-size", str(vocab), "--world-size", "1"])
    assert p["stages"][0]["num_params"] == rank["num_params"]
    assert p["stages"][0]["optimizer_bytes"] == rank["optimizer_bytes"]
    assert saved_dtypes(save)["exp_avg"] == saved_dtypes(save)["exp_avg_sq"] == "BF16"
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("3")
    widened, _ = run_pretrain(2, corpus + MODEL + ["--use-distributed-optimizer", "--load", str(save)], tmp_path,
                              "fp32")
    assert_losses_close(train_losses(full)[3:4], train_losses(widened)[:1], rtol=1e-5)
    assert_losses_close(train_losses(full)[3:], train_losses(widened), rtol=2e-3)


def saved_dtypes(save) -> dict:
    """{tensor kind: dtype} of the checkpoint at iteration 3 under `save`, from its index."""
    with open(save / "iter_0000003" / "index.jsonl") as f:
        sections = [json.loads(line) for line in f][1:]
    return {piece[0]: piece[6] for section in sections for piece in section.get("pieces", [])}


def test_muon_bf16_momentum_resumes_exactly_on_another_layout(corpus, tmp_path):
    """--optimizer muon with bf16 moments: Muon's momentum and the scalar Adam's moments stored in
    bf16 (plan.py's bytes, and saved so); saved at iteration 3 of 6 by one process, resumed at TP2 x DP2 with
    ZeRO-1 (--muon-tp-mode duplicated): iterations 4-6 are the uninterrupted run's."""
    save = tmp_path / "ckpt"
    muon = MODEL + BF16_MOMENTS + ["--optimizer", "muon", "--muon-tp-mode", "duplicated"]
    full, proc = run_pretrain(1, corpus + muon + ["--save", str(save), "--save-interval", "3"], tmp_path, "full")
    assert "muon (" in proc.stdout and "precision-aware: exp_avg bf16" in proc.stdout
    (rank,) = footprint(full)  # 2 bytes of momentum per matrix element, 2 + 2 of Adam's moments for the rest
    vocab = int(proc.stdout.split("vocab ")[1].split(" ")[0])
    p = plan.make_plan(muon + ["--vocab-size", str(vocab), "--world-size", "1"])
    assert p["stages"][0]["optimizer_bytes"] == rank["optimizer_bytes"] < 4 * rank["num_params"]
    kinds = saved_dtypes(save)
    assert kinds["momentum_buffer"] == kinds["exp_avg"] == kinds["exp_avg_sq"] == "BF16"
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("3")
    layout = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    resumed, _ = run_pretrain(4, corpus + muon + layout + ["--load", str(save)], tmp_path, "tp2dp2")
    assert_losses_close(train_losses(full)[3:], train_losses(resumed), rtol=1e-5)


def test_qk_clip_refused_with_ring_or_head_sharded_context_parallelism():
    """Its largest logit needs the whole sequence's keys beside each rank's queries: only allgather CP has them."""
    cp = OK + ["--qk-clip", "--context-parallel-size", "2", "--attention-dropout", "0"]
    validate_args(parse_args(cp), 2)  # allgather, the default
    for kind in ("p2p", "a2a"):
        with pytest.raises(ArgumentError, match=rf"--qk-clip with --cp-comm-type {kind} is not supported"):
            validate_args(parse_args(cp + ["--cp-comm-type", kind]), 2)
