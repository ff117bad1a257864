"""The zero-bubble schedules (--pipeline-schedule zb_h1 | zbv, Qi et al. arXiv 2401.10241) train the
same MoE model as one process, on real text where the loss falls: lm loss per iteration within 1e-5
relative and the grad norm clipping acts on within 1e-4. Four 4-rank runs (the suite's budget)
cover both schedules on PP2 and PP4, TP2 with sequence parallelism and full recompute, EP2 with the
all-to-all dispatcher, ZeRO-1 and ZeRO-3 with the gradient-reduction overlap:

  zb_h1  PP2 x TP2 + SP, full recompute, ZeRO-1 + --overlap-grad-reduce (4 micro-batches)
  zb_h1  PP4, ZeRO-1 + --overlap-grad-reduce                            (4 micro-batches)
  zbv    PP2 x EP2 (DP 2), ZeRO-3 + --overlap-grad-reduce            (2 micro-batches, 4 virtual stages)
  zbv    PP4, ZeRO-1 + --overlap-grad-reduce                            (4 micro-batches, 8 virtual stages)

(The orders are also checked without processes below: every pass once, after its inputs.)
--log-pipeline-timeline is on in both: every rank's record has each F, B and W of each chunk and
micro-batch once, each W after its B, and the idle line is printed.
"""
import pytest

from dist_helpers import assert_loss_falls, assert_losses_close, grad_norms, run_pretrain, train_losses
from megalite.pipeline_parallel import zb_plan
from tiny import tiny

