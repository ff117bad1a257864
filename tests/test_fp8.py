"""FP8 training (--fp8-format, megalite/fp8/) on the CPU, emulated: the casts and scales against
references, the flags' rules, and one process training in FP8.

- hybrid tensorwise: forward and both gradients of megalite's FP8 linear equal torchao's own
  Float8Linear (emulate=True: E4M3 input and weight, E5M2 output gradient, per-tensor scales), and
  the e4m3 format differs from it exactly in the gradient's format;
- blockwise: 1x128 activation tiles and 128x128 weight blocks (DeepSeek-V3, Sec. 3.3.2) against a
  reshape of the tensor into its tiles;
- delayed: the amax history's scales against max_fp8 / amax / 2^margin over the last
  --fp8-amax-history-len iterations (max and most_recent);
- refusals and notices (arguments/fp8.py), torchao's absence among them;
- one process: each recipe trains on the bundled corpus (the loss falls), differs from fp32 (FP8
  is applied) and stays within a few percent of it; --first-last-layers-bf16 keeps its layers out.

Costs ~18 s (the five one-process runs; the rest is in-process).
"""
import pytest
import torch

torchao = pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")

from dist_helpers import assert_loss_falls, run_pretrain, train_losses  # noqa: E402
from megalite.arguments import ArgumentError, parse_args, validate_args  # noqa: E402
from megalite.fp8 import blockwise  # noqa: E402
from megalite.fp8.context import FP8Context  # noqa: E402
from megalite.fp8.delayed import AmaxHistory  # noqa: E402
from megalite.fp8.recipe import E4M3, E5M2, Recipe, Role  # noqa: E402
from megalite.fp8.site import GemmSite, Groups  # noqa: E402
from megalite.tensor_parallel.fp8_linear import fp8_linear  # noqa: E402
from tiny import tiny  # noqa: E402


def _site(weight, scaling="tensorwise", fmt="hybrid"):
    context = FP8Context(Recipe(scaling, fmt, emulate=True))
    site = GemmSite(context, Groups(), weight)
    context.materialize(weight.device)
    return site


def _ours(x, w, b, **recipe):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, _site(w, **recipe))
    y.backward(torch.linspace(-3, 2, y.numel()).view_as(y) ** 3)  # a gradient with a wide range
    return y.detach(), x.grad, w.grad, b.grad


def _torchao(x, w, b):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    lin = torch.nn.Linear(w.size(1), w.size(0))
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    f8 = Float8Linear.from_float(lin, config=Float8LinearConfig(emulate=True))
    x = x.detach().clone().requires_grad_()
    y = f8(x)
    y.backward(torch.linspace(-3, 2, y.numel()).view_as(y) ** 3)
    return y.detach(), x.grad, f8.weight.grad, f8.bias.grad


def test_hybrid_tensorwise_equals_torchaos_float8_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 16, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05, torch.randn(48, generator=g)
    ours, ref = _ours(x, w, b), _torchao(x, w, b)
    for name, a, r in zip(("y", "dx", "dw", "db"), ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6, msg=name)
    # and FP8 is applied: the plain product differs by far more than the tolerance
    assert (ours[0] - (x @ w.t() + b)).abs().max() > 1e-3
    # e4m3 casts the output gradient to E4M3 too: the forward is the same, the gradients differ
    e4m3 = _ours(x, w, b, fmt="e4m3")
    torch.testing.assert_close(e4m3[0], ref[0], rtol=1e-6, atol=1e-6)
    assert (e4m3[1] - ref[1]).abs().max() > 1e-4


