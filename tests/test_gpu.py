"""GPU tests: run by hand where CUDA is available (`pytest -m gpu tests/test_gpu.py`); skipped
cleanly without it. No GPU has run them yet: the CPU-provable parts of the CUDA path are held by
tests/test_device_clean.py (the meta device), tests/test_comm.py (the collectives NCCL runs) and
tests/test_compile.py.

- one-GPU bf16 training with SDPA (and flash-attn when installed): the first losses equal a CPU
  fp32 run within bf16 tolerance;
- exact resume on CUDA, RNG included (dropout on): 10 + 10 iterations = 20 straight;
- no host synchronisation inside a training step other than the logged ones
  (torch.cuda.set_sync_debug_mode("error")): written for the refactored loop, xfail until then;
- NCCL initialises with world size 1 and comm's collectives run on it;
- FP8 (an FP8 GPU: compute capability 8.9+, torchao installed): megalite's FP8 linear through
  torch._scaled_mm equals its CPU emulation (the same casts) within bf16 rounding, and FP8 training
  (hybrid tensorwise, blockwise) stays within 2 % of bf16's losses on the GPU.
"""
import os

import pytest
import torch

from dist_helpers import free_port, run_pretrain, train_losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--seed", "5"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# with --cross-entropy-loss-fusion: on CUDA the loss's passes over bf16 logits run compiled
# (tensor_parallel/cross_entropy.py fused_loss_kernels), on the CPU reference eagerly
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--cross-entropy-loss-fusion"]


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def cpu_fp32(tmp_path_factory):
    """The reference: the same runs in fp32 on the CPU (gloo backend selects the CPU)."""
    out = {}
    for name, extra in (("gpt2", []), ("llama", LLAMA)):
        records, _ = run_pretrain(1, BASE + NO_DROPOUT + extra + ["--train-iters", "5", "--distributed-backend", "gloo"],
                                  tmp_path_factory.mktemp("cpu"), name)
        out[name] = train_losses(records)
    return out


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "flash-attn"])
def test_bf16_training_matches_cpu_fp32(cpu_fp32, tmp_path, variant, attention):
    if attention == "flash-attn" and not _flash_attn_installed():
        pytest.skip("flash-attn is not installed")
    extra = (LLAMA if variant == "llama" else []) + (["--use-flash-attn"] if attention == "flash-attn" else [])
    records, proc = run_pretrain(1, BASE + NO_DROPOUT + extra + ["--train-iters", "5", "--bf16"], tmp_path)
    assert "device: cuda" in proc.stdout
    got, ref = train_losses(records), cpu_fp32[variant]
    assert len(got) == len(ref) == 5
    for i, (a, b) in enumerate(zip(ref, got)):  # bf16 weights and activations: ~3 significant digits
        assert abs(a - b) <= 2e-2 * abs(a), f"iteration {i + 1}: cpu fp32 {a}, cuda bf16 {b}"


def test_resume_on_cuda_is_exact_with_dropout(tmp_path):
    flags = BASE + LLAMA + ["--bf16"]  # dropout 0.1 (the default): the CUDA RNG states must be restored
    straight, _ = run_pretrain(1, flags, tmp_path, "straight")
    ck = str(tmp_path / "ck")
    first, _ = run_pretrain(1, flags + ["--save", ck, "--save-interval", "10", "--exit-interval", "10"], tmp_path, "first")
    second, _ = run_pretrain(1, flags + ["--load", ck], tmp_path, "second")
    a = train_losses(straight)
    b = train_losses(first) + train_losses(second)
    assert len(a) == len(b) == 20
    assert a == b, [(i + 1, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]


def _syncs_in_one_step(micro_batches: int) -> int:
    """Host synchronisations in one (warm) training step with this many micro-batches."""
    import warnings

    from megalite.arguments import parse_args, validate_args
    from megalite.training import setup, train_step
    flags = BASE + LLAMA + ["--bf16", "--log-interval", "1000", "--global-batch-size", str(2 * micro_batches)]
    run = setup(validate_args(parse_args(flags), 1))
    train_step(run)  # warm-up: allocations, cuBLAS handles, lazy inits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_no_host_sync_per_micro_batch():
    """The step reads the global loss sums and the gradient norm back once per iteration (the
    norm decides clipping and, with fp16, skipping), never once per micro-batch."""
    assert _syncs_in_one_step(2) == _syncs_in_one_step(8)


def test_nccl_world_size_one():
    import torch.distributed as dist
    from megalite import comm
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        group = dist.group.WORLD
        assert dist.get_backend(group) == "nccl" and comm.native_tensor_collectives(group)
        x = torch.arange(6.0, device=device)
        dist.all_reduce(x)
        assert torch.equal(x.cpu(), torch.arange(6.0))
        out = torch.empty(6, device=device)
        comm.reduce_scatter_flat(x, out, group)  # size one: a copy, no collective
        assert torch.equal(out, x)
        comm.barrier(group)
    finally:
        dist.destroy_process_group()


def _fp8_gpu() -> bool:
    import importlib.util
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
            and importlib.util.find_spec("torchao") is not None)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU (compute capability 8.9+) and torchao")


