"""Forward/backward over the micro-batches of one iteration.

A schedule takes the model chunks and, per chunk, an iterator of micro-batches (dicts from
data.batch.build_batch, already on the device); each chunk consumes the iteration's
micro-batches in order, at its own pace. The chunk that holds the loss (last stage, last
virtual chunk) returns per-token losses; the schedule sums them over the loss mask. Backward
runs on that sum x `backward_scale` (the loss scale over the nominal number of tokens in the
global batch), so gradients summed over micro-batches and DP ranks are those of the
global-batch mean loss. With `microbatch_mean` (Megatron-LM's default loss) the sum is first
divided by the micro-batch's own token count, and `backward_scale` is the loss scale over the
number of micro-batches in the global batch: the mean of the micro-batches' token means. A
schedule returns the per-micro-batch (loss_sum, num_tokens), as device tensors, on the last
stage and [] elsewhere.

Schedules (Narayanan et al. 2021, Sec. 2.2; zero-bubble: Qi et al. 2024, zero_bubble.py):
- no pipelining: gradient accumulation on one stage;
- 1F1B (PipeDream-Flush): min(p - rank - 1, m) warm-up forwards, then one forward / one
  backward, then cool-down backwards; at most p micro-batches' activations live at once;
- interleaved 1F1B: v model chunks per rank, bubble (p-1)/(v·m) instead of (p-1)/m;
- zb_h1: 1F1B's order and memory with each backward split into B and W, W filling the bubble;
- zbv: two chunks per rank in a V (rank 0 holds the first and the last), B and W split.
SCHEDULES names them ("no_pipelining", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"; "dualpipev"
is refused: not built); default_schedule_name
gives the one used when none is named, check_schedule what a named one needs of the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

from .p2p import PipeComm
from .step import Step as _Step, release
from .zero_bubble import forward_backward_zb_h1, forward_backward_zbv


def forward_backward_no_pipelining(batches, model, num_microbatches: int, backward_scale: float,
                                   forward_only: bool = False, microbatch_mean: bool = False, timeline=None, **_):
    """Gradient accumulation on one stage: forward and backward each micro-batch in turn."""
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean, timeline)
    for _ in range(num_microbatches):
        loss = step.forward(0, None)
        if not forward_only:
            step.backward(None, loss, None)
    return step.stats


def forward_backward_1f1b(batches, model, num_microbatches: int, backward_scale: float,
                          forward_only: bool = False, comm: PipeComm = None, microbatch_mean: bool = False,
                          timeline=None, **_):
    ps = comm.ps
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean, timeline)
    first, last = ps.is_first_stage, ps.is_last_stage
    m = num_microbatches
    num_warmup = m if forward_only else min(ps.pp_size - ps.pp_rank - 1, m)
    num_steady = m - num_warmup
    inputs, outputs = [], []

    def recv_forward():
        return None if first else comm.communicate(recv_prev=True)[0]

    for _ in range(num_warmup):
        x = recv_forward()
        y = step.forward(0, x)
        comm.communicate(send_next=None if last else y)
        if not forward_only:
            inputs.append(x)
            outputs.append(y)
            release(None if last else y)

    x = recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        y = step.forward(0, x)
        # send this activation, receive the gradient of the oldest one in flight
        _, dy = comm.communicate(send_next=None if last else y, recv_next=not last)
        inputs.append(x)
        outputs.append(y)
        release(None if last else y)
        x_old, y_old = inputs.pop(0), outputs.pop(0)
        dx = step.backward(x_old, y_old, dy)
        if i == num_steady - 1:
            comm.communicate(send_prev=None if first else dx)
        else:
            x, _ = comm.communicate(send_prev=None if first else dx, recv_prev=not first)

    if not forward_only:
        for _ in range(num_warmup):
            x_old, y_old = inputs.pop(0), outputs.pop(0)
            _, dy = comm.communicate(recv_next=not last)
            dx = step.backward(x_old, y_old, dy)
            comm.communicate(send_prev=None if first else dx)
    return step.stats


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each virtual micro-batch (Megatron-LM's get_schedule_table): the
    micro-batches in groups of g (--microbatch-group-size-per-virtual-pipeline-stage, default PP),
    each group run through chunk 0, then chunk 1, ...; the last group takes what remains."""
    out = []
    for start in range(0, m, g):
        end = min(start + g, m) if start + g < m else m
        out += [(mb, c) for c in range(v) for mb in range(start, end)]
    return out


