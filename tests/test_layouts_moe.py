"""Every expert-parallel layout trains the same MoE model as one process, on real text where the
loss falls (issue: Mixture of Experts with expert parallelism).

An MoE GPT (4 SwiGLU experts a layer, top-2, aux loss and z-loss on) must match the
single-process run in: lm loss per iteration and the load-balancing and z losses the log reports
(rtol 1e-5), the global gradient norm clipping acts on (rtol 1e-4), and every parameter after the
last step, read back whole from the --save checkpoint (experts by their global names). Layouts:
EP 2 and 4 (both token dispatchers), EP x TP with sequence parallelism (grouped GEMM), EP x PP
(1F1B and interleaved), EP x CP, and EP2 x TP2 x PP2 with ZeRO-1, ZeRO-2 and ZeRO-3 (8 ranks).
A checkpoint written at EP2 x TP2 x DP4 (expert-DP 2, ZeRO-1, sigmoid routing with expert bias)
resumes at EP4 (no_shard) and at EP1 (ZeRO-3) with the uninterrupted run's losses. Expert tensor
parallelism: TP2 + SP with ETP 1 and EP 2 matches one process, and its checkpoint resumes at TP2
with ETP 2 (the default) and at one process.
"""
import os

import pytest

from dist_helpers import (assert_loss_falls, assert_losses_close, assert_params_close, grad_norms, load_params,
                          run_pretrain, train_losses)
from tiny import tiny

