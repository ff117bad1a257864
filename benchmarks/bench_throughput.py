"""Training throughput of megalite next to transformers' GPT2LMHeadModel and a plain-PyTorch
nanoGPT-style GPT, with MFU, and where megalite's step spends its time (GPU numbers go to
benchmarks/RESULTS_gpu.md through gpu_check.py, CPU numbers to RESULTS_throughput.md; tests never
assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_throughput.py [--num-layers 4 --hidden-size 256 \
        --num-attention-heads 8 --seq-length 256 --micro-batch-size 8 --vocab-size 8192] \
        [--microbatches 1 4] [--contestants megalite megalite-compile megalite-compile-decoder megalite-unfused \
        transformers nanogpt nanogpt-compile] \
        [--steps 10] [--threads N] [--bf16] [--device cpu|cuda] [--profile] [--json out.json]

The same GPT (pre-LN, learned positions, LayerNorm, GeLU, biases, tied embeddings, dropout 0) is
trained by every contestant on the same token batch; one step each in turn, so a machine shared
with other jobs slows all of them alike and the per-round ratios stay meaningful. A step is
`--microbatches` micro-batches of `--micro-batch-size` sequences (gradient accumulation), then
clipping at 1.0 and AdamW:

- megalite: training.train_step() of pretrain_gpt.py's own loop (mock data, one process): fp32
  gradient buffer and master weights with --bf16, fused AdamW, clipping by the global norm, LR
  schedule; `megalite-compile-decoder`: --compile --compile-scope decoder (the layer stack as one
  region); `megalite-compile`: the same with --compile (each transformer layer and the loss's
  passes compiled by Inductor);
- transformers: GPT2LMHeadModel (attn_implementation="sdpa"), parameters in the run's dtype (bf16
  with --bf16, no fp32 masters), torch AdamW (fused where the device has it), clip_grad_norm_;
- nanogpt: a nanoGPT-style model written here in plain PyTorch (causal SDPA, fp32 parameters
  under bf16 autocast with --bf16, as nanoGPT trains), fused AdamW, clip_grad_norm_;
  `nanogpt-compile`: the same under torch.compile.

Reported per number of micro-batches: tokens/s (min / median / max over the timed steps) in wall
time (and on CPU in this process's CPU time), the median of the per-round speed ratios against
transformers, model TFLOP/s by Megatron-LM's formula (megalite.runtime.metrics; the same model,
so the same FLOPs for all), and MFU against two peaks: the device's table value for the dtype
(CUDA, megalite.runtime.metrics) and a matrix multiply timed in this run (8192^3 on CUDA, 2048^3
on CPU, in the run's dtype). --profile adds a torch.profiler look at megalite's step: host (CPU)
time and device time per step, kernel launches per step, the ops taking most host and device
time, and the host time by category.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

CONTESTANTS = ("megalite", "megalite-compile", "megalite-compile-decoder", "megalite-unfused", "transformers", "nanogpt",
               "nanogpt-compile")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- contestants -------------------------------------------------------------------------------------
def megalite_flags(a, compile_scope: str | None, microbatches: int, fusion: bool = True) -> list[str]:
    """pretrain_gpt.py's flags for this measurement; `compile_scope`: None (eager) or --compile-scope's value."""
    flags = ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-layers", str(a.num_layers),
             "--hidden-size", str(a.hidden_size), "--num-attention-heads", str(a.num_attention_heads),
             "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size * microbatches), "--train-iters", "1000000",
             "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "1.0",
             "--eval-iters", "0", "--log-interval", "1000000", "--make-vocab-size-divisible-by", "128",
             "--distributed-backend", "nccl" if a.device == "cuda" else "gloo"]
    if a.bf16:
        flags.append("--bf16")
    if compile_scope:
        flags += ["--compile", "--compile-scope", compile_scope]
    # the fusions Megatron-LM's scripts run with (gradient accumulation's is the default): without
    # them, the weight gradients go through autograd's .grad and the buffer's hook, and the loss's
    # passes over bf16 logits run eagerly (megalite-unfused)
    flags.append("--cross-entropy-loss-fusion" if fusion else "--no-gradient-accumulation-fusion")
    return flags


class Megalite:
    def __init__(self, a, compile_scope: str | None, fusion: bool = True):
        from megalite.arguments import parse_args, validate_args
        from megalite.training import setup
        self.name = ({None: "megalite", "layer": "megalite --compile"}.get(compile_scope)
                     or f"megalite --compile-scope {compile_scope}") + ("" if fusion else " unfused")
        self.args = validate_args(parse_args(megalite_flags(a, compile_scope, max(a.microbatches), fusion)), 1)
        self.run = setup(self.args)
        self.micro_batch_size = a.micro_batch_size

    def step(self, microbatches: int) -> float:
        from megalite.training import train_step
        # the global batch of this measurement (mock data yields as many micro-batches as asked)
        gb = self.micro_batch_size * microbatches
        self.run.batch = types.SimpleNamespace(current_global_batch_size=lambda consumed: gb)
        return train_step(self.run)["lm_loss"]


class _Optimized:
    """A plain-PyTorch contestant's step: accumulate, clip at 1.0, AdamW."""

    def _setup(self, model, a, device):
        from megalite.optimizer.optimizer import _torch_fused_supported
        self.model = model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01,
                                     fused=_torch_fused_supported(device))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g).to(device)
        self.ids, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(self, microbatches: int) -> float:
        total = 0.0
        for _ in range(microbatches):
            loss = self.loss() / microbatches
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total)