class _Interleaved:
    """The bookkeeping of one interleaved iteration on one rank: per chunk, the queues of
    input activations, outputs and output gradients, and which chunk virtual micro-batch k
    runs on. Its three phases are the schedule's warm-up, steady state and cool-down."""

    def __init__(self, step: _Step, comm: PipeComm, v: int, m: int, forward_only: bool, group: int | None = None):
        ps = comm.ps
        self.step, self.comm, self.forward_only = step, comm, forward_only
        self.p, self.v, self.total = ps.pp_size, v, m * v
        g = group or self.p
        self.microbatch, self.table = zip(*schedule_table(m, v, g))
        # inputs of a chunk released (popped) so far: a rank may hold several received inputs of a
        # chunk ahead of its forwards (g > PP), indexed by micro-batch (Megatron-LM's offset)
        self.released = [0] * v
        self.first_rank, self.last_rank = ps.is_first_stage, ps.is_last_stage
        warmup = (self.p - ps.pp_rank - 1) * 2 + (v - 1) * g
        self.all_warmup = forward_only or (m == self.p if g == self.p else warmup >= self.total)
        self.num_warmup = self.total if self.all_warmup else min(warmup, self.total)
        self.num_steady = self.total - self.num_warmup
        self.inputs = [[] for _ in range(v)]
        self.outputs = [[] for _ in range(v)]
        self.output_grads = [[] for _ in range(v)]

    def chunk_of(self, k: int, forward: bool) -> int:
        c = self.table[k % self.total]
        return c if forward else self.v - 1 - c

    def is_first_virtual(self, c: int) -> bool:
        return self.first_rank and c == 0

    def is_last_virtual(self, c: int) -> bool:
        return self.last_rank and c == self.v - 1

    def forward_k(self, k: int):
        c = self.chunk_of(k, True)
        inputs, outputs = self.inputs[c], self.outputs[c]
        if self.is_first_virtual(c) and len(inputs) == len(outputs):
            inputs.append(None)
        i = self.microbatch[k % self.total] - self.released[c]
        y = self.step.forward(c, inputs[i])
        outputs.append(y)
        if self.forward_only:  # nothing to keep for a backward
            inputs.pop(i)
            outputs.pop()
            self.released[c] += 1
        return y

    def backward_k(self, k: int):
        c = self.chunk_of(k, False)
        if self.is_last_virtual(c) and not self.output_grads[c]:
            self.output_grads[c].append(None)
        self.released[c] += 1
        return self.step.backward(self.inputs[c].pop(0), self.outputs[c].pop(0), self.output_grads[c].pop(0), c)

    def warmup(self):
        """Forwards only."""
        comm, v = self.comm, self.v
        self.inputs[0].append(None if self.first_rank else comm.communicate(recv_prev=True)[0])
        for k in range(self.num_warmup):
            y = self.forward_k(k)
            c = self.chunk_of(k, True)
            recv_prev, next_c = self.next_chunk(k, True)
            recv_prev = recv_prev and k != self.total - 1
            send = None if self.is_last_virtual(c) else y
            if k == self.num_warmup - 1 and not self.all_warmup:
                x, dy = comm.communicate(send_next=send, recv_prev=recv_prev, recv_next=not self.last_rank)
                self.output_grads[v - 1].append(dy)
            else:
                x, _ = comm.communicate(send_next=send, recv_prev=recv_prev)
            if not self.forward_only:
                release(send)
            if recv_prev:
                self.inputs[next_c].append(x)

    def next_chunk(self, k: int, forward: bool) -> tuple[bool, int]:
        """After virtual micro-batch k (forward, or backward): whether an activation (gradient)
        comes from the previous stage (next one), and for which chunk (Megatron-LM's
        recv_tensor_from_previous_stage). The leading rank (the first in forward, the last in
        backward) runs p-1 virtual steps ahead of the ending one, whose chunk it continues."""
        p, v = self.p, self.v
        leading = self.first_rank if forward else self.last_rank
        if not leading:
            return True, self.chunk_of(k + 1, forward)
        if k < p - 1:  # the ending rank has produced nothing yet
            return False, self.chunk_of(k + 1, forward)
        c = self.chunk_of(k - (p - 1), forward)
        return c != (v - 1 if forward else 0), c + 1 if forward else c - 1

    def steady(self):
        """One forward, one backward."""
        for i in range(self.num_steady):
            fk, bk = i + self.num_warmup, i
            y = self.forward_k(fk)
            dx = self.backward_k(bk)
            send_y = None if self.is_last_virtual(self.chunk_of(fk, True)) else y
            send_dx = None if self.is_first_virtual(self.chunk_of(bk, False)) else dx
            recv_prev, next_fc = self.next_chunk(fk, True)
            recv_next, next_bc = self.next_chunk(bk, False)
            if i == self.num_steady - 1:
                recv_prev = False
            x, dy = self.comm.communicate(send_next=send_y, send_prev=send_dx, recv_prev=recv_prev,
                                          recv_next=recv_next)
            release(send_y)
            if recv_prev:
                self.inputs[next_fc].append(x)
            if recv_next:
                self.output_grads[next_bc].append(dy)

    def cooldown(self):
        """Backwards only."""
        comm, v = self.comm, self.v
        if self.all_warmup:
            self.output_grads[v - 1].append(None if self.last_rank else comm.communicate(recv_next=True)[1])
        for k in range(self.num_steady, self.total):
            dx = self.backward_k(k)
            bc = self.chunk_of(k, False)
            recv_next, next_bc = self.next_chunk(k, False)
            recv_next = recv_next and k != self.total - 1
            _, dy = comm.communicate(send_prev=None if self.is_first_virtual(bc) else dx, recv_next=recv_next)
            if recv_next:
                self.output_grads[next_bc].append(dy)


