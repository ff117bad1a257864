"""The pipeline schedule's part of a plan: the bubble, the micro-batches each rank holds, and which
rank computes the loss.

1F1B and interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2): bubble (p - 1) / (v·m + p - 1). The
zero-bubble schedules (zb_h1, zbv: pipeline_parallel/zb_plan.py): the plan times the orders the
runtime follows on unit costs (T_F = T_B = T_W, the paper's setting; ZB-H1 with m >= p gives
(p - 1) / (3m + p - 1)) and reports their idle share, and counts as held the most chunk
micro-batches a rank keeps between F and W in that order (B frees most of a micro-batch's
activations; the rest, the linears' inputs and output gradients for W, are counted whole: an
upper bound).
"""
from __future__ import annotations

from ..pipeline_parallel import zb_plan

# --pipeline-schedule names (pipeline_parallel/schedules.py's registry) of the zero-bubble schedules,
# with whether they place chunks in a V
ZERO_BUBBLE = {"zb_h1": False, "zbv": True}


def schedule_name(c) -> str:
    p = c.parallel
    if p.pipeline_schedule:
        return p.pipeline_schedule
    if p.pipeline_model_parallel_size == 1:
        return "no_pipelining"
    return "interleaved_1f1b" if p.virtual_pipeline_model_parallel_size > 1 else "1f1b"


def v_shaped(c) -> bool:
    return ZERO_BUBBLE.get(schedule_name(c), False)


def loss_rank(c) -> int:
    """The pipeline rank whose last chunk holds the output layer and the loss."""
    return 0 if v_shaped(c) else c.parallel.pipeline_model_parallel_size - 1


def is_post_process(c, pp_rank: int, chunk: int) -> bool:
    return pp_rank == loss_rank(c) and chunk == c.parallel.virtual_pipeline_model_parallel_size - 1


def bubble(c) -> tuple[float, str]:
    """(idle share of an iteration, how it was found)."""
    p, v, m = (c.parallel.pipeline_model_parallel_size, c.parallel.virtual_pipeline_model_parallel_size,
               c.training.num_microbatches)
    name = schedule_name(c)
    if name in ZERO_BUBBLE:
        return (zb_plan.bubble_fraction(p, m, ZERO_BUBBLE[name]) if p > 1 else 0.0,
                f"{name}'s order on unit F = B = W costs, p={p}, m={m}")
    return (p - 1) / (v * m + p - 1), f"(p-1)/(v*m+p-1) = {p - 1}/({v}*{m}+{p - 1})"


def zero_bubble_in_flight(c, pp_rank: int) -> int | None:
    """Chunk micro-batches held at the peak under a zero-bubble schedule (None for the others)."""
    name = schedule_name(c)
    if name not in ZERO_BUBBLE or c.parallel.pipeline_model_parallel_size == 1:
        return None
    return zb_plan.peak_held(c.parallel.pipeline_model_parallel_size, c.training.num_microbatches,
                             ZERO_BUBBLE[name])[pp_rank]
