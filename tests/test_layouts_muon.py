"""--optimizer muon trains the same model on every layout (issue 33), on real text where the loss
falls: lm loss per iteration within 1e-5 relative of one process, and the grad norms, on
TP2 (both whole-matrix TP modes: duplicated and distributed) with DP2 under ZeRO-1 and ZeRO-3,
PP2 x CP2 under ZeRO-2, and an MoE model's EP2 (experts each their own matrix) under ZeRO-1. Small
buckets (5000 elements) make ZeRO's slices cut matrices, so Muon's whole-matrix assembly at each
matrix's owner is exercised. TP2 x DP2 ZeRO-1 (duplicated mode) runs 3 iterations and saves; its
checkpoint (momentum in slices of TP shards) resumes on one process (no_shard) with the
uninterrupted run's losses for iterations 4-6. (Blockwise TP, each shard orthogonalized alone, is
layout-dependent by design: docs/optimizers.md.)"""
import pytest

from dist_helpers import assert_loss_falls, assert_losses_close, grad_norms, run_pretrain, train_losses
from tiny import tiny

MODEL = tiny(num_layers=2, lr=1e-2, train_iters=6, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--swiglu", "--group-query-attention",
    "--num-query-groups", "2", "--optimizer", "muon", "--muon-nesterov", "--weight-decay", "0.1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--disable-bias-linear"]
ZERO = ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy"]
TP2 = ["--tensor-model-parallel-size", "2", "--muon-tp-mode"]
LAYOUTS = {  # id: (processes, flags, MoE)
    "tp2-distributed-dp2-zero3": (4, TP2 + ["distributed"] + ZERO + ["optim_grads_params"], False),
    "pp2-cp2-zero2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"] + ZERO
                      + ["optim_grads"], False),
    "ep2-zero1": (2, ["--expert-model-parallel-size", "2"] + ZERO + ["optim"], True),
}
SAVE = ["--save-interval", "3", "--exit-interval", "3"]  # the checkpoint of iteration 3 is the latest


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """One process, dense and MoE; and the TP2 x DP2 ZeRO-1 run (duplicated mode) that saves."""
    tmp = tmp_path_factory.mktemp("muon")
    dense, _ = run_pretrain(1, corpus + MODEL, tmp, name="dense")
    moe, _ = run_pretrain(1, corpus + MODEL + MOE, tmp, name="moe")
    assert_loss_falls(train_losses(dense), 0.3)
    saved, proc = run_pretrain(4, corpus + MODEL + TP2 + ["duplicated"] + ZERO + ["optim", "--save", str(tmp / "ckpt")]
                               + SAVE, tmp, name="tp2-duplicated-dp2-zero1")
    assert "muon (5 Newton-Schulz steps, momentum 0.95, nesterov" in proc.stdout
    return {"dense": dense, "moe": moe, "saved": saved, "ckpt": str(tmp / "ckpt")}


def test_tp2_duplicated_zero1_matches_one_process(references):
    assert_losses_close(train_losses(references["dense"])[:3], train_losses(references["saved"]), rtol=1e-5)
    assert_losses_close(grad_norms(references["dense"])[:3], grad_norms(references["saved"]), rtol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(references, corpus, tmp_path, layout):
    nproc, flags, moe = LAYOUTS[layout]
    ref = references["moe" if moe else "dense"]
    records, _ = run_pretrain(nproc, corpus + MODEL + (MOE if moe else []) + flags, tmp_path)
    assert_losses_close(train_losses(ref), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(ref), grad_norms(records), rtol=1e-5)


def test_resumes_on_another_layout(references, corpus, tmp_path):
    """TP2 x DP2 ZeRO-1's checkpoint (iteration 3) on one process: iterations 4-6 as uninterrupted."""
    records, proc = run_pretrain(1, corpus + MODEL + ["--load", references["ckpt"]], tmp_path)
    assert "loaded checkpoint" in proc.stdout
    assert_losses_close(train_losses(references["dense"])[3:], train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(references["dense"])[3:], grad_norms(records), rtol=1e-5)