def forward_backward_interleaved(batches, model, num_microbatches: int, backward_scale: float,
                                 forward_only: bool = False, comm: PipeComm = None, microbatch_mean: bool = False,
                                 timeline=None, microbatch_group_size: int | None = None, **_):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2), following Megatron-LM's
    forward_backward_pipelining_with_interleaving. Virtual micro-batch k runs on chunk
    (k // p) % v (reversed for backward; in groups of --microbatch-group-size-per-virtual-pipeline-stage
    micro-batches where it is given, `schedule_table`); chunk c of rank p-1 feeds chunk c+1 of rank 0."""
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean, timeline)
    run = _Interleaved(step, comm, len(model), num_microbatches, forward_only, microbatch_group_size)
    run.warmup()
    run.steady()
    if not forward_only:
        run.cooldown()
    return step.stats


def _one_stage(pp: int, vpp: int) -> str | None:  # it never exchanges activations between stages
    return None if pp == 1 else f"needs --pipeline-model-parallel-size 1 (got {pp})"


def _one_chunk(pp: int, vpp: int) -> str | None:  # it runs chunk 0 only
    return None if vpp == 1 else (f"runs one model chunk per pipeline rank, not {vpp}: use interleaved_1f1b "
                                  f"or drop --num-layers-per-virtual-pipeline-stage")


def _virtual_chunks(pp: int, vpp: int) -> str | None:
    return None if vpp > 1 else ("needs --num-layers-per-virtual-pipeline-stage "
                                 "(more than one model chunk per pipeline rank)")


def _zb_one_chunk(pp: int, vpp: int) -> str | None:
    if pp < 2:
        return f"needs --pipeline-model-parallel-size 2 or more (got {pp}): it fills a pipeline's bubble"
    return _one_chunk(pp, vpp)


def _two_chunks_in_a_v(pp: int, vpp: int) -> str | None:
    if pp < 2:
        return f"needs --pipeline-model-parallel-size 2 or more (got {pp}): it fills a pipeline's bubble"
    return None if vpp == 2 else (f"runs exactly 2 model chunks per pipeline rank in a V, not {vpp}: set "
                                  f"--num-layers-per-virtual-pipeline-stage to num-layers / (2·PP)")


def _not_built(pp: int, vpp: int) -> str | None:
    return ("is not built: DualPipeV overlaps one micro-batch's forward with another's backward on two "
            "streams, which this runtime (one pass at a time per rank) has no counterpart for; use zbv")


@dataclass(frozen=True)
class Schedule:
    run: Callable  # forward_backward(batches, model, num_microbatches, backward_scale, forward_only, comm, ...)
    layout_problem: Callable[[int, int], str | None]  # (pp, vpp) -> what it needs of the layout, or None
    splits_backward: bool = False  # B and W apart: needs --delay-wgrad-compute's deferred weight gradients
    v_shape: bool = False  # chunk 1 of rank r is virtual stage 2·PP-1-r; rank 0 holds the loss


# The schedules by the name --pipeline-schedule takes: a new one is its function plus one entry.
SCHEDULES = MappingProxyType({
    "no_pipelining": Schedule(forward_backward_no_pipelining, _one_stage),
    "1f1b": Schedule(forward_backward_1f1b, _one_chunk),
    "interleaved_1f1b": Schedule(forward_backward_interleaved, _virtual_chunks),
    "zb_h1": Schedule(forward_backward_zb_h1, _zb_one_chunk, splits_backward=True),
    "zbv": Schedule(forward_backward_zbv, _two_chunks_in_a_v, splits_backward=True, v_shape=True),
    "dualpipev": Schedule(None, _not_built),
})


def default_schedule_name(pp: int, vpp: int = 1) -> str:
    """The schedule chosen when none is named: no pipelining on one stage, interleaved 1F1B
    with virtual chunks, 1F1B otherwise."""
    if pp == 1:
        return "no_pipelining"
    return "interleaved_1f1b" if vpp > 1 else "1f1b"


def _unknown(name: str) -> str:
    return f"--pipeline-schedule {name!r} is not a schedule; choose from {', '.join(SCHEDULES)}"


def check_schedule(name: str, pp: int, vpp: int = 1) -> str | None:
    """Why the schedule `name` cannot run with pp stages of vpp chunks each (an error message
    naming the flags), or None if it can."""
    if name not in SCHEDULES:
        return _unknown(name)
    problem = SCHEDULES[name].layout_problem(pp, vpp)
    return None if problem is None else f"--pipeline-schedule {name} {problem}"


def get_schedule(name: str):
    """The forward-backward function of the schedule `name`."""
    if name not in SCHEDULES:
        raise ValueError(_unknown(name))
    if SCHEDULES[name].run is None:
        raise ValueError(check_schedule(name, 2, 2))
    return SCHEDULES[name].run


def splits_backward(name: str) -> bool:
    """Whether the schedule runs B and W apart (a WgradStore on the model: --delay-wgrad-compute)."""
    return SCHEDULES[name].splits_backward


def v_shape(name: str) -> bool:
    """Whether the schedule places chunks in a V (zbv): the loss on pipeline rank 0."""
    return name in SCHEDULES and SCHEDULES[name].v_shape

