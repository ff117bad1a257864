"""--compile (torch.compile by Inductor, with the C compiler on CPU) computes the same training run
as eager: lm_loss per iteration within 1e-5 relative (fp32, dropout 0, 10 iterations) for TP=2
with sequence parallelism and selective recompute, the layer stack compiled as one region
(--compile-scope decoder); in one process a layer compiles to one graph shared by every layer
(the default scope), the stack to one graph with --compile-scope decoder, and compiled layers
under full (block) recompute give eager's loss and gradients. Compilation is slow on CPU (~20-40 s
of a 2-rank run), so there is one compiled training run, on a tiny Llama-style model (RoPE,
RMSNorm, SwiGLU, GQA); FP8 under --compile is checked in tests/test_fp8.py.
"""
import re

import pytest
import torch

from dist_helpers import assert_losses_close, run_pretrain, train_losses
from megalite.arguments import parse_args, validate_args
from megalite.model import GPTConfig, GPTModel
from megalite.model.config import ExecutionConfig
from megalite.model.compile import compile_layers, graph_breaks
from tiny import mock, tiny
from tolerances import assert_close_fp32, fp32_atol, model_rounding

BASE = mock(1000) + tiny(global_batch_size=4, log_interval=1, eval_iters=0) + [
        "--group-query-attention", "--num-query-groups", "2",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]


@pytest.fixture(autouse=True)
def _compile_in_process(monkeypatch):
    """Inductor compiles in the process that traces (TORCHINDUCTOR_COMPILE_THREADS=1): its default
    on 2 cores is a pool of compile workers per rank, each a Python process importing torch, which
    took 12 s more CPU per compiled TP2 run (79 s against 91 s) and compiles nothing faster here."""
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the runs' own processes
    with inductor_config.patch(compile_threads=1):  # this one's
        yield


def test_flag():
    from megalite.arguments.errors import ArgumentError
    assert validate_args(parse_args(BASE + ["--compile"]), 1).training.compile
    assert not validate_args(parse_args(BASE), 1).training.compile
    assert validate_args(parse_args(BASE + ["--compile", "--compile-scope", "decoder"]), 1).training.compile_scope == "decoder"
    with pytest.raises(ArgumentError, match="--compile-scope needs --compile"):
        validate_args(parse_args(BASE + ["--compile-scope", "decoder"]), 1)
    with pytest.raises(ArgumentError, match="--compile-scope decoder cannot run with --recompute-granularity full"):
        validate_args(parse_args(BASE + ["--compile", "--compile-scope", "decoder", "--recompute-granularity", "full",
                                         "--recompute-method", "uniform", "--recompute-num-layers", "1"]), 1)


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    records, _ = run_pretrain(1, BASE, tmp_path_factory.mktemp("eager"), "eager")
    losses = train_losses(records)
    assert losses[0] != losses[-1]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("nproc,extra", [
    # the layer stack one region, broken around the TP collectives and selective recompute's core
    # attention (the default per-layer scope runs in one process below)
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-activations",
         "--compile-scope", "decoder"]),
], ids=["tp2-sp-selective-decoder-scope"])
def test_compiled_matches_eager(eager, tmp_path, nproc, extra):
    records, proc = run_pretrain(nproc, BASE + extra + ["--compile"], tmp_path, timeout=900)
    assert_losses_close(eager, train_losses(records), rtol=1e-5)
    # the compile time is printed once, after the first iteration (from the logging rank)
    reports = re.findall(r"> compile: ([0-9.]+) s compiling .*?, (\d+) graph breaks", proc.stdout)
    assert len(reports) == 1, proc.stdout[-2000:]
    assert float(reports[0][0]) > 0
    assert "> compile: torch.compile of" in proc.stdout


@pytest.mark.launches  # Inductor starts its compile workers and the C compiler
@pytest.mark.parametrize("recompute,scope", [(None, "layer"), ("full", "layer"), (None, "decoder")],
                         ids=["plain", "full-block-recompute", "decoder-scope"])
def test_one_process_layer_compiles_without_graph_breaks(recompute, scope):
    """One process: a layer is one graph (a graph break here would mean a host sync or an
    untraceable call crept into the layer), shared by both layers; with --compile-scope decoder the
    whole stack is one graph. Under full block recompute (the first layer recomputed in backward,
    the second kept) the compiled layers give eager's loss and gradients, as do both scopes."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx
    graphs = []

    def recording(gm, example_inputs):  # Inductor, keeping each graph Dynamo hands it
        graphs.append(gm)
        return compile_fx(gm, example_inputs)
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=1000,
                    padded_vocab_size=1024, seq_length=32, max_position_embeddings=32,
                    position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                    hidden_dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32).expand(2, 32)
    out = {}
    for compiled in (False, True):
        execution = ExecutionConfig(recompute_granularity=recompute, recompute_method=recompute and "block",
                                    recompute_num_layers=recompute and 1)
        model = GPTModel(cfg, execution=execution)
        model.initialize(7)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            assert compile_layers([model], backend=recording, scope=scope) == 2
        loss = model(ids, pos, None, ids).mean()
        loss.backward()
        out[compiled] = (loss.item(), model.decoder.layers[0].mlp.linear_fc1.weight.grad.clone())
    assert graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # what the one graph holds: one layer's parameters, or both layers' (named by their place in the stack)
    inputs = " ".join(n.name for n in graphs[0].graph.nodes if n.op == "placeholder")
    held = [f"layers_modules_{i}_" in inputs for i in range(2)]
    assert held == ([True, True] if scope == "decoder" else [False, False]), inputs
    # Inductor fuses and reorders the layers' sums (tests/tolerances.py): 2 layers, a 1024-column loss
    assert abs(out[True][0] - out[False][0]) <= fp32_atol(scale=abs(out[False][0]), **model_rounding(k=1024, layers=2))
    assert_close_fp32(out[True][1], out[False][1], **model_rounding(k=1024, layers=2, backward=True))
