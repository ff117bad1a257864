"""Checks of --cp-comm-type and --hierarchical-context-parallel-sizes (context_parallel/__init__.py):
what each communication type needs of the head counts and the model, refused before any process
group exists."""
from __future__ import annotations

import math

from ..config.fields import flat_ints
from ..config.run import RunConfig
from .errors import fail

TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def check_cp_comm_type(c: RunConfig) -> None:
    """One type or one per layer; a2a's head split; the hierarchy's sizes; what p2p cannot run."""
    p, m = c.parallel, c.model
    types = list(p.cp_comm_type)
    if len(types) not in (1, m.num_layers):
        fail(f"--cp-comm-type takes one type or one per layer (--num-layers {m.num_layers}); got {len(types)}")
    sizes = p.hierarchical_context_parallel_sizes = flat_ints(p.hierarchical_context_parallel_sizes)
    if sizes is not None:
        if "a2a+p2p" not in types:
            fail("--hierarchical-context-parallel-sizes is used only by --cp-comm-type a2a+p2p; drop it or add that type")
        if len(sizes) != 2 or min(sizes) < 1 or math.prod(sizes) != p.context_parallel_size:
            fail(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: need two sizes (a2a level, p2p "
                 f"level) whose product is --context-parallel-size ({p.context_parallel_size})")
    elif "a2a+p2p" in types:
        fail("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (A x P = --context-parallel-size): "
             "A ranks exchange heads, P pass keys/values around a ring")
    if p.context_parallel_size == 1 or set(types) == {"allgather"}:
        return
    other = sorted(set(types) - {"allgather"})
    if m.multi_latent_attention:
        fail(f"--cp-comm-type {' '.join(other)}: multi-latent attention (--multi-latent-attention) under context "
             f"parallelism runs allgather only; use --cp-comm-type allgather")
    if m.softmax_type != "vanilla":
        fail(f"--cp-comm-type {' '.join(other)} cannot run --softmax-type {m.softmax_type} (a per-head sink logit); "
             f"use --cp-comm-type allgather")
    ring = [t for t in other if "p2p" in t]
    if ring and c.kernels.attention_backend != "auto":
        c.notices.append(f"--attention-backend {c.kernels.attention_backend}: --cp-comm-type {ring[0]} layers attend "
                         f"with the ring's own blockwise softmax in fp32 (context_parallel/ring.py)")
    if ring and m.attention_dropout > 0:
        fail(f"--cp-comm-type {ring[0]}: ring attention here has no attention dropout (it recomputes each block's "
             f"probabilities in backward); set --attention-dropout 0 or use --cp-comm-type a2a / allgather")
    a2a = {"a2a": p.context_parallel_size, "a2a+p2p": (sizes or [1])[0]}
    for t in other:
        if t in a2a:
            check_head_split(c, t, a2a[t])


def check_head_split(c: RunConfig, comm_type: str, a: int) -> None:
    """Ulysses all-to-all over `a` ranks: each takes 1/a of this TP rank's query heads, and of its
    key/value heads (replicated when there are fewer than a of them)."""
    m, tp = c.model, c.parallel.tensor_model_parallel_size
    heads = m.num_attention_heads // tp
    groups = (m.num_query_groups or m.num_attention_heads) // tp if m.group_query_attention else heads
    if heads % a:
        fail(f"--cp-comm-type {comm_type}: --num-attention-heads ({m.num_attention_heads}) / TP ({tp}) = {heads} "
             f"heads per rank cannot split over the {a} all-to-all ranks")
    if groups % a and a % groups:
        fail(f"--cp-comm-type {comm_type}: --num-query-groups ({groups * tp}) / TP ({tp}) = {groups} key/value heads "
             f"per rank neither split over nor divide the {a} all-to-all ranks")
