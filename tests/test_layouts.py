"""Every parallel layout trains the same model as one process, on real text where the loss falls.

For each layout family, pretrain_gpt.py (fp32, dropout 0, 10 iterations, the same global batch)
must match the single-process run in: lm_loss per iteration (rtol 1e-5), the global gradient norm
that --clip-grad clips by (rtol 1e-4; clipping is active every step), the evaluation loss, and
every parameter after the last step, read back whole from the --save checkpoint (atol 1e-5 of its
scale). The reference's loss must fall clearly over the compared iterations, so that equality is
not an artefact of a model that learns nothing (random mock tokens keep a small model at ln V).

Families: TP, DP, TP x DP, PP (1F1B, 2 and 4 stages), interleaved PP, TP x PP x DP; ZeRO-1 over DP
(unfused Adam) and with overlap, and on TP x PP x DP with overlap, sequence parallelism and full
recompute; sequence parallelism on TP; each recompute mode; and the model variant (RoPE, RMSNorm,
SwiGLU, GQA, no biases, untied output) on TP x interleaved PP and under ZeRO-3.
"""
import pytest

from dist_helpers import (assert_loss_falls, assert_losses_close, assert_params_close, eval_losses, grad_norms,
                          load_params, run_pretrain, train_losses)
from tiny import mock, tiny

MODEL = tiny(num_layers=4, lr=None, log_interval=1, eval_interval=5, eval_iters=1) + [
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
         "--clip-grad", "0.5",  # below every iteration's norm: clipping by the global norm acts each step
         # Adam moves an element whose true gradient is 0 (e.g. the key bias) by ~lr on rounding noise
         # when eps is tiny; 1e-5 keeps that below the parameter tolerance, and the loss still falls
         "--adam-eps", "1e-5"]