@needs_fp8_gpu
def test_fp8_linear_scaled_mm_equals_emulation():
    from megalite.fp8.context import FP8Context
    from megalite.fp8.recipe import Recipe
    from megalite.fp8.site import GemmSite, Groups
    from megalite.tensor_parallel.fp8_linear import fp8_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).cuda().bfloat16()
    w = (torch.randn(384, 512, generator=g) * 0.05).cuda().bfloat16()
    dy = torch.randn(256, 384, generator=g).cuda().bfloat16()
    out = {}
    for emulate in (True, False):
        context = FP8Context(Recipe("tensorwise", "hybrid", emulate=emulate))
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        site = GemmSite(context, Groups(), ww)
        context.materialize(x.device)
        y = fp8_linear(xx, ww, None, site)
        y.backward(dy)
        out[emulate] = (y.float(), xx.grad.float(), ww.grad.float())
    for name, a, b in zip(("y", "dx", "dw"), out[True], out[False]):
        # the same FP8 operands: only the product's accumulation and the bf16 output differ
        assert (a - b).abs().max() <= 2e-2 * a.abs().max(), name


@needs_fp8_gpu
def test_fp8_cast_on_cuda_is_compiled_with_the_eager_bytes():
    """On CUDA the cast is Triton's one pass (fp8/operand.py cast_kernel) and writes the bytes the
    eager four passes write (NaN aside: its sign bit is the kernel's)."""
    from megalite.fp8 import operand
    from megalite.fp8.recipe import E4M3, E5M2
    assert operand.cast_kernel(torch.device("cuda")) is operand.compiled_scaled_cast()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 384, generator=g) * torch.logspace(-4, 3, 384)).cuda().bfloat16()
    for scale in (torch.tensor(0.37, device="cuda"), torch.rand(512, 1, generator=g).cuda() * 4):
        for dtype in (E4M3, E5M2):
            eager, compiled = operand._scaled_cast(x, scale, dtype), operand.compiled_scaled_cast()(x, scale, dtype)
            nan = eager.float().isnan()
            assert torch.equal(compiled.float().isnan(), nan)
            assert torch.equal(compiled.view(torch.uint8)[~nan], eager.view(torch.uint8)[~nan]), (scale.shape, dtype)


@needs_fp8_gpu
@pytest.mark.parametrize("recipe,extra", [
    ("tensorwise", []), ("blockwise", []),
    # the experts' rows scaled per (micro-batch, expert) against a weight's scalar scale
    ("tensorwise", ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"])])
def test_fp8_training_on_cuda_near_bf16(tmp_path, recipe, extra):
    flags = BASE + NO_DROPOUT + LLAMA + extra + ["--bf16"]
    ref, _ = run_pretrain(1, flags, tmp_path, "bf16")
    records, proc = run_pretrain(1, flags + ["--fp8-format", "hybrid", "--fp8-recipe", recipe], tmp_path, "fp8")
    assert "GEMMs torch._scaled_mm" in proc.stdout
    for i, (a, b) in enumerate(zip(train_losses(ref), train_losses(records))):
        assert abs(a - b) <= 2e-2 * abs(a), f"iteration {i + 1}: bf16 {a}, fp8 {b}"


def test_gradient_accumulation_fusion_on_cuda():
    """bf16 weights, fp32 buffer: addmm's out_dtype takes the weight-gradient GEMMs into the buffer
    (tensor_parallel/grad_fusion.py); the buffer equals the hook's cast-copy and cast-add up to
    the bf16 rounding of each micro-batch's gradient, which the fused GEMM no longer does."""
    from test_grad_fusion import buffer_grads
    fused, names, _ = buffer_grads(True, device="cuda", dtype=torch.bfloat16)
    plain, none, _ = buffer_grads(False, device="cuda", dtype=torch.bfloat16)
    assert len(names) == 14 and none == []
    for n in names:
        assert torch.isfinite(fused[n]).all(), n
        torch.testing.assert_close(fused[n], plain[n], rtol=2e-2, atol=2e-3 * plain[n].abs().max().item(), msg=n)

