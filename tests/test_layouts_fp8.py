"""FP8 layouts train the same model as one FP8 process (every rank casts as the one process casts:
each scale from the whole tensor's amax, reduced over the ranks holding its pieces), on real text
where the loss falls.

fp32 masters and activations, dropout 0, 6 iterations: lm_loss per iteration within 1e-5 relative
of one process with the same FP8 flags. Layouts: TP 2 with sequence parallelism (the FP8 gather
of the input), PP 2, CP 2, ZeRO-3 over DP 2 (hybrid tensorwise); TP 2 + SP with blockwise tiles
that straddle the two ranks (hidden 64 < 128: the tile amaxes reduced over TP); ZeRO-1 over DP 2
with delayed scaling (the history reduced over DP); an MoE model's experts on EP 2 (all-to-all)
and EP 2 x TP 2 + SP. Then an FP8 checkpoint resumes in fp32 without FP8 and the reverse, with
the next losses within a stated tolerance of the uninterrupted run's.

Costs ~60-90 s on 2 shared cores (four one-process references, nine 2- and 4-rank runs, the two
resumes).
"""
import pytest

pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")

from dist_helpers import assert_loss_falls, assert_losses_close, run_pretrain, train_losses  # noqa: E402
from tiny import tiny  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.launches]

MODEL = tiny(num_layers=4, seq_length=64, lr=3e-3, train_iters=6, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.5", "--adam-eps", "1e-5"]
MOE = ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2"]
RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "blockwise": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"],
    "moe": MOE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {  # id: (processes, flags, reference)
    "tp2-sp": (2, TP2_SP, "tensorwise"),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], "tensorwise"),
    "cp2": (2, ["--context-parallel-size", "2"], "tensorwise"),
    "zero3-dp2": (2, ["--data-parallel-sharding-strategy", "optim_grads_params", "--ddp-bucket-size", "5000"],
                  "tensorwise"),
    "blockwise-tp2-sp": (2, TP2_SP, "blockwise"),
    "delayed-zero1-dp2": (2, ["--use-distributed-optimizer"], "delayed"),
    "moe-ep2": (2, EP2, "moe"),
    "moe-ep2-tp2-sp": (4, EP2 + TP2_SP, "moe"),
}


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8-reference")
    refs = {}
    for name, flags in RECIPES.items():
        records, proc = run_pretrain(1, corpus + MODEL + flags, tmp, name)
        assert "> FP8 (torchao" in proc.stdout
        refs[name] = train_losses(records)
        assert_loss_falls(refs[name], 0.3)
    return refs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_fp8_process(layout, references, corpus, tmp_path):
    nproc, flags, ref = LAYOUTS[layout]
    records, _ = run_pretrain(nproc, corpus + MODEL + RECIPES[ref] + flags, tmp_path, layout)
    assert_losses_close(references[ref], train_losses(records), rtol=1e-5)


FP8 = RECIPES["tensorwise"]
# FP8 against fp32 differs by up to ~2 % a step on this model (test_fp8.py), so a resume across
# precisions is held to the uninterrupted run of the precision it resumes in, from the same weights:
# the first resumed loss is the checkpoint's weights evaluated by the new precision (within FP8's
# rounding of the same function, 2 %), and the losses after it stay as close
ACROSS = 0.02


@pytest.mark.parametrize("first,then", [("fp8", "fp32"), ("fp32", "fp8")])
def test_checkpoint_resumes_across_precisions(first, then, corpus, tmp_path):
    flags = {"fp8": FP8, "fp32": []}
    half = ["--train-iters", "6", "--exit-interval", "3", "--save-interval", "3"]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    run_pretrain(1, corpus + MODEL + flags[first] + half + ckpt, tmp_path, "first")
    resumed, proc = run_pretrain(1, corpus + MODEL + flags[then] + ckpt, tmp_path, "then")
    assert [r["iteration"] for r in resumed if "consumed_samples" in r] == [4, 5, 6]
    assert ("> FP8 (torchao" in proc.stdout) == (then == "fp8")
    # the same run, not interrupted, in the first precision: the resumed losses stay within FP8's rounding
    whole, _ = run_pretrain(1, corpus + MODEL + flags[first], tmp_path, "whole")
    assert_losses_close(train_losses(whole)[3:], train_losses(resumed), rtol=ACROSS)