BASE = ["--lr", "1e-2"]
# RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer: every option that changes weights.
# At lr 1e-2 its gradient norm jumps (x3 from one step to the next), which amplifies rounding
# differences to ~1e-4; at 3e-3 it trains smoothly enough to compare at the tolerances above.
VARIANT = ["--lr", "3e-3",
           "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 4 layers / PP 2 -> 2 chunks per rank
SP = ["--sequence-parallel"]
# small buckets: several per rank, and ZeRO-1's DP slices cut through parameters
ZERO = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
SELECTIVE = ["--recompute-activations"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block"]

LAYOUTS = {  # id: (processes, flags, reference model)
    "tp2": (2, TP2, "base"),
    "dp2": (2, [], "base"),
    "tp2-dp2": (4, TP2, "base"),
    "pp2": (2, PP2, "base"),
    "pp2-vpp2": (2, PP2 + VPP, "base"),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"], "base"),  # one layer a stage, as many micro-batches
    "tp2-pp2-dp2": (8, TP2 + PP2, "base"),
    "zero1-dp2-unfused": (2, ZERO + ["--no-fused-optimizer"], "base"),  # against a fused Adam reference
    "zero1-dp2-overlap": (2, ZERO + OVERLAP, "base"),
    "zero1-tp2-pp2-dp2-overlap-sp-full-recompute": (
        8, ZERO + OVERLAP + TP2 + PP2 + SP + FULL_UNIFORM + ["--recompute-num-layers", "1"], "base"),
    "tp2-sp": (2, TP2 + SP, "base"),
    "recompute-selective": (1, SELECTIVE, "base"),
    "recompute-full-uniform-3": (1, FULL_UNIFORM + ["--recompute-num-layers", "3"], "base"),  # chunks of 3 + 1
    "recompute-full-block-2": (1, FULL_BLOCK + ["--recompute-num-layers", "2"], "base"),
    "variant-tp2-pp2-vpp2": (4, VARIANT + TP2 + PP2 + VPP, "variant"),
    # ZeRO-3 builds the model on the meta device: RoPE's frequencies must be made again on the real one
    "variant-zero3-dp2": (2, VARIANT + ["--data-parallel-sharding-strategy", "optim_grads_params"], "variant"),
}
LOSS_DROP = 0.4  # base falls 1.2 nats (6.25 -> 5.01) over the 10 iterations, the variant 0.62


def _value(flags, flag, default=1):
    return int(flags[flags.index(flag) + 1]) if flag in flags else default


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    refs = {}
    for model, extra in (("base", BASE), ("variant", VARIANT)):
        records, proc = run_pretrain(1, corpus + MODEL + extra + ["--save", str(tmp / model)], tmp, model)
        assert "> optimizer: adam (torch AdamW, fused)" in proc.stdout
        assert_loss_falls(train_losses(records), LOSS_DROP)
        assert min(grad_norms(records)) > 0.5  # clipping is active on every iteration
        assert len(eval_losses(records)) == 2
        refs[model] = (records, load_params(str(tmp / model)))
    assert refs["base"][1].keys() != refs["variant"][1].keys()
    return refs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(references, corpus, tmp_path, layout):
    nproc, flags, model = LAYOUTS[layout]
    ref_records, ref_params = references[model]
    extra = BASE if model == "base" else []
    records, proc = run_pretrain(nproc, corpus + MODEL + extra + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    if "--no-fused-optimizer" in flags:
        assert "> optimizer: adam (torch AdamW, unfused)" in proc.stdout
    losses = train_losses(records)
    assert_losses_close(train_losses(ref_records), losses, rtol=1e-5)
    assert_loss_falls(losses, LOSS_DROP)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-4)
    assert_losses_close(eval_losses(ref_records), eval_losses(records), rtol=1e-5)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)

    ranks = records[0]["ranks"]
    tp, pp = _value(flags, "--tensor-model-parallel-size"), _value(flags, "--pipeline-model-parallel-size")
    dp = nproc // (tp * pp)
    assert sorted((r["tp"], r["pp"], r["dp"]) for r in ranks) == sorted(
        (t, p, d) for t in range(tp) for p in range(pp) for d in range(dp))
    if "--use-distributed-optimizer" in flags or "--data-parallel-sharding-strategy" in flags:
        # fp32 Adam's m and v, 8 bytes per parameter, sharded over DP (buckets padded to a multiple of DP)
        for r in ranks:
            assert abs(r["optimizer_bytes"] - 8 * r["num_params"] / dp) <= 0.01 * 8 * r["num_params"] / dp, r
        for (t, p) in {(r["tp"], r["pp"]) for r in ranks}:
            replicas = [r for r in ranks if (r["tp"], r["pp"]) == (t, p)]
            assert 0 <= sum(r["optimizer_bytes"] for r in replicas) - 8 * replicas[0]["num_params"] < 8 * dp * 100
    else:
        for r in ranks:
            assert r["optimizer_bytes"] == 8 * r["num_params"], r


# -- the records the tests above read ---------------------------------------------------------------
def test_jsonl_schema(tmp_path, tiny_flags):
    """Mock data is enough here: only the records' shape matters."""
    flags = mock(1000) + tiny_flags(train_iters=4, log_interval=2, eval_interval=2, eval_iters=1)
    records, _ = run_pretrain(1, flags, tmp_path)
    assert records[0]["event"] == "memory_footprint"
    (rank,) = records[0]["ranks"]
    assert set(rank) == {"rank", "tp", "pp", "dp", "cp", "num_params", "num_expert_params", "param_bytes", "grad_bytes",
                         "optimizer_bytes"}
    assert rank["num_expert_params"] == 0  # a dense model
    assert rank["param_bytes"] == 4 * rank["num_params"] and rank["optimizer_bytes"] == 8 * rank["num_params"]
    train = [r for r in records if "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [2, 4]
    assert train[-1]["consumed_samples"] == 4 * 8
    for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "elapsed_ms", "tokens_per_sec", "tflops_per_gpu", "mfu"):
        assert key in train[0]
    evals = [r for r in records if "split" in r]
    assert [(r["iteration"], r["split"]) for r in evals] == [(2, "valid"), (4, "valid"), (4, "test")]
    assert abs(evals[0]["ppl"] - 2.718281828 ** evals[0]["lm_loss"]) < 1e-6 * evals[0]["ppl"]