@pytest.mark.launches  # Inductor and the C compiler
def test_compiled_cast_writes_the_eager_casts_bytes(monkeypatch):
    """The cast a GPU runs (compiled: one pass) gives the eager cast's FP8 bytes for scalar, row
    and tile scales, in both formats, saturating what overflows and keeping NaN; it is the one
    chosen on CUDA with Triton, the eager one on the CPU. Inductor's C++ stands in for Triton here."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton

    from megalite.fp8 import operand
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g) * torch.logspace(-4, 3, 96)  # beyond FP8's range once scaled
    x[0, 0], x[1, 1] = float("nan"), -float("inf")
    w = torch.randn(24, 96, generator=g).bfloat16()
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with inductor_config.patch(compile_threads=1):
        for t in (x, w):
            for scale in (torch.tensor(0.37), torch.rand(t.size(0), 1, generator=g) * 4,
                          torch.rand(t.shape, generator=g) * 4):
                for dtype in (E4M3, E5M2):
                    eager = operand._scaled_cast(t, scale, dtype)
                    compiled = operand.compiled_scaled_cast()(t, scale, dtype)
                    assert compiled.dtype == dtype
                    nan = eager.float().isnan()  # NaN stays NaN (its sign bit is the kernel's)
                    assert torch.equal(compiled.float().isnan(), nan)
                    assert torch.equal(compiled.view(torch.uint8)[~nan], eager.view(torch.uint8)[~nan]), (
                        t.dtype, scale.shape, dtype)
    assert operand.cast_kernel(torch.device("cpu")) is operand._scaled_cast
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    assert operand.cast_kernel(torch.device("cuda")) is operand.compiled_scaled_cast()
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    assert operand.cast_kernel(torch.device("cuda")) is operand._scaled_cast


def test_compiled_layers_run_their_fp8_products_eagerly():
    """--compile with FP8: Dynamo traces each layer around its FP8 linears (torch.compiler.disable
    on fp8_linear: it failed with an internal error on torchao's tensor subclass), and the model
    computes eager FP8's loss and gradients. AOTAutograd without Inductor's code generation
    (`aot_eager`): the same graphs, breaks and autograd as --compile, the eager kernels, so equal
    bit for bit (Inductor's fusions are checked without FP8 in tests/test_compile.py)."""
    from megalite.config.fp8 import FP8Config
    from megalite.model import GPTConfig, GPTModel
    from megalite.model.compile import compile_layers, graph_breaks
    from megalite.model.fp8 import attach_fp8
    from megalite.parallel_state import single_process_state
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, padded_vocab_size=256,
                    seq_length=32, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for compiled in (False, True):
        model = GPTModel(cfg)
        model.initialize(7)
        attach_fp8([model], FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise"), single_process_state(),
                   torch.device("cpu"))
        if compiled:
            torch._dynamo.reset()
            compile_layers([model], backend="aot_eager")
        loss = model(ids, torch.arange(32).expand(2, 32), None, ids).mean()
        loss.backward()
        out[compiled] = [loss.detach()] + [p.grad for p in model.parameters()]
    assert graph_breaks() > 0  # around each FP8 linear
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


def _tiles_reference(x, rows, cols, dtype):
    """x cast with one scale per (rows x cols) tile, by reshaping it into its tiles."""
    r, c = x.shape
    t = x.float().reshape(r // rows, rows, c // cols, cols)
    amax = t.abs().amax(dim=(1, 3), keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float().reshape(r, c), \
        scale.expand_as(t).reshape(r, c)


def test_blockwise_tiles_are_deepseek_v3s():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 2, 256)  # channels of very different sizes
    op = blockwise.quantize(x, E4M3, Role.INPUT, None, blockwise.Axis(256))  # 1x128
    data, scale = _tiles_reference(x, 1, 128, E4M3)
    assert torch.equal(op.data.float(), data) and torch.equal(op.scale.expand_as(x), scale)
    w = torch.randn(256, 384, generator=g)
    w[3, 300] = 1e3  # one outlier costs the precision of its 128x128 block only
    op = blockwise.quantize(w, E4M3, Role.WEIGHT, blockwise.Axis(256), blockwise.Axis(384))
    data, scale = _tiles_reference(w, 128, 128, E4M3)
    assert torch.equal(op.data.float(), data) and torch.equal(op.scale.expand_as(w), scale)
    assert len(torch.unique(op.scale)) == 6  # 2 x 3 blocks
    dy = torch.randn(256, 32, generator=g)  # the weight gradient's 128x1 token tiles
    op = blockwise.quantize(dy, E5M2, Role.GRAD_OUTPUT, blockwise.token_axis(256), None)
    data, _ = _tiles_reference(dy, 128, 1, E5M2)
    assert torch.equal(op.data.float(), data)


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 2)])
def test_delayed_scaling_history(algo, margin):
    h = AmaxHistory(history_len=3, algo=algo, margin=margin)
    slot = h.add([E4M3, E5M2])
    h.materialize(torch.device("cpu"))
    amaxes = [(2.0, 8.0), (5.0, 1.0), (1.0, 0.5), (0.25, 0.0), (3.0, 2.0)]
    for i, (a, b) in enumerate(amaxes):
        h.record(slot, torch.tensor(a))
        h.record(slot + 1, torch.tensor(b / 2))  # the running maximum of the iteration's casts
        h.record(slot + 1, torch.tensor(b))
        h.finish_iteration(())
        window = amaxes[max(0, i - 2):i + 1]
        for j, dtype in enumerate((E4M3, E5M2)):
            amax = max(w[j] for w in window) if algo == "max" else window[-1][j]
            if amax == 0:  # a tensor not met keeps its scale
                continue
            want = torch.finfo(dtype).max / amax / 2 ** margin
            assert float(h.scales(slot + j)) == pytest.approx(want, rel=1e-6), (i, j)