class HFGPT2(_Optimized):
    name = "transformers GPT2LMHeadModel"

    def __init__(self, a, device, dtype):
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=a.vocab_size, n_positions=a.seq_length, n_embd=a.hidden_size,
                         n_layer=a.num_layers, n_head=a.num_attention_heads, n_inner=4 * a.hidden_size,
                         activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=1e-5)
        torch.manual_seed(0)
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=dtype)
        model.train()
        self._setup(model, a, device)

    def loss(self):
        logits = self.model(self.ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), self.labels.flatten())


class _NanoBlock(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPTModel(nn.Module):
    """nanoGPT's GPT (Karpathy's model.py, written anew): token + position embeddings, pre-LN blocks,
    tied output layer."""

    def __init__(self, layers, h, heads, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(_NanoBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class NanoGPT(_Optimized):
    def __init__(self, a, device, dtype, compile_: bool):
        self.name = "nanoGPT-style --compile" if compile_ else "nanoGPT-style"
        torch.manual_seed(0)
        model = NanoGPTModel(a.num_layers, a.hidden_size, a.num_attention_heads, a.vocab_size, a.seq_length).to(device)
        self._setup(model, a, device)
        self.forward = torch.compile(model) if compile_ else model
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def loss(self):
        with self.autocast:
            return self.forward(self.ids, self.labels)


# -- peak ----------------------------------------------------------------------------------------------
def matmul_tflops(device, dtype, n: int | None = None, reps: int = 5) -> float:
    """Best-of-`reps` rate of an n x n x n matrix multiply on this device and thread count (on CPU
    timed in this process's CPU time, which other jobs' load does not stretch)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    x, y = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    x @ y
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = clock()
        x @ y
        sync(device)
        best = min(best, clock() - t)
    return 2 * n**3 / best / 1e12


# -- profile -------------------------------------------------------------------------------------------
CATEGORIES = ["matrix multiplies", "attention", "norms and activations", "loss", "gradient-buffer copies",
              "optimizer", "other tensor ops", "Python overhead"]
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
          "aten::_addmm_activation", "mkldnn", "aten::_mkl")
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "flash_attn", "cudnn_attention")
NORM_ACT = ("layer_norm", "rms_norm", "gelu", "silu", "native_layer_norm")
MARKERS = {"megalite::loss": "loss", "_VocabParallelCrossEntropyBackward": "loss",
           "megalite::grad_buffer": "gradient-buffer copies", "megalite::optimizer": "optimizer"}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaLaunchKernelExC")


def _category(event) -> str | None:
    """The category of an op from its own name or its nearest marked ancestor."""
    e = event
    while e is not None:
        for marker, cat in MARKERS.items():
            if marker in e.name:
                return cat
        e = e.cpu_parent
    name = event.name
    if any(k in name for k in ATTENTION):
        return "attention"
    if any(k in name for k in MATMUL):
        return "matrix multiplies"
    if any(k in name for k in NORM_ACT) or "CompiledFxGraph" in name or name.startswith(("cpp_fused", "triton_")):
        return "norms and activations"  # --compile: Inductor's fused kernels
    return "other tensor ops"


def profile_steps(contestant, steps: int, microbatches: int) -> dict:
    """Per step: wall time, host (CPU) time inside ops and by category, device time, kernel launches,
    aten ops, and the top ops by host and by device time."""
    from torch.profiler import ProfilerActivity, profile, record_function
    device = contestant.run.state.device
    optimizer = contestant.run.state.optimizer
    step = optimizer.step

    def marked_step(*args, **kwargs):  # the update, clipping and the grad-norm included
        with record_function("megalite::optimizer"):
            return step(*args, **kwargs)
    optimizer.step = marked_step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    try:
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                contestant.step(microbatches)
            sync(device)
            wall = time.perf_counter() - t
    finally:
        optimizer.step = step
    totals = collections.defaultdict(float)
    inside_ops, launches, aten, device_s = 0.0, 0, 0, 0.0
    for e in prof.events():
        if e.device_type.name != "CPU":  # a kernel or copy on the device: its own interval there
            device_s += e.time_range.elapsed_us() / 1e6
            continue
        if e.name in LAUNCHES:
            launches += 1
        if e.name.startswith("aten::"):
            aten += 1
        totals[_category(e)] += e.self_cpu_time_total / 1e6
        if e.cpu_parent is None:
            inside_ops += e.cpu_time_total / 1e6
    totals["Python overhead"] = max(0.0, wall - inside_ops)
    averages = prof.key_averages()
    top_host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:8]
    top_device = sorted(averages, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:8]
    return ({k: totals.get(k, 0.0) / steps for k in CATEGORIES}
            | {"wall": wall / steps, "host_in_ops": inside_ops / steps, "device": device_s / steps,
               "kernel_launches": launches / steps, "aten_ops": aten / steps,
               "top_host": [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in top_host],
               "top_device": [(e.key, getattr(e, "self_device_time_total", 0.0) / 1e3 / steps, e.count / steps)
                              for e in top_device if getattr(e, "self_device_time_total", 0.0) > 0]})


def install_markers() -> None:
    """record_function ranges around the loss and the gradient-buffer hook (before any model is
    built: the hook is bound at construction), so their ops count for them; a range costs a few
    microseconds when no profiler runs."""
    import megalite.model.gpt as gpt
    from torch.profiler import record_function
    from megalite.distributed.grad_buffer import GradBuffer

    loss_fn, accumulate = gpt.vocab_parallel_cross_entropy, GradBuffer._accumulate

    def marked_loss(*args, **kwargs):
        with record_function("megalite::loss"):
            return loss_fn(*args, **kwargs)

    def marked_accumulate(self, p):
        with record_function("megalite::grad_buffer"):
            return accumulate(self, p)
    gpt.vocab_parallel_cross_entropy = marked_loss
    GradBuffer._accumulate = marked_accumulate


# -- main ----------------------------------------------------------------------------------------------
def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{model} ({os.cpu_count()} logical CPUs visible){gpu}"


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def build(a, device, dtype) -> list:
    make = {"megalite": lambda: Megalite(a, None), "megalite-compile": lambda: Megalite(a, "layer"),
            "megalite-compile-decoder": lambda: Megalite(a, "decoder"),
            "megalite-unfused": lambda: Megalite(a, None, fusion=False),
            "transformers": lambda: HFGPT2(a, device, dtype), "nanogpt": lambda: NanoGPT(a, device, dtype, False),
            "nanogpt-compile": lambda: NanoGPT(a, device, dtype, True)}
    return [make[name]() for name in a.contestants]


def measure(contestants, a, device, microbatches: int) -> dict:
    """Warm-up (--compile compiles here), then --steps rounds of one step per contestant."""
    from megalite.model.compile import compile_report, compile_seconds
    compile_s = {}
    for c in contestants:
        before = compile_seconds() or 0.0
        t = time.perf_counter()
        for _ in range(a.warmup):
            c.step(microbatches)
        sync(device)
        if "compile" in c.name:
            compile_s[c.name] = (compile_seconds() or 0.0) - before
            print(f"{c.name} ({microbatches} micro-batches): warm-up {time.perf_counter() - t:.1f} s; "
                  f"{compile_report()}", flush=True)
    times = {c.name: [] for c in contestants}
    cpu_times = {c.name: [] for c in contestants}
    losses = {c.name: [] for c in contestants}
    for _ in range(a.steps):
        for c in contestants:
            sync(device)
            t, ct = time.perf_counter(), time.process_time()
            losses[c.name].append(c.step(microbatches))
            sync(device)
            times[c.name].append(time.perf_counter() - t)
            cpu_times[c.name].append(time.process_time() - ct)
    return {"times": times, "cpu_times": cpu_times, "losses": losses, "compile_s": compile_s}


def report(m: dict, contestants, a, device, microbatches, flops, peaks) -> dict:
    tokens = a.micro_batch_size * a.seq_length * microbatches
    ref = next((c.name for c in contestants if c.name.startswith("transformers")), None)
    out = {}
    for clock, per_step in (("wall", m["times"]), ("cpu", m["cpu_times"])):
        if clock == "cpu" and device.type != "cpu":
            continue
        print(f"\n{microbatches} micro-batch(es) of {a.micro_batch_size} x {a.seq_length}, {clock} time:")
        print(f"{'contestant':34s} {'tokens/s min / median / max':>34s} {'TFLOP/s':>8s} "
              f"{'MFU table':>9s} {'MFU gemm':>9s} {'vs transformers':>16s}")
        for c in contestants:
            ts = per_step[c.name]
            tps = sorted(tokens / t for t in ts)
            tflops = flops / statistics.median(ts) / 1e12
            ratios = [h / x for x, h in zip(ts, per_step[ref])] if ref else []
            row = {"tokens_per_s": {"min": tps[0], "median": statistics.median(tps), "max": tps[-1]},
                   "tflops": tflops, "mfu_table": tflops / peaks["table"] if peaks["table"] else None,
                   "mfu_gemm": tflops / peaks["gemm"], "compile_s": m["compile_s"].get(c.name),
                   "speed_ratio_vs_transformers_median": statistics.median(ratios) if ratios else None,
                   "loss_first_last": [m["losses"][c.name][0], m["losses"][c.name][-1]]}
            out.setdefault(c.name, {})[clock] = row
            cells = [f"{row['mfu_table']:.1%}" if row["mfu_table"] else "-", f"{row['mfu_gemm']:.1%}",
                     f"{row['speed_ratio_vs_transformers_median']:.2f}x" if ratios else "-"]
            print(f"{c.name:34s} {tps[0]:12.0f} / {statistics.median(tps):8.0f} / {tps[-1]:8.0f} {tflops:8.3f} "
                  f"{cells[0]:>9s} {cells[1]:>9s} {cells[2]:>16s}", flush=True)
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1], help="micro-batches per step, each measured")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--contestants", nargs="+", default=["megalite", "megalite-compile", "transformers"],
                   choices=CONTESTANTS)
    p.add_argument("--steps", type=int, default=10, help="timed steps per contestant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant (compilation happens here)")
    p.add_argument("--profile", action="store_true", help="profile megalite's steps too")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="CPU threads of every contestant (torch.set_num_threads; "
                   "default: OMP_NUM_THREADS or torch's own choice)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.vocab_size % 128:
        p.error("--vocab-size must be a multiple of 128 (megalite pads to one; every model must match)")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    if min(a.microbatches) < 1 or a.steps < 1:
        p.error("--microbatches and --steps must be at least 1")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; commit {commit()}",
          flush=True)
    from megalite.runtime.metrics import num_floating_point_operations, peak_tflops
    peaks = {"gemm": matmul_tflops(device, dtype), "table": peak_tflops(None, dtype) if device.type == "cuda" else None}
    install_markers()
    contestants = build(a, device, dtype)
    first = next((c for c in contestants if isinstance(c, Megalite)), None)
    config = first.run.state.model_config if first else None
    if config is None:  # the same model's FLOPs without building megalite's
        from megalite.arguments import parse_args, validate_args
        from megalite.initialize import resolve_vocab
        config = resolve_vocab(validate_args(parse_args(megalite_flags(a, None, 1)), 1))[0]
    result = {"machine": machine(), "commit": commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "config": vars(a), "peak_tflops": peaks, "by_microbatches": {}, "profile": {}}
    print(f"peak: table {peaks['table']} TFLOP/s, measured matrix multiply {peaks['gemm']:.3f} TFLOP/s", flush=True)
    for m in a.microbatches:
        flops = num_floating_point_operations(config, a.micro_batch_size) * m
        measured = measure(contestants, a, device, m)
        result["by_microbatches"][str(m)] = {"flops_per_step": flops,
                                             "contestants": report(measured, contestants, a, device, m, flops, peaks)}
        for ours in (c for c in contestants if a.profile and isinstance(c, Megalite)):
            prof = profile_steps(ours, a.profile_steps, m)
            result["profile"][f"{ours.name}, {m}"] = prof
            print(f"\nprofile of {ours.name}'s step, {m} micro-batch(es): wall {prof['wall'] * 1e3:.1f} ms, host in ops "
                  f"{prof['host_in_ops'] * 1e3:.1f} ms, device {prof['device'] * 1e3:.1f} ms, "
                  f"{prof['kernel_launches']:.0f} kernel launches, {prof['aten_ops']:.0f} aten ops")
            for k in CATEGORIES:
                print(f"  {k:26s} {prof[k] * 1e3:9.1f} ms host")
            print("  top host: " + "; ".join(f"{n} {t:.2f} ms x{c:.0f}" for n, t, c in prof["top_host"]))
            print("  top device: " + "; ".join(f"{n[:60]} {t:.2f} ms x{c:.0f}" for n, t, c in prof["top_device"]),
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