ITERS = 4
MODEL = tiny(num_layers=8, lr=1e-2, train_iters=ITERS, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.5",
    "--untie-embeddings-and-output-weights", "--log-pipeline-timeline",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ZERO = ["--ddp-bucket-size", "5000", "--overlap-grad-reduce", "--data-parallel-sharding-strategy"]
LAYOUTS = {  # id: (micro-batches per iteration, model chunks per rank, flags); 4 ranks each
    "zb_h1-pp2-tp2-sp-recompute-zero1": (4, 1, ["--pipeline-schedule", "zb_h1"] + PP2 + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"] + ZERO + ["optim"]),
    "zb_h1-pp4-zero1": (4, 1, ["--pipeline-schedule", "zb_h1", "--pipeline-model-parallel-size", "4"] + ZERO + ["optim"]),
    "zbv-pp2-ep2-zero3": (2, 2, ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "2"] + PP2 + [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"] + ZERO +
        ["optim_grads_params"]),
    "zbv-pp4-zero1": (4, 2, ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--pipeline-model-parallel-size", "4"] + ZERO + ["optim"]),
}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    records, _ = run_pretrain(1, corpus + MODEL, tmp_path_factory.mktemp("zb-reference"))
    assert_loss_falls(train_losses(records), 0.2)
    return records


@pytest.mark.launches
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_bubble_layout_matches_single_process(reference, corpus, tmp_path, layout):
    m, chunks, flags = LAYOUTS[layout]
    records, proc = run_pretrain(4, corpus + MODEL + flags, tmp_path)
    assert_losses_close(train_losses(reference), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(reference), grad_norms(records), rtol=1e-4)
    timelines = [r for r in records if r.get("event") == "pipeline_timeline"]
    assert len(timelines) == ITERS and f"pipeline idle (iteration {ITERS})" in proc.stdout
    assert len(timelines[-1]["ranks"]) == 4
    for rank in timelines[-1]["ranks"]:
        events = rank["events"]
        assert 0.0 <= rank["idle_fraction"] < 1.0
        for kind in "FBW":
            assert sorted((c, mb) for k, c, mb, *_ in events if k == kind) == \
                sorted((c, mb) for c in range(chunks) for mb in range(m))
        ends = {(k, c, mb): t1 for k, c, mb, t0, t1 in events}
        assert all(ends[("B", c, mb)] <= t0 for k, c, mb, t0, _ in events if k == "W")


@pytest.mark.parametrize("p,m,v", [(2, 1, False), (2, 4, False), (4, 3, False), (4, 8, False), (2, 3, True), (4, 8, True)])
def test_orders_run_every_pass_once_after_its_inputs(p, m, v):
    runs = zb_plan.simulate(p, m, v)
    g = zb_plan.Geometry(p, v)
    when = {}
    for r, run in enumerate(runs):
        assert sorted((a.kind, a.chunk, a.microbatch) for a, *_ in run) == \
            sorted((k, c, mb) for k in "FBW" for c in range(g.chunks) for mb in range(m))
        for a, t0, t1 in run:
            when[(a.kind, g.stage(r, a.chunk), a.microbatch)] = (t0, t1)
    for (kind, s, mb), (t0, _) in when.items():
        if kind == "F" and s > 0:
            assert when[("F", s - 1, mb)][1] <= t0
        if kind == "B":
            assert when[("F", s, mb)][1] <= t0
            if s < g.num_stages - 1:
                assert when[("B", s + 1, mb)][1] <= t0
        if kind == "W":
            assert when[("B", s, mb)][1] <= t0
    # on unit costs with m >= p: 1F1B's bubble is 3(p - 1), ZB-H1's (p - 1)(T_F + T_B - T_W) = p - 1; ZB-V's less
    span = max(t1 for run in runs for *_, t1 in run) - 3 * m
    if m >= p:
        assert span == {(2, False): 1, (4, False): 3, (2, True): 0.5, (4, True): 2}[(p, v)]
    if not v:  # ZB-H1: 1F1B's p - r micro-batches between F and B on rank r, at most r + 1 waiting for W
        for r, run in enumerate(runs):
            between = waiting = 0
            for a, *_ in run:
                between += {"F": 1, "B": -1, "W": 0}[a.kind]
                waiting += {"F": 0, "B": 1, "W": -1}[a.kind]
                assert between <= p - r and waiting <= r + 1


ARGS = ["--mock-data", "--vocab-size", "1000"] + tiny(num_layers=4) + ["--pipeline-model-parallel-size", "2"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1", "--untie-embeddings-and-output-weights"]


def _config(extra, world=2):
    from megalite.arguments import parse_args, validate_args
    return validate_args(parse_args(ARGS + extra), world)


def test_zero_bubble_schedules_switch_on_the_split_backward():
    assert _config(["--pipeline-schedule", "zb_h1"]).parallel.delay_wgrad_compute
    assert _config(["--pipeline-schedule", "zbv"] + VPP).parallel.delay_wgrad_compute
    assert not _config([]).parallel.delay_wgrad_compute
    # zbv runs any number of micro-batches (interleaved 1F1B needs a multiple of PP): 3 here
    assert _config(["--pipeline-schedule", "zbv", "--global-batch-size", "6"] + VPP).training.num_microbatches == 3


@pytest.mark.parametrize("extra, pattern", [
    (["--delay-wgrad-compute"], r"--delay-wgrad-compute defers weight gradients for a zero-bubble schedule to "
                                r"place: use --pipeline-schedule zb_h1 or zbv \(got 1f1b"),
    (["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "2"],
     r"--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank in a V, not 1"),
    (["--pipeline-schedule", "zbv", "--num-layers", "6"], r"--pipeline-schedule zbv runs 2 model chunks per "
     r"pipeline rank: --num-layers \(6\) must be divisible by 2 x --pipeline-model-parallel-size \(4\)"),
    (["--pipeline-schedule", "zb_h1", "--compile"], r"--pipeline-schedule zb_h1 cannot run with --compile"),
    (["--pipeline-schedule", "dualpipev"] + VPP, r"--pipeline-schedule dualpipev is not built"),
])
def test_layouts_a_zero_bubble_schedule_cannot_run_are_refused(extra, pattern):
    from megalite.arguments import ArgumentError
    with pytest.raises(ArgumentError, match=pattern):
        _config(extra)


def test_zbv_picks_two_chunks_per_rank_and_says_so():
    c = _config(["--pipeline-schedule", "zbv"])  # 4 layers on PP 2, tied embeddings
    assert c.parallel.virtual_pipeline_model_parallel_size == 2
    assert c.parallel.num_layers_per_virtual_pipeline_stage == 1
    said = [n for n in c.notices if "--pipeline-schedule zbv" in n]
    assert said == ["--pipeline-schedule zbv: 2 model chunks per pipeline rank in a V, 1 layer(s) each "
                    "(--num-layers-per-virtual-pipeline-stage 1)"]
    assert not any("zbv" in n for n in _config(["--pipeline-schedule", "zbv"] + VPP).notices)  # given: no word


# zbv with tied embeddings: the embedding (rank 0's chunk 0) and the output layer (its chunk 1) are
# one weight, whose two copies' gradients rank 0 sums itself. A dense model, 2 layers a chunk
TIED = tiny(num_layers=8, lr=1e-2, train_iters=ITERS, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.5"]
TIED_LAYOUTS = {  # id: (processes, flags): full gradients (no_shard), and sharded ones (ZeRO-2, DP 2)
    "zbv-tied-pp2": (2, ["--pipeline-schedule", "zbv"] + PP2),
    "zbv-tied-pp2-dp2-zero2": (4, ["--pipeline-schedule", "zbv"] + PP2 + ZERO + ["optim_grads"]),
}


@pytest.fixture(scope="module")
def tied_reference(corpus, tmp_path_factory):
    records, _ = run_pretrain(1, corpus + TIED, tmp_path_factory.mktemp("zbv-tied-reference"))
    assert_loss_falls(train_losses(records), 0.2)
    return records


@pytest.mark.launches
@pytest.mark.parametrize("layout", list(TIED_LAYOUTS))
def test_zbv_with_tied_embeddings_matches_single_process(tied_reference, corpus, tmp_path, layout):
    nproc, flags = TIED_LAYOUTS[layout]
    records, proc = run_pretrain(nproc, corpus + TIED + flags, tmp_path)
    assert "2 model chunks per pipeline rank in a V" in proc.stdout + proc.stderr
    assert_losses_close(train_losses(tied_reference), train_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(tied_reference), grad_norms(records), rtol=1e-4)


def test_zero_bubble_schedules_refuse_nccl(monkeypatch):
    """NCCL ignores tags and runs a pair's sends and receives in order: the runtime's sends posted
    ahead of the peer's receives could deadlock there, so the schedules say so at start-up."""
    import torch
    from megalite.arguments import ArgumentError, parse_args, validate_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ArgumentError, match=r"--pipeline-schedule zb_h1 runs on --distributed-backend gloo only"):
        validate_args(parse_args(ARGS + ["--pipeline-schedule", "zb_h1", "--distributed-backend", "nccl"]), 2,
                      check_files=False)
