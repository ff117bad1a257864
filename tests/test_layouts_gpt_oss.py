"""A gpt-oss-shaped model trains the same on every layout as on one process (issue 30, Done-when),
on real text where the loss falls.

The model: 4 layers, every one MoE (4 experts, top-2, aux and z losses on) with biased experts,
router and attention (Megatron-LM's default: no --disable-bias-linear), the clamped quick-GeGLU
(--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7), learned sinks, a sliding
window of 8 keys on every other layer, YaRN and GQA. Layouts: TP 2 with SP x DP 2 under ZeRO-2
(each expert's fc1 bias split, its fc2 bias added once per TP sum), PP 2 (a windowed and a full
layer per stage), CP 2 (the window crossing the chunks) and EP 2 under ZeRO-3 (an expert's biases
with its weights on its owner).
Compared: lm loss and the load-balancing loss per iteration (rtol 1e-5), the gradient norm
(clipping acts every step), every parameter after the last step. And with token dropping, a
checkpoint of one process resumes on EP 2 with --moe-pad-expert-input-to-capacity as the run
itself continues.
"""
import pytest

from dist_helpers import (assert_layout_matches, assert_loss_falls, assert_losses_close, assert_params_close,
                          grad_norms, load_params, per_iteration, run_pretrain, run_reference, train_losses)
from tiny import tiny

GPT_OSS = tiny(num_layers=4, seq_length=64, lr=3e-3, train_iters=6, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25", "--adam-eps", "1e-4",
    "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
    "--window-size", "8,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
    "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7",
    "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
    "16", "--no-yarn-correction-range-round-to-int",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
    "--moe-z-loss-coeff", "1e-3"]
ZERO = ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy"]
LAYOUTS = {
    # DP 2 under ZeRO-2: the experts' fc2 biases' gradients summed over TP from the sharded buffer
    "tp2-sp-dp2-zero2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + ZERO + ["optim_grads"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "ep2-alltoall-zero3": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
                           + ZERO + ["optim_grads_params"]),
}

RTOL = {"lm_loss": 1e-5, "load_balancing_loss": 1e-5, "grad_norm": 1e-5}


@pytest.fixture(scope="module")
def gpt_oss_reference(corpus, tmp_path_factory):
    ref = run_reference(corpus + GPT_OSS, tmp_path_factory.mktemp("gpt-oss"), save=True)
    assert_loss_falls(train_losses(ref.records), 0.3)
    assert min(grad_norms(ref.records)) > 0.25  # clipping acts on every iteration
    params = ref.params
    for part in ("router.bias", "linear_fc1.bias", "linear_fc2.bias", "softmax_offset", "linear_qkv.bias"):
        assert any(n.endswith(part) for n in params), part
    # the expert biases, zero at the start, have learned something
    assert max(float(p.abs().max()) for n, p in params.items() if n.endswith("experts.local_experts.0.linear_fc2.bias")) > 0
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_oss_layout_matches_single_process(gpt_oss_reference, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    assert_layout_matches(gpt_oss_reference, nproc, flags, tmp_path, RTOL, params_atol=1e-5)


def test_padded_to_capacity_under_ep2_resumes_the_unpadded_single_process(corpus, tmp_path):
    """Token dropping (capacity factor 1) on one process, saved after 2 of 4 iterations, resumed
    on EP 2 (alltoall) with every expert's input padded to its capacity: the biased experts and
    router (and their optimizer state) resharded from EP 1 to EP 2, each rank routing a
    micro-batch of its own, so the same choices are dropped, and the padding rows weigh nothing:
    iterations 3-4 and the final weights as the uninterrupted run's."""
    model = corpus + [f if GPT_OSS[i - 1] != "--train-iters" else "4" for i, f in enumerate(GPT_OSS)] + [
        "--moe-expert-capacity-factor", "1.0"]
    save = tmp_path / "ref"
    ref, _ = run_pretrain(1, model + ["--save", str(save), "--save-interval", "2"], tmp_path, "unpadded")
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("2")  # resume from the middle of the run
    padded, proc = run_pretrain(2, model + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                            "alltoall", "--moe-pad-expert-input-to-capacity", "--load", str(save),
                                            "--save", str(tmp_path / "padded")], tmp_path, "padded")
    assert "> loaded checkpoint" in proc.stdout, proc.stdout[-2000:]
    assert len(train_losses(padded)) == 2
    assert_losses_close(train_losses(ref)[2:], train_losses(padded), rtol=1e-5)
    assert_losses_close(per_iteration(ref, "load_balancing_loss")[2:], per_iteration(padded, "load_balancing_loss"),
                        rtol=1e-5)
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("4")
    assert_params_close(load_params(str(save)), load_params(str(tmp_path / "padded")), atol=1e-5)