MODEL = tiny(num_layers=4, lr=1e-2, train_iters=8, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.5", "--adam-eps", "1e-5",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ZERO = ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy"]
LAYOUTS = {  # id: (processes, flags)
    "ep2-alltoall": (2, EP2 + A2A),
    "ep4-allgather": (4, EP4),
    "ep2-tp2-sp-grouped": (4, EP2 + TP2_SP + A2A + ["--moe-grouped-gemm"]),
    "ep2-pp2": (4, EP2 + PP2),
    "ep2-pp2-vpp2-alltoall": (4, EP2 + PP2 + A2A + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "ep2-cp2-alltoall": (2, EP2 + A2A + ["--context-parallel-size", "2"]),
    "ep2-tp2-pp2-zero1": (8, EP2 + TP2_SP + PP2 + A2A + ZERO + ["optim"]),
    "ep2-tp2-pp2-zero2-overlap": (8, EP2 + TP2_SP + PP2 + ZERO + ["optim_grads", "--overlap-grad-reduce"]),
    "ep2-tp2-pp2-zero3-overlap": (8, EP2 + TP2_SP + PP2 + A2A + ZERO + ["optim_grads_params", "--overlap-grad-reduce",
                                                                       "--overlap-param-gather"]),
}
LOSS_DROP = 0.4


def moe_values(records, key) -> list[float]:
    return [r[key] for r in records if "consumed_samples" in r]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-reference")
    records, proc = run_pretrain(1, corpus + MODEL + ["--save", str(tmp / "ckpt")], tmp)
    assert_loss_falls(train_losses(records), LOSS_DROP)
    assert min(grad_norms(records)) > 0.5  # clipping acts every iteration
    assert "load balancing loss:" in proc.stdout and "expert tokens min/max:" in proc.stdout
    moe = [r for r in records if r.get("event") == "moe"]
    assert len(moe) == 8 and [layer["layer"] for layer in moe[0]["layers"]] == [0, 1, 2, 3]
    return records, load_params(str(tmp / "ckpt"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_process(reference, corpus, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    ref_records, ref_params = reference
    records, proc = run_pretrain(nproc, corpus + MODEL + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    assert_losses_close(train_losses(ref_records), train_losses(records), rtol=1e-5)
    for key in ("load_balancing_loss", "z_loss"):
        assert_losses_close(moe_values(ref_records, key), moe_values(records, key), rtol=1e-5)
    assert moe_values(ref_records, "expert_tokens_max") == moe_values(records, "expert_tokens_max")
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-4)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)
    assert "EP " in proc.stdout and "experts over expert-DP" in proc.stdout


def test_etp1_under_tp2_matches_single_process_and_resumes_elsewhere(reference, corpus, tmp_path):
    """--expert-tensor-parallel-size 1 on TP2 + SP with EP2 (4 ranks: experts whole, each TP rank's
    tokens sent to their experts over the EP group, which is the TP pair): the 8 iterations, the
    router's losses and the final weights as one process. Its iteration-4 checkpoint (experts
    saved whole) resumes at TP2 with ETP 2 and EP 1 (experts cut over ETP on load) and at one
    process: iterations 5-8 as the uninterrupted run."""
    ref_records, ref_params = reference
    save = tmp_path / "ckpt"
    etp1 = ["--expert-tensor-parallel-size", "1"]
    records, proc = run_pretrain(4, corpus + MODEL + EP2 + TP2_SP + A2A + etp1 + [
        "--save", str(save), "--save-interval", "4"], tmp_path, "etp1")
    assert "ETP 1 x EP 2 x expert-DP 2" in proc.stdout
    assert_losses_close(train_losses(ref_records), train_losses(records), rtol=1e-5)
    for key in ("load_balancing_loss", "z_loss"):
        assert_losses_close(moe_values(ref_records, key), moe_values(records, key), rtol=1e-5)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-4)
    assert_params_close(ref_params, load_params(str(save)), atol=1e-5)
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("4")  # resume from the middle of the run
    for name, nproc, flags in (("tp2-etp2", 2, TP2_SP), ("one", 1, [])):
        resumed, proc = run_pretrain(nproc, corpus + MODEL + flags + ["--load", str(save)], tmp_path, name)
        assert "> loaded checkpoint" in proc.stdout, proc.stdout[-2000:]
        assert_losses_close(train_losses(ref_records)[4:], train_losses(resumed), rtol=1e-5)


BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-2"]


def test_moe_checkpoint_resumes_on_other_ep_sizes(corpus, tmp_path):
    """Saved at EP2 x TP2 x DP4 (ZeRO-1) after 4 of 8 iterations; resumed at EP4 (no_shard) and
    EP1 (ZeRO-3): iterations 5-8 as in the uninterrupted run, expert biases included."""
    model = [f if f != "8" or MODEL[i - 1] != "--train-iters" else "8" for i, f in enumerate(MODEL)] + BIAS
    save = tmp_path / "ckpt"
    full, _ = run_pretrain(8, corpus + model + EP2 + TP2_SP + ["--use-distributed-optimizer", "--save", str(save),
                                                                 "--save-interval", "4"], tmp_path, "full")
    with open(save / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("4")  # resume from the middle of the run
    expected = train_losses(full)[4:]
    assert len(expected) == 4 and full[-1]["load_balancing_loss"] > 0
    for name, nproc, flags in (("ep4", 4, EP4 + A2A), ("ep1-zero3", 2, ["--data-parallel-sharding-strategy",
                                                                         "optim_grads_params"])):
        records, proc = run_pretrain(nproc, corpus + model + flags + ["--load", str(save)], tmp_path, name)
        assert "> loaded checkpoint" in proc.stdout, proc.stdout[-2000:]
        assert_losses_close(expected, train_losses(records), rtol=1e-5)
        assert_losses_close(moe_values(full, "load_balancing_loss")[4:], moe_values(records, "load_balancing_loss"))
    # offline resharding (tools/checkpoint/convert.py) keeps the expert biases with the weights
    from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict
    meta, state = load_full_state_dict(str(save), 4)
    biases = [n for n in state if n.endswith("router.expert_bias")]
    assert len(biases) == 4 and any(float(state[n].abs().max()) > 0 for n in biases)
    save_full_state_dict(str(tmp_path / "tp1pp2"), state, meta["model_config"], meta["config"], 4, tp=1, pp=2)
    _, again = load_full_state_dict(str(tmp_path / "tp1pp2"))
    assert sorted(again) == sorted(state) and all(bool((again[n] == state[n]).all()) for n in biases)


def test_group_limited_routing_under_ep2_matches_single_process(corpus, tmp_path):
    """DeepSeek-V3's routing (sigmoid, expert bias, 2 groups with group top-1, scaled, in fp64) on
    EP 2 with the alltoall dispatcher: each EP rank holds one group; losses and weights as one process."""
    model = [f if MODEL[i - 1] not in ("--train-iters", "--num-layers") else {"--train-iters": "4",
             "--num-layers": "2"}[MODEL[i - 1]] for i, f in enumerate(MODEL)] + BIAS + [
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-dtype", "fp64"]
    ref, _ = run_pretrain(1, corpus + model + ["--save", str(tmp_path / "one")], tmp_path, "one")
    records, _ = run_pretrain(2, corpus + model + EP2 + A2A + ["--save", str(tmp_path / "ep2")], tmp_path, "ep2")
    assert len(train_losses(ref)) == 4
    assert_losses_close(train_losses(ref), train_losses(records), rtol=1e-5)
    assert_losses_close(moe_values(ref, "load_balancing_loss"), moe_values(records, "load_balancing_loss"), rtol=1e-5)
    assert_params_close(load_params(str(tmp_path / "one")), load_params(str(tmp_path / "ep2")), atol=1e-5)
