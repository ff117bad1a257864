"""Training throughput of megalite next to Hugging Face transformers' GPT2LMHeadModel, and where
megalite's step spends its time (numbers go to benchmarks/RESULTS_throughput.md; tests never
assert on them).

    OMP_NUM_THREADS=1 python benchmarks/bench_throughput.py [--num-layers 4 --hidden-size 256 \
        --num-attention-heads 8 --seq-length 256 --micro-batch-size 8 --vocab-size 8192] \
        [--steps 10] [--threads N] [--bf16] [--device cpu|cuda] [--no-compile] [--json out.json]

The same GPT (pre-LN, learned positions, LayerNorm, GeLU, tied embeddings, dropout 0, fp32
unless --bf16) is trained by three contestants, one step each in turn, so a machine shared with
other jobs slows all of them alike and the per-round ratios stay meaningful:

- megalite: training.train_step() of pretrain_gpt.py's own loop (mock data, one process):
  fp32 gradient buffer, fused AdamW, clipping by the global norm, LR schedule;
- megalite --compile: the same with every transformer layer compiled by torch.compile (Inductor);
- transformers: GPT2LMHeadModel (attn_implementation="sdpa"), torch AdamW (fused where the
  device has it), clip_grad_norm_, the same token batch.

Reported: tokens/s (min / median / max over the timed steps) per contestant, in wall time and,
on CPU, in this process's CPU time (one thread: the time the step really computed, which other
jobs on a shared machine do not stretch), the median of the per-round speed ratios, model TFLOP/s by Megatron-LM's formula (megalite.runtime.metrics; the same model, so
the same FLOPs for all), and MFU against the device's peak: on CUDA the bf16 table value
(megalite.runtime.metrics), on CPU the fp32 (or bf16) matrix-multiply rate measured in this run on the
same threads. Then a torch.profiler profile of megalite's step, eager and compiled, with each
op's self time put in one category: matrix multiplies, attention, norms and activations, loss,
gradient-buffer copies, optimizer, other tensor ops, and Python overhead (step wall time not
spent inside any op).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- contestants -------------------------------------------------------------------------------------
def megalite_flags(a, compile_: bool) -> list[str]:
    flags = ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-layers", str(a.num_layers),
             "--hidden-size", str(a.hidden_size), "--num-attention-heads", str(a.num_attention_heads),
             "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size), "--train-iters", "1000000", "--lr", "1e-4",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "1.0", "--eval-iters", "0",
             "--make-vocab-size-divisible-by", "128", "--distributed-backend", "nccl" if a.device == "cuda" else "gloo"]
    if a.bf16:
        flags.append("--bf16")
    if compile_:
        flags.append("--compile")
    return flags


class Megalite:
    def __init__(self, a, compile_: bool):
        from megalite.arguments import parse_args, validate_args
        from megalite.training import setup
        self.name = "megalite --compile" if compile_ else "megalite"
        self.args = validate_args(parse_args(megalite_flags(a, compile_)), 1)
        self.run = setup(self.args)

    def step(self) -> float:
        from megalite.training import train_step
        return train_step(self.run)["lm_loss"]


class HFGPT2:
    name = "transformers GPT2LMHeadModel"

    def __init__(self, a, device, dtype):
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=a.vocab_size, n_positions=a.seq_length, n_embd=a.hidden_size,
                         n_layer=a.num_layers, n_head=a.num_attention_heads, n_inner=4 * a.hidden_size,
                         activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=1e-5)
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=dtype)
        self.model.train()
        from megalite.optimizer.optimizer import _torch_fused_supported
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01,
                                     fused=_torch_fused_supported(device))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g).to(device)
        self.ids, self.labels = tokens[:, :-1], tokens[:, 1:]

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


# -- peak ----------------------------------------------------------------------------------------------
def matmul_tflops(device, dtype, n=2048, reps=5) -> float:
    """Best-of-`reps` rate of an n x n x n matrix multiply on this device and thread count (on
    CPU timed in this process's CPU time, which other jobs' load does not stretch)."""
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
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "flash_attn")
NORM_ACT = ("layer_norm", "rms_norm", "gelu", "silu", "native_layer_norm")
MARKERS = {"megalite::loss": "loss", "_VocabParallelCrossEntropyBackward": "loss",
           "megalite::grad_buffer": "gradient-buffer copies", "megalite::optimizer": "optimizer"}


def _category(event) -> str | None:
    """The category of an op from its own name or its nearest marked ancestor (None: a wrapper)."""
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
    if any(k in name for k in NORM_ACT):
        return "norms and activations"
    if "CompiledFxGraph" in name or name.startswith(("cpp_fused", "triton_")):
        # --compile: Inductor's fused kernels (norms, activations, residual adds, rotary); the
        # GEMMs inside a compiled graph are still aten::mm and counted as such
        return "norms and activations"
    return "other tensor ops"


def profile_steps(contestant, steps: int) -> dict:
    """Seconds per step in each category, from torch.profiler's per-op self times."""
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
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            contestant.step()
        sync(device)
        wall = time.perf_counter() - t
    optimizer.step = step
    totals = collections.defaultdict(float)
    other = collections.Counter()  # what "other tensor ops" holds, by op name
    inside_ops = 0.0
    for e in prof.events():
        if e.device_type.name != "CPU":
            continue
        cat = _category(e)
        totals[cat] += e.self_cpu_time_total / 1e6
        if cat == "other tensor ops":
            other[e.name] += e.self_cpu_time_total / 1e6 / steps
        if e.cpu_parent is None:
            inside_ops += e.cpu_time_total / 1e6
    totals["Python overhead"] = max(0.0, wall - inside_ops)
    return ({k: totals.get(k, 0.0) / steps for k in CATEGORIES} | {"wall": wall / steps}
            | {"other_top": other.most_common(8)})


