"""Every TP x DP layout trains the same model: same lm_loss per iteration as one process
(fp32, dropout 0, 10 iterations, same global batch)."""
import pytest

from dist_helpers import assert_losses_close, grad_norms, run_pretrain, train_losses

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "10", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]
# RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer: every option that changes weights
VARIANT = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    base, _ = run_pretrain(1, BASE, tmp, "base")
    variant, _ = run_pretrain(1, BASE + VARIANT, tmp, "variant")
    return {"base": train_losses(base), "variant": train_losses(variant), "base_records": base}


@pytest.mark.parametrize("nproc,tp", [(2, 2), (2, 1), (4, 2)], ids=["tp2", "dp2", "tp2-dp2"])
def test_layout_matches_single_process(reference, tmp_path, nproc, tp):
    records, _ = run_pretrain(nproc, BASE + ["--tensor-model-parallel-size", str(tp)], tmp_path)
    assert_losses_close(reference["base"], train_losses(records))
    # the global gradient norm (what --clip-grad clips by) is the single-process norm
    assert_losses_close(grad_norms(reference["base_records"]), grad_norms(records), rtol=1e-4)
    # the loss actually moves, so equality is not an artefact of a frozen model
    assert reference["base"][0] != reference["base"][-1]


def test_model_options_match_under_tp2_dp2(reference, tmp_path):
    records, _ = run_pretrain(4, BASE + VARIANT + ["--tensor-model-parallel-size", "2"], tmp_path)
    assert_losses_close(reference["variant"], train_losses(records))
    assert reference["variant"] != reference["base"]


def test_jsonl_schema(tmp_path):
    records, _ = run_pretrain(1, BASE[:-8] + ["--train-iters", "4", "--log-interval", "2", "--eval-interval", "2",
                                             "--eval-iters", "1", "--lr", "1e-3"], tmp_path)
    assert records[0]["event"] == "memory_footprint"
    (rank,) = records[0]["ranks"]
    assert set(rank) == {"rank", "tp", "pp", "dp", "num_params", "param_bytes", "grad_bytes", "optimizer_bytes"}
    assert rank["param_bytes"] == 4 * rank["num_params"] and rank["optimizer_bytes"] == 8 * rank["num_params"]
    train = [r for r in records if "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [2, 4]
    assert train[-1]["consumed_samples"] == 4 * 8
    for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "elapsed_ms", "tokens_per_sec", "tflops_per_gpu", "mfu"):
        assert key in train[0]
    evals = [r for r in records if "split" in r]
    assert [(r["iteration"], r["split"]) for r in evals] == [(2, "valid"), (4, "valid"), (4, "test")]
    assert abs(evals[0]["ppl"] - 2.718281828 ** evals[0]["lm_loss"]) < 1e-6 * evals[0]["ppl"]
