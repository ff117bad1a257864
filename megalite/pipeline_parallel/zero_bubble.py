"""The zero-bubble schedules zb_h1 and zbv (Qi et al. 2024, arXiv 2401.10241) on one pipeline rank.

Each rank runs its order of F, B and W passes (zb_plan.py): F receives its input activation from
the previous virtual stage and sends its output on; B (the input gradient, inside the WgradStore's
capture) receives the output gradient from the next virtual stage and sends its input gradient
back; W (`WgradStore.pop`) computes the weight gradients the oldest B left, which is when the
gradient buffers' hooks (and --overlap-grad-reduce's bucket reductions) see them. Sends are
asynchronous and receives block, each stream of messages (one per receiving virtual stage and
direction) under its own tag, so that a rank only ever waits for what its order needs next; the
orders come from a run of the dependency graph, so every wait ends. A sent activation's storage is
freed once its send completes (its autograd graph stays for B). Under ZB-V the bottom of the V
(virtual stages p - 1 and p, both on the last rank) passes activations and gradients in memory.
"""
from __future__ import annotations

import torch

from .. import comm
from .p2p import PipeComm
from .step import Step, release
from .zb_plan import Action, Geometry, actions


class _Runner:
    def __init__(self, step: Step, pipe: PipeComm, geometry: Geometry, store, forward_only: bool):
        self.step, self.pipe, self.g, self.store = step, pipe, geometry, store
        self.forward_only = forward_only
        ps = pipe.ps
        self.rank, self.peers = ps.pp_rank, ps.pp_ranks
        self.inputs: dict = {}  # (chunk, mb) -> the input activation (None on the first stage)
        self.outputs: dict = {}  # (chunk, mb) -> the output (the loss on the last virtual stage)
        self.local: dict = {}  # ("act" | "grad", receiving stage, mb) -> tensor, at the V's bottom
        self.sends: list = []  # (work, tensor to free once sent)
        self.timeline = step.timeline

    # -- communication -----------------------------------------------------------------------------
    def _tag(self, stage: int, grad: bool) -> int:
        return 2 * stage + int(grad)

    def _receive(self, stage: int, grad: bool, mb: int, source_stage: int):
        src_rank, _ = self.g.place(source_stage)
        if src_rank == self.rank:
            return self.local.pop(("grad" if grad else "act", stage, mb))
        buf = torch.empty(self.pipe.shape, dtype=self.pipe.dtype, device=self.pipe.device)
        comm.recv(buf, self.peers[src_rank], self._tag(stage, grad))
        return buf

    def _send(self, t: torch.Tensor, stage: int, grad: bool, mb: int, free: bool) -> None:
        dst_rank, _ = self.g.place(stage)
        if dst_rank == self.rank:
            self.local[("grad" if grad else "act", stage, mb)] = t.detach() if grad else t.detach().requires_grad_()
            return
        t = t.contiguous()
        if self.pipe.device.type == "cuda":
            torch.cuda.synchronize()  # the send reads t on another stream
        work = comm.isend(t, self.peers[dst_rank], self._tag(stage, grad))
        self.sends.append((work, t if free else None))

    def _reap(self, wait: bool = False) -> None:
        """Free the activations whose sends completed (all of them, waiting, with `wait`)."""
        pending = []
        for work, t in self.sends:
            if work is None or wait or work.is_completed():
                if work is not None:
                    work.wait()
                release(t)
            else:
                pending.append((work, t))
        self.sends = pending

    # -- passes ----------------------------------------------------------------------------------
    def forward(self, c: int, mb: int) -> None:
        s = self.g.stage(self.rank, c)
        x = None
        if s > 0:
            x = self._receive(s, False, mb, s - 1)
            x.requires_grad_(not self.forward_only)
        y = self.step.forward(c, x)
        if s < self.g.num_stages - 1:
            # free after sending unless the next stage is here (it reads the same storage)
            self._send(y, s + 1, False, mb, free=not self.forward_only and self.g.place(s + 1)[0] != self.rank)
        if not self.forward_only:
            self.inputs[(c, mb)], self.outputs[(c, mb)] = x, y

    def backward_input(self, c: int, mb: int) -> None:
        s = self.g.stage(self.rank, c)
        dy = None if s == self.g.num_stages - 1 else self._receive(s, True, mb, s + 1)
        x, y = self.inputs.pop((c, mb)), self.outputs.pop((c, mb))
        with self.store.capture():
            dx = self.step.backward(x, y, dy, c, "B")
        if s > 0:
            self._send(dx, s - 1, True, mb, free=False)

    def backward_weight(self, c: int, mb: int) -> None:
        if self.timeline is None:
            self.store.pop()
            return
        with self.timeline.span("W", c, mb):
            self.store.pop()

    def run(self, order: list[Action]) -> None:
        for a in order:
            if a.kind == "F":
                self.forward(a.chunk, a.microbatch)
            elif a.kind == "B":
                self.backward_input(a.chunk, a.microbatch)
            else:
                self.backward_weight(a.chunk, a.microbatch)
            self._reap()
        self._reap(wait=True)


def _forward_backward_zb(v_shape: bool, batches, model, num_microbatches: int, backward_scale: float,
                         forward_only: bool = False, comm: PipeComm = None, microbatch_mean: bool = False,
                         timeline=None, wgrad_store=None, **_):
    g = Geometry(comm.ps.pp_size, v_shape)
    if len(model) != g.chunks:
        raise ValueError(f"{'zbv' if v_shape else 'zb_h1'} runs {g.chunks} model chunk(s) per rank, got {len(model)}")
    if wgrad_store is None and not forward_only:
        raise ValueError("the zero-bubble schedules need a WgradStore attached to the model (--delay-wgrad-compute)")
    step = Step(batches, model, backward_scale, forward_only, microbatch_mean, timeline)
    runner = _Runner(step, comm, g, wgrad_store, forward_only)
    if forward_only:  # evaluation: each micro-batch through this rank's chunks in pipeline order
        order = [Action("F", c, mb) for mb in range(num_microbatches) for c in range(g.chunks)]
    else:
        order = actions(g.p, num_microbatches, v_shape, comm.ps.pp_rank)
    runner.run(order)
    return step.stats


def forward_backward_zb_h1(*args, **kwargs):
    """ZB-H1 (Sec. 3.1): one chunk per rank, 1F1B's activation memory, W in 1F1B's bubbles."""
    return _forward_backward_zb(False, *args, **kwargs)


def forward_backward_zbv(*args, **kwargs):
    """ZB-V (Sec. 4): two chunks per rank in a V, rank 0 holding the first and the last."""
    return _forward_backward_zb(True, *args, **kwargs)
