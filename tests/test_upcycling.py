"""--moe-use-upcycling (checkpoint/upcycling/): a dense checkpoint trained on real
text becomes an MoE model of 4 experts whose language-model loss at its first step equals the
dense model's on the same batch within 1e-6 (one process, and EP2), written to --save at
iteration 1 as Megatron-LM does: every expert a copy of the dense MLP, the router as
initialised, attention and embeddings copied. Granularity 2 on TP2 slices the dense MLP
(SwiGLU's gate and up alike) and scales it as Megatron-LM; the bad inputs get one error line."""
import json
import os

import pytest
import torch

from dist_helpers import assert_loss_falls, load_params, run_pretrain, train_losses
from tiny import tiny
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.offline import load_full_state_dict
from megalite.model.init import full_tensor
from megalite.tensor_parallel import set_init

DENSE = tiny(lr=1e-2, train_iters=5, log_interval=1, eval_iters=0, save_interval=4, ffn_hidden_size=64) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--swiglu", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-use-upcycling"]
FC1, FC2 = "decoder.layers.{}.mlp.linear_fc1.weight", "decoder.layers.{}.mlp.linear_fc2.weight"
EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}.{}.weight"


@pytest.fixture(scope="module")
def dense(corpus, tmp_path_factory):
    """A dense checkpoint of iteration 4 and the dense model's loss at iteration 5 (the batch after it)."""
    tmp = tmp_path_factory.mktemp("dense")
    records, _ = run_pretrain(1, corpus + DENSE + ["--save", str(tmp / "ckpt")], tmp)
    losses = train_losses(records)
    assert_loss_falls(losses, 0.2)
    with open(tmp / "ckpt" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("4\n")  # upcycle the checkpoint of iteration 4: the dense loss of iteration 5 is step 0's
    return str(tmp / "ckpt"), losses[4]


def router_param():
    p = torch.nn.Parameter(torch.empty(4, 64))
    set_init(p, "normal", 0.02)  # --init-method-std's default
    return p


def upcycle(corpus, dense_dir, tmp_path, name, nproc=1, extra=()):
    save = tmp_path / name
    records, proc = run_pretrain(nproc, corpus + DENSE + MOE + ["--load", dense_dir, "--save", str(save),
                                                                "--train-iters", "3", *extra], tmp_path, name)
    return [r for r in records if "consumed_samples" in r], proc, str(save)


def test_upcycled_model_gives_the_dense_loss_at_step_0(corpus, dense, tmp_path):
    dense_dir, dense_loss = dense
    train, proc, save = upcycle(corpus, dense_dir, tmp_path, "moe")
    # Megatron-LM: iteration 1 is the upcycled checkpoint; training goes on from the dense run's samples
    assert [r["iteration"] for r in train] == [2, 3] and train[0]["consumed_samples"] == 5 * 8
    assert abs(train[0]["lm_loss"] - dense_loss) <= 1e-6 * dense_loss, (train[0]["lm_loss"], dense_loss)
    assert train[1]["lm_loss"] != train[0]["lm_loss"] and "the step-0 function differs" not in proc.stdout
    meta, moe = load_full_state_dict(save, 1)
    assert meta["model_config"]["num_experts"] == 4 and meta["scheduler"]["num_steps"] == 0
    ref = load_params(dense_dir)
    for layer in range(2):
        for e in range(4):
            assert torch.equal(moe[EXPERT.format(layer, e, "linear_fc1")], ref[FC1.format(layer)])
            assert torch.equal(moe[EXPERT.format(layer, e, "linear_fc2")], ref[FC2.format(layer)])
        router = f"decoder.layers.{layer}.mlp.router.weight"  # as an MoE run from scratch initialises it
        assert router not in ref and torch.equal(moe[router], full_tensor(router_param(), router, 7, (4, 64)))
    shared = [n for n in ref if "mlp.linear_fc" not in n]
    assert shared and all(torch.equal(moe[n], ref[n]) for n in shared)


def test_upcycling_on_ep2_gives_the_dense_loss(corpus, dense, tmp_path):
    dense_dir, dense_loss = dense
    train, _, _ = upcycle(corpus, dense_dir, tmp_path, "ep2", 2, ["--expert-model-parallel-size", "2",
                                                                  "--moe-token-dispatcher-type", "alltoall"])
    assert abs(train[0]["lm_loss"] - dense_loss) <= 1e-6 * dense_loss, (train[0]["lm_loss"], dense_loss)


def test_granular_upcycling_on_tp2_slices_and_scales_the_dense_mlp(corpus, dense, tmp_path):
    dense_dir, _ = dense
    _, proc, save = upcycle(corpus, dense_dir, tmp_path, "g2", 2, [
        "--moe-upcycling-granularity", "2", "--moe-ffn-hidden-size", "32", "--tensor-model-parallel-size", "2",
        "--sequence-parallel"])
    assert "the step-0 function differs from the dense model's: the experts' fc1 and fc2 are scaled" in proc.stdout
    _, moe = load_full_state_dict(save, 1)
    ref = load_params(dense_dir)
    s = 2 ** (1 / 3)  # Megatron-LM: activation scale g, its cube root on each SwiGLU weight
    for layer in range(2):
        gate, up = ref[FC1.format(layer)].chunk(2)
        for e in range(4):
            j = e % 2
            fc1 = torch.cat([gate[32 * j:32 * (j + 1)], up[32 * j:32 * (j + 1)]]) * s
            torch.testing.assert_close(moe[EXPERT.format(layer, e, "linear_fc1")], fc1, rtol=0, atol=1e-7)
            torch.testing.assert_close(moe[EXPERT.format(layer, e, "linear_fc2")],
                                       ref[FC2.format(layer)][:, 32 * j:32 * (j + 1)] * s, rtol=0, atol=1e-7)
        router = moe[f"decoder.layers.{layer}.mlp.router.weight"]
        assert torch.equal(router[0], router[1]) and torch.equal(router[2], router[3])  # runs of g rows tie
        assert not torch.equal(router[0], router[2])


def test_bad_inputs_get_one_error_line(corpus, dense, tmp_path):
    dense_dir, _ = dense
    base = corpus + DENSE + ["--save", str(tmp_path / "new")]

    def refused(argv, pattern):
        with pytest.raises(ArgumentError, match=pattern):
            validate_args(parse_args(argv), 1)
    refused(base + MOE, "--moe-use-upcycling needs --load")
    refused(base + ["--moe-use-upcycling", "--load", dense_dir], "--moe-use-upcycling needs --num-experts")
    refused(base + MOE + ["--load", str(tmp_path / "none")], "--moe-use-upcycling: --load .*: directory not found")
    refused(base + MOE[:-1] + ["--moe-upcycling-granularity", "2"], "--moe-upcycling-granularity needs "
            "--moe-use-upcycling")
    refused(base + MOE + ["--load", dense_dir, "--moe-upcycling-granularity", "2"],
            r"the experts' hidden size \(64.*x --moe-upcycling-granularity \(2\) must be the dense checkpoint's "
            r"--ffn-hidden-size \(64\)")
    refused(corpus + DENSE + MOE + ["--load", dense_dir, "--save", dense_dir], "already holds a checkpoint")
    # a checkpoint that is already MoE (its metadata says so)
    moe_dir = tmp_path / "moe"
    os.makedirs(moe_dir / "iter_0000001")
    with open(os.path.join(dense_dir, "iter_0000004", "metadata.json")) as f:
        meta = json.load(f)
    meta["model_config"]["num_experts"] = 4
    (moe_dir / "iter_0000001" / "metadata.json").write_text(json.dumps(meta))
    (moe_dir / "latest_checkpointed_iteration.txt").write_text("1\n")
    refused(base + MOE + ["--load", str(moe_dir)], "holds an MoE checkpoint .--num-experts 4")


def test_notice_names_why_the_step0_function_differs(tmp_path):
    """Megatron-LM's scaling with --moe-router-pre-softmax (E·g/k = 2: 2^(1/3) on SwiGLU weights),
    a shared expert, sigmoid top-1: each named; the default routing: no notice."""
    base = tiny(ffn_hidden_size=64) + ["--mock-data", "--vocab-size", "128", "--swiglu", "--disable-bias-linear",
                                       "--load", str(tmp_path / "d"), "--save", str(tmp_path / "m")] + MOE

    def notices(*extra):
        return [n for n in validate_args(parse_args(base + list(extra)), 1, check_files=False).notices
                if n.startswith("--moe-use-upcycling")]
    assert notices() == []
    (scaled,) = notices("--moe-router-pre-softmax")
    assert "scaled by 1.25992 for --moe-router-pre-softmax" in scaled
    shared, top1 = notices("--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                           "--moe-router-topk", "1")
    assert "sigmoid(logit) < 1" in top1 or "sigmoid(logit) < 1" in shared
    assert any("shared expert" in n for n in (shared, top1))
