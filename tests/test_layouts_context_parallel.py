"""Context-parallel layouts train the same model as one process, on real text where the loss falls.

As test_layouts.py (fp32, dropout 0, 6 iterations, clipping active every step), at --seq-length
256 so that each of the 2·CP chunks holds real context: lm_loss per iteration (rtol 1e-5), the
global gradient norm (rtol 1e-5), the evaluation loss, and every parameter after the last step
from the --save checkpoint. The tensor-parallel, pipeline (1F1B and interleaved), ZeRO-1/2/3 (sharded
over DP x CP), sequence-parallel and recompute paths each appear beside CP; the variant (RoPE,
GQA, RMSNorm, SwiGLU, reset position ids and document attention masks) runs on CP 2 with
selective recompute. Finally a checkpoint saved with CP 2 resumes on CP 1 and on CP 4 exactly.
"""
import pytest

from dist_helpers import (assert_loss_falls, assert_losses_close, assert_params_close, eval_losses, grad_norms,
                          load_params, run_pretrain, train_losses)
from tiny import tiny

MODEL = tiny(num_layers=4, seq_length=256, lr=None, train_iters=6, log_interval=1, eval_interval=3, eval_iters=1) + [
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25",
         # Adam turns rounding noise in tiny gradients into steps of ~lr; 1e-4 keeps them under atol
         # (with 1e-5 one embedding element drifted 1.008e-5 at lr 1e-2)
         "--adam-eps", "1e-4"]
BASE = ["--lr", "3e-3"]  # 1e-2 also trains, but its loss spiked at iterations 5 and 9 (6.9, 7.6)
VARIANT = ["--lr", "3e-3", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear", "--ffn-hidden-size", "96",
           "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
# --calculate-per-token-loss: the global token mean instead of the mean of micro-batch means
PER_TOKEN = ["--lr", "3e-3", "--calculate-per-token-loss", "--eod-mask-loss"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
ZERO = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]

LAYOUTS = {  # id: (processes, flags, reference model)
    "cp2": (2, CP2, "base"),
    "cp4": (4, CP4, "base"),
    "tp2-cp2-sp": (4, TP2 + CP2 + ["--sequence-parallel"], "base"),
    "pp2-cp2": (4, PP2 + CP2, "base"),
    "pp2-vpp2-cp2-dp2-tp-pp-dp-mapping": (8, PP2 + VPP + CP2 + ["--use-tp-pp-dp-mapping"], "base"),
    "zero1-tp2-pp2-cp2-full-recompute": (
        8, TP2 + PP2 + CP2 + ZERO + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"], "base"),
    "zero2-tp2-cp2-overlap": (4, TP2 + CP2 + ["--data-parallel-sharding-strategy", "optim_grads",
                                              "--ddp-bucket-size", "5000", "--overlap-grad-reduce",
                                              "--overlap-param-gather"], "base"),
    "zero3-cp2-dp2-overlap": (4, CP2 + ["--data-parallel-sharding-strategy", "optim_grads_params",
                                        "--ddp-bucket-size", "5000", "--overlap-grad-reduce",
                                        "--overlap-param-gather"], "base"),
    "per-token-loss-cp2-dp2": (4, CP2, "per-token"),
    "variant-cp2-selective": (2, CP2 + ["--recompute-activations"], "variant"),
}
MODELS = {"base": BASE, "variant": VARIANT, "per-token": PER_TOKEN}
LOSS_DROP = 0.3


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    refs = {}
    for model, extra in MODELS.items():
        records, _ = run_pretrain(1, corpus + MODEL + extra + ["--save", str(tmp / model)], tmp, model)
        assert_loss_falls(train_losses(records), LOSS_DROP)
        assert min(grad_norms(records)) > 0.25  # clipping is active on every iteration
        refs[model] = (records, load_params(str(tmp / model)))
    return refs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layout_matches_single_process(references, corpus, tmp_path, layout):
    nproc, flags, model = LAYOUTS[layout]
    ref_records, ref_params = references[model]
    extra = MODELS[model]
    records, proc = run_pretrain(nproc, corpus + MODEL + extra + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    losses = train_losses(records)
    ref = train_losses(ref_records)
    print(f"\n{layout}: max relative loss difference "
          f"{max(abs(a - b) / abs(a) for a, b in zip(ref, losses)):.2e}, grad norm "
          f"{max(abs(a - b) / abs(a) for a, b in zip(grad_norms(ref_records), grad_norms(records))):.2e}")
    assert_losses_close(train_losses(ref_records), losses, rtol=1e-5)
    assert_loss_falls(losses, LOSS_DROP)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-5)
    assert_losses_close(eval_losses(ref_records), eval_losses(records), rtol=1e-5)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)
    cp = int(flags[flags.index("--context-parallel-size") + 1])
    ranks = records[0]["ranks"]
    assert sorted({r["cp"] for r in ranks}) == list(range(cp))
    if "--use-distributed-optimizer" in flags:  # Adam's m and v sharded over DP x CP
        for r in ranks:
            assert abs(r["optimizer_bytes"] - 8 * r["num_params"] / cp) <= 0.01 * 8 * r["num_params"] / cp, r


@pytest.fixture(scope="module")
def cp2_checkpoint(references, corpus, tmp_path_factory):
    """Saved at iteration 3 with CP 2 (x DP 2, ZeRO-1: optimizer shards over DP x CP); once for
    both resumptions below (they only read it)."""
    tmp = tmp_path_factory.mktemp("cp2-checkpoint")
    ckpt = tmp / "ckpt"
    first, _ = run_pretrain(4, corpus + MODEL + BASE + CP2 + ZERO + ["--exit-interval", "3", "--save", str(ckpt)],
                            tmp, "first")
    return first, ckpt


@pytest.mark.parametrize("resume_cp", [1, 4])
def test_cp_checkpoint_resumes_on_other_cp_sizes(references, cp2_checkpoint, corpus, tmp_path, resume_cp):
    """Saved at iteration 3 with CP 2 (x DP 2, ZeRO-1: optimizer shards over DP x CP), resumed with
    CP `resume_cp`: iterations 4-6 are the uninterrupted single-process run's."""
    ref = train_losses(references["base"][0])
    first, ckpt = cp2_checkpoint
    assert_losses_close(ref[:3], train_losses(first), rtol=1e-5)
    second, _ = run_pretrain(resume_cp, corpus + MODEL + BASE + ["--context-parallel-size", str(resume_cp),
                                                                 "--load", str(ckpt)], tmp_path, "second")
    assert [r["iteration"] for r in second if "consumed_samples" in r][0] == 4
    assert_losses_close(ref[3:], train_losses(second), rtol=1e-5)