def install_markers() -> None:
    """record_function ranges around the loss and the gradient-buffer hook (before any model is
    built: the hook is bound at construction), so their ops count for them; a range costs a
    few microseconds when no profiler runs."""
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="timed steps per contestant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant (compilation happens here)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="CPU threads of every contestant (torch.set_num_threads; "
                   "default: OMP_NUM_THREADS or torch's own choice)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    if a.vocab_size % 128:
        p.error("--vocab-size must be a multiple of 128 (megalite pads to one; both models must match)")
    if a.threads is not None:
        if a.threads < 1:
            p.error("--threads must be at least 1")
        torch.set_num_threads(a.threads)

    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; commit {commit()}")
    peak = matmul_tflops(device, dtype) if device.type == "cpu" else None
    install_markers()
    contestants = [Megalite(a, False)] + ([Megalite(a, True)] if a.compile else []) + [HFGPT2(a, device, dtype)]
    if device.type == "cuda":
        from megalite.runtime.metrics import peak_tflops
        peak = peak_tflops(contestants[0].args)
    from megalite.runtime.metrics import num_floating_point_operations
    flops = num_floating_point_operations(contestants[0].run.state.model_config, a.micro_batch_size)
    tokens = a.micro_batch_size * a.seq_length

    compile_s = None
    for c in contestants:  # warm-up; --compile compiles during its first step
        t = time.perf_counter()
        for _ in range(a.warmup):
            c.step()
        if "compile" in c.name:
            from megalite.model.compile import compile_report, compile_seconds
            compile_s = compile_seconds()
            print(f"{c.name}: warm-up {time.perf_counter() - t:.1f} s; {compile_report()}")
    times = {c.name: [] for c in contestants}
    cpu_times = {c.name: [] for c in contestants}  # this process's CPU seconds: what other jobs' load leaves out
    losses = {c.name: [] for c in contestants}
    for _ in range(a.steps):  # one step each, in turn
        for c in contestants:
            sync(device)
            t, ct = time.perf_counter(), time.process_time()
            losses[c.name].append(c.step())
            sync(device)
            times[c.name].append(time.perf_counter() - t)
            cpu_times[c.name].append(time.process_time() - ct)

    hf = contestants[-1].name
    result = {"machine": machine(), "commit": commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "config": vars(a), "flops_per_step": flops, "peak_tflops": peak, "compile_s": compile_s,
              "contestants": {}}
    print(f"\nmodel FLOPs per step {flops / 1e9:.1f} GFLOP; peak {'(measured matmul) ' if device.type == 'cpu' else ''}"
          f"{peak if peak is None else f'{peak:.3f}'} TFLOP/s")
    for clock, per_step in (("wall", times), ("cpu", cpu_times)):
        if clock == "cpu" and device.type != "cpu":
            continue
        print(f"\n{'contestant':30s} {'tokens/s (' + clock + ' time) min / median / max':>40s} {'TFLOP/s':>8s} "
              f"{'MFU':>6s} {'vs transformers':>16s}")
        for c in contestants:
            ts = per_step[c.name]
            tps = sorted(tokens / t for t in ts)
            tflops = flops / statistics.median(ts) / 1e12
            ratios = [h / m for m, h in zip(ts, per_step[hf])]  # per round; > 1: faster than transformers
            row = {"tokens_per_s": {"min": tps[0], "median": statistics.median(tps), "max": tps[-1]},
                   "tflops": tflops, "mfu": tflops / peak if peak else None,
                   "speed_ratio_vs_transformers_median": statistics.median(ratios),
                   "loss_first_last": [losses[c.name][0], losses[c.name][-1]]}
            result["contestants"].setdefault(c.name, {})[clock] = row
            mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
            print(f"{c.name:30s} {tps[0]:18.0f} / {statistics.median(tps):7.0f} / {tps[-1]:7.0f} {tflops:8.3f} "
                  f"{mfu:>6s} {statistics.median(ratios):15.2f}x")

    result["profile"] = {}
    for c in contestants[:-1]:
        prof = profile_steps(c, a.profile_steps)
        result["profile"][c.name] = prof
        print(f"\nprofile of one {c.name} step ({a.profile_steps} steps under torch.profiler, {prof['wall'] * 1e3:.0f} ms/step):")
        for k in CATEGORIES:
            print(f"  {k:26s} {prof[k] * 1e3:9.1f} ms  {prof[k] / prof['wall']:6.1%}")
        print("  other tensor ops, largest: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in prof["other_top"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