BASE = ["--train-iters", "3", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--vocab-size", "128", "--lr", "1e-3"]


@pytest.mark.parametrize("extra,pattern", [
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe needs --fp8-format"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 is not supported: .*Blackwell"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-recipe custom is not supported"),
    (["--fp8-format", "hybrid", "--fp8-output-proj"], "--fp8-output-proj needs --fp8-recipe mxfp8"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "4"],
     "--fp8-amax-history-len sets delayed scaling"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "not supported with --fp8-recipe delayed"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--num-layers-at-start-in-bf16", "1"],
     "--num-layers-at-start-in-bf16 needs --first-last-layers-bf16"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
      "--num-layers-at-end-in-bf16", "3"], r"--num-layers-at-end-in-bf16 \(3\) must be between 0 and"),
    (["--fp8-format", "hybrid", "--fp8-param-gather"], "--fp8-param-gather needs --use-distributed-optimizer"),
])
def test_refusals(extra, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(BASE + extra), 1, check_files=False)


def test_refused_without_torchao_naming_it(monkeypatch):
    import megalite.arguments.fp8 as args_fp8
    monkeypatch.setattr(args_fp8, "torchao_installed", lambda: False)
    with pytest.raises(ArgumentError, match=r"--fp8-format needs torchao, which is not installed .*megalite\[fp8\]"):
        validate_args(parse_args(BASE + ["--fp8-format", "hybrid"]), 1, check_files=False)


def test_notices_and_accepted_settings():
    c = validate_args(parse_args(BASE + ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
                                         "--fp8-interval", "2", "--fp8-amax-history-len", "1024",
                                         "--fp8-amax-compute-algo", "max"]), 1, check_files=False)
    assert any(n.startswith("--fp8-param-gather: ") for n in c.notices)
    assert any(n.startswith("--fp8-interval 2: ") for n in c.notices)
    c = validate_args(parse_args(BASE + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise",
                                         "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0"]),
                      1, check_files=False)
    assert [c.fp8.layer_in_fp8(i, 2) for i in range(2)] == [True, False]


MODEL = tiny(num_layers=2, lr=3e-3, train_iters=8, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]


@pytest.mark.launches
def test_one_process_trains_in_fp8_near_fp32(corpus, tmp_path):
    ref, _ = run_pretrain(1, corpus + MODEL, tmp_path, "fp32")
    ref = train_losses(ref)
    assert_loss_falls(ref, 0.5)
    for name, flags in {"hybrid-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                        "e4m3-delayed": ["--fp8-format", "e4m3", "--fp8-amax-history-len", "4",
                                         "--fp8-amax-compute-algo", "max"],
                        "hybrid-blockwise": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]}.items():
        records, proc = run_pretrain(1, corpus + MODEL + flags, tmp_path, name)
        got = train_losses(records)
        assert "> FP8 (torchao" in proc.stdout and "8 linear layers in FP8" in proc.stdout, name
        assert_loss_falls(got, 0.5)
        rel = [abs(a - b) / a for a, b in zip(ref, got)]
        assert 1e-5 < max(rel) < 0.03, (name, rel)


@pytest.mark.launches
def test_layers_kept_in_bf16_by_the_flags_stay_out_of_fp8(tmp_path):
    """--first-last-layers-bf16 with 1 layer at the start and 2 at the end of 4: only layer 2 of
    them (0-based 1) has FP8 linears (QKV, attention output, fc1, fc2: 4 sites)."""
    flags = tiny(num_layers=4, train_iters=1, eval_iters=0) + ["--mock-data", "--vocab-size", "128", "--fp8-format",
                                                               "hybrid", "--fp8-recipe", "tensorwise",
                                                               "--first-last-layers-bf16",
                                                               "--num-layers-at-end-in-bf16", "2"]
    _, proc = run_pretrain(1, flags, tmp_path)
    assert "; 4 linear layers in FP8 on this rank" in proc.stdout


@pytest.mark.launches
def test_bf16_runs_never_import_torchao():
    """torchao is imported only when a run asks for FP8 (fp8/backend.py): building and stepping
    a model in another precision leaves it out of sys.modules."""
    import subprocess
    import sys

    from dist_helpers import ROOT
    code = ("import sys; from megalite import initialize, training, dry_run; "
            "from megalite.arguments import parse_args, validate_args; "
            "validate_args(parse_args(['--train-iters', '1', '--num-layers', '2', '--hidden-size', '64', "
            "'--num-attention-heads', '4', '--seq-length', '32', '--micro-batch-size', '2', '--mock-data', "
            "'--vocab-size', '128', '--lr', '1e-3']), 1, check_files=False); "
            "assert 'torchao' not in sys.modules, 'torchao imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
