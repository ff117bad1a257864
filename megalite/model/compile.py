"""torch.compile of the transformer layers (--compile, --compile-scope).

Modules are compiled in place (`nn.Module.compile`), so parameter names, and with them
initialisation and checkpoints, do not change. Two scopes:
- `layer` (the default, torchtitan's choice): each TransformerLayer. The layers run the same code
  on the same shapes, so Dynamo traces one graph and Inductor compiles it once (forward and
  backward) for every layer of every chunk: compile time does not grow with depth. Each call of a
  compiled region costs host time, though (guards, AOTAutograd's autograd.Function, the Python
  wrapper that launches the kernels): ~0.5 ms per layer per pass on an H200's host
  (benchmarks/RESULTS_gpu.md), which made a GPT-2 125M step host-bound where nanoGPT, compiled as
  one region, is not;
- `decoder`: each chunk's TransformerBlock (its layers and final norm) as one region: Dynamo
  unrolls the layers into one graph per chunk, so a micro-batch pays one forward and one backward
  call; Inductor compiles a graph as long as the stack (longer compiles). Full recompute is
  refused with it (its checkpoint runs eagerly, so the layers inside would not be compiled).
The embedding, the vocabulary-parallel loss's own code, recompute of whole chunks and the
pipeline schedule stay eager; the loss's two passes over 16-bit logits are compiled apart
(tensor_parallel/cross_entropy.py `compiled_loss_kernels`: one fused kernel each instead of a few
per slice of rows).
Inside a layer Inductor fuses what sits between the matrix multiplies (norm, residual add,
dropout, rotary, GeLU / SwiGLU), which PyTorch's eager fused kernels cover only op by op
(PyTorch 2 paper, Ansel et al. 2024, Sec. 4-5).

What Dynamo makes of the rest of megalite (torch 2.13, tests/test_compile.py):
- one process, no recompute: each layer is one graph, 0 graph breaks;
- tensor parallelism: the f/g autograd Functions call torch.distributed, which Dynamo does not
  trace inside an autograd.Function, so each runs eagerly and splits the layer's graph around
  it (a 2-layer TP=2 + SP run logs 16 graph breaks); results are unchanged;
- recompute() is excluded from tracing (its checkpoint passes a context_fn, which Dynamo's
  checkpoint operator rejects): under selective recompute core attention runs eagerly, under
  full recompute the compiled layers run inside the eager checkpoint;
- dropout > 0: masks inside compiled graphs come from Inductor's generator, not eager's, so
  losses differ from an eager run by dropout noise; the RNG tracker's fork (attention dropout
  under TP) reads and sets generator states, which Dynamo leaves to eager code.
"""
from __future__ import annotations


def compile_layers(chunks, backend: str = "inductor", scope: str = "layer") -> int:
    """Compile the transformer layers of `chunks` (GPTModel instances) in place, each layer
    (`scope` "layer") or each chunk's layer stack ("decoder"); returns how many layers that covers.
    Compilation itself happens lazily, on the first forward and backward."""
    from ..tensor_parallel.cross_entropy import compiled_loss_kernels
    if scope not in ("layer", "decoder"):
        raise ValueError(f"compile scope must be 'layer' or 'decoder', got {scope!r}")
    n = 0
    kernels = compiled_loss_kernels(backend)
    for chunk in chunks:
        if scope == "decoder":
            chunk.decoder.compile(backend=backend, dynamic=False)
        else:
            for layer in chunk.decoder.layers:
                layer.compile(backend=backend, dynamic=False)
        n += len(chunk.decoder.layers)
        chunk.loss_kernels = kernels
    return n


def compile_seconds() -> float | None:
    """Wall time Dynamo and the backend have spent compiling so far in this process (forward
    frames and lazily compiled backward graphs), or None where torch does not report it."""
    try:
        from torch._dynamo.utils import calculate_time_spent
        return calculate_time_spent().get("total_wall_time")
    except Exception:  # noqa: BLE001 - a private helper that may move between torch versions
        return None


def graph_breaks() -> int:
    """Graph breaks Dynamo has recorded in this process (each splits a compiled region)."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def compile_report() -> str:
    """One line for the log after the first step: compile time and graph breaks so far."""
    seconds = compile_seconds()
    spent = f"{seconds:.1f} s compiling" if seconds is not None else "compile time not reported by this torch"
    return f"{spent} (forward and backward, during the first iteration), {graph_breaks()} graph breaks"
