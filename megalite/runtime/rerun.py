"""--rerun-mode: Megatron-LM's re-run state machine (megatron/core/rerun_state_machine.py), in
process, and --error-injection-* to prove each of its paths.

A result the run rejects (a NaN/Inf loss or gradient with --check-for-nan-in-loss-and-grad, a loss
spike with --check-for-spiky-loss) may come from the data, from a fault that will not come back
(a bit flipped in flight, a cosmic ray: silent data corruption), or from a device that keeps
computing wrongly. Megatron-LM tells them apart by running the iteration again: in place, on the
same GPU (a different result: a transient fault), then, after a checkpoint and a restart, on a
different GPU (the same result there: the result is correct, the data or the model gives it; a
different one: the first GPU is faulty). Here both re-runs happen inside the iteration, without a
restart: the weights are untouched until the optimizer step, so the iteration is run again from
the RNG states of its start and its own micro-batches; the "different GPU" is the next
data-parallel replica, which holds the same weights, and runs the suspect replica's micro-batches
while every replica shifts its data by one. Outcomes:

- transient (the in-place re-run differs): the ranks whose results differed are named, the re-run's
  result is kept and training goes on (the same state as a run without the fault, bit for bit);
- persistent (reproduced in place, not on the other replica): the rank is named and the run stops;
- correct result (reproduced on the other replica): a NaN stops the run naming the iteration,
  micro-batch and samples; a spike goes to the spike guard, which skips the update;
- with data-parallel size 1 there is no other replica: a reproduced result stops the run.

Nothing of a rejected iteration is ever saved: a stop happens before its optimizer step, and a
checkpoint is written only after a completed iteration. `report_stats` runs every iteration twice
and reports the largest relative difference of the loss over each log interval (0 on CPU, where
megalite's kernels are deterministic). Comparisons are bitwise (Megatron-LM's default tolerance, 0).

Error injection, as Megatron-LM's RerunErrorInjector: about one validation in `rate` draws a fault,
a NaN in one micro-batch's loss on one rank (the draw is a function of --seed and the iteration,
the same on every rank without a collective): transient_error only in the first run,
persistent_error whenever the faulty rank computes, correct_result whenever anyone computes that
micro-batch.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import comm
from ..errors import UserError

INITIAL, IN_PLACE, OTHER_REPLICA = "initial", "in_place", "other_replica"
KINDS = {"correct_result": "Expected result", "transient_error": "Transient error",
         "persistent_error": "Persistent error"}


class RerunError(UserError):
    """A rejected result reproduced by the re-run: the run stops before the iteration's update."""


@dataclass(frozen=True)
class Injection:
    """The fault drawn for one iteration: on `rank`, in its micro-batch `microbatch`."""
    rank: int
    microbatch: int


@dataclass
class ErrorInjector:
    rate: int
    kind: str
    seed: int

    def pick(self, iteration: int, loss_ranks: list, num_microbatches: int) -> Injection | None:
        """The fault of `iteration` (None most of the time): the same on every rank."""
        if self.rate <= 0:
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        if int(torch.randint(self.rate, (1,), generator=g)) != 0:
            return None
        rank = loss_ranks[int(torch.randint(len(loss_ranks), (1,), generator=g))]
        return Injection(rank, int(torch.randint(num_microbatches, (1,), generator=g)))

    def applies(self, inj: Injection, phase: str, me: int, computes_for: int) -> bool:
        """Whether the fault shows on rank `me` in `phase`, computing the data of rank `computes_for`."""
        if self.kind == "transient_error":
            return phase == INITIAL and me == inj.rank
        if self.kind == "persistent_error":
            return me == inj.rank  # the device is faulty, whatever it computes
        return computes_for == inj.rank  # correct_result: the data gives it, whoever computes


def same(a: float, b: float) -> bool:
    """Bitwise equality of two results, NaN equal to NaN (Megatron-LM's _compare_floats at tolerance 0)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def relative_difference(a: float, b: float) -> float:
    if same(a, b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a + b) / 2, 1e-30)


@dataclass
class Grid:
    """Who computes what, for every global rank (one all-reduce at start-up): whether it holds a
    loss (the last stage's TP rank 0), its data-parallel index, and the rank of the same position
    in the previous data-parallel replica (which computes its data in the other-replica re-run)."""
    loss_ranks: list
    dp_index: list
    previous: list

    @classmethod
    def build(cls, ps, device) -> "Grid":
        t = torch.zeros(3, ps.world_size, dtype=torch.float64, device=device)
        t[0, ps.rank] = float(ps.is_loss_stage and ps.tp_rank == 0)
        t[1, ps.rank] = ps.dp_rank
        t[2, ps.rank] = ps.dp_ranks[(ps.dp_rank - 1) % ps.dp_size] if ps.dp_size > 1 else ps.rank
        v = comm.all_reduce(t, comm.world_group()).tolist()
        return cls([r for r, x in enumerate(v[0]) if x], [int(x) for x in v[1]], [int(x) for x in v[2]])


class ShiftedData:
    """A view of the parallel state whose data-parallel rank is the next replica's: its
    micro-batches are the ones that replica read (data/batch.py asks only for these fields)."""

    def __init__(self, ps):
        self._ps = ps
        self.dp_rank = (ps.dp_rank + 1) % ps.dp_size

    def __getattr__(self, name):
        return getattr(self._ps, name)


@dataclass
class Hooks:
    """What the machine needs from the loop, as functions (runtime/ sits below the loop and the
    checkpoint code): one pass of the iteration, the RNG states of its start, its data again."""
    run_pass: Callable  # (fault: Callable[[list], None] | None) -> (GlobalLoss, stats)
    restore_rng: Callable  # () -> None: the RNG states of the iteration's start
    rewind: Callable  # (ps or ShiftedData, samples ahead) -> None: the data iterators rebuilt
    rejects: Callable  # (GlobalLoss) -> str | None: why the result is rejected


@dataclass
class RerunMachine:
    mode: str
    injector: ErrorInjector
    grid: Grid
    ps: object
    micro_batch_size: int
    tracker_file: str | None
    log: Callable
    jsonl: object
    log_interval: int
    device: object = None
    spread: list = field(default_factory=list)  # report_stats: relative loss differences this interval

    @classmethod
    def build(cls, r, t, ps, device, log, jsonl) -> "RerunMachine | None":
        """The machine of a ResilienceConfig `r` (None when disabled); one all-reduce (Grid)."""
        if not r.validates:
            return None
        log(f"> rerun state machine: {'Result validation enabled' if r.rerun_mode == 'validate_results' else ''}"
            f"{'reporting determinism stats' if r.rerun_mode == 'report_stats' else ''} (--rerun-mode "
            f"{r.rerun_mode}{f', injecting {r.error_injection_type} at rate 1/{r.error_injection_rate}' if r.error_injection_rate else ''})")
        return cls(r.rerun_mode, ErrorInjector(r.error_injection_rate, r.error_injection_type, t.seed),
                   Grid.build(ps, device), ps, t.micro_batch_size, r.result_rejected_tracker_filename, log, jsonl,
                   t.log_interval, device)

    # -- the iteration ----------------------------------------------------------------------------
    def step(self, hooks: Hooks, iteration: int, num_microbatches: int, consumed: int):
        """The iteration's result (a GlobalLoss) to go on with, validated; RerunError when it stops."""
        inj = self.injector.pick(iteration, self.grid.loss_ranks, num_microbatches) \
            if self.mode == "validate_results" else None
        if inj is not None:
            self.log(f"> iteration {iteration}: Injecting error type {KINDS[self.injector.kind]} (rank {inj.rank}, "
                     f"micro-batch {inj.microbatch})")
        g, stats = hooks.run_pass(self._fault(inj, INITIAL))
        if self.mode == "report_stats":
            return self._report_stats(hooks, g, iteration)
        why = hooks.rejects(g)
        if why is None:
            return g
        where = self._locate(stats)
        self._track(iteration, why, g, "initial_run", where)
        self.log(f"> iteration {iteration}: Unexpected result ({why}); Need to rerun step to check reproducibility "
                 f"of initial result")
        hooks.restore_rng()
        hooks.rewind(self.ps, 0)
        again, _ = hooks.run_pass(self._fault(inj, IN_PLACE))
        differ = self._differ(g, again)
        if differ:
            return self._transient(iteration, why, again, differ, where)
        self.log(f"> iteration {iteration}: First rerun: unexpected result is reproducible within the tolerance "
                 f"({g.loss} = {again.loss})")
        self._track(iteration, why, g, "first_rerun_reproducible", where)
        if self.ps.dp_size == 1:
            raise RerunError(self._stop_message(iteration, why, where, consumed, num_microbatches,
                                                "no other data-parallel replica to run it on (data-parallel size 1): "
                                                "a persistent fault of the rank or a correct result"))
        return self._other_replica(hooks, iteration, why, g, where, consumed, num_microbatches)

    def _fault(self, inj: Injection | None, phase: str):
        """The injected fault of `phase` on this rank, as a function of its micro-batch stats."""
        if inj is None:
            return None
        me = self.ps.rank
        computes_for = me if phase != OTHER_REPLICA else self._next_replica(me)
        if not self.injector.applies(inj, phase, me, computes_for):
            return None

        def fault(stats):
            stats[inj.microbatch] = (torch.full_like(stats[inj.microbatch][0], math.nan),
                                     *stats[inj.microbatch][1:])
        return fault

    def _next_replica(self, rank: int) -> int:
        return self.grid.previous.index(rank)

    def _differ(self, a, b) -> list:
        """The ranks whose own results differ between two passes: their losses, else their gradients."""
        ranks = [r for r in range(len(a.rank_losses)) if not same(a.rank_losses[r], b.rank_losses[r])]
        if ranks:
            return ranks
        return [r for r in range(len(a.grad_max)) if not same(a.grad_max[r], b.grad_max[r])]

    def _transient(self, iteration, why, again, differ, where):
        self.log(f"> iteration {iteration}: First rerun: unexpected result is not reproducible within the tolerance; "
                 f"Possible transient error! on rank(s) {differ}; the re-run's result is kept "
                 f"(loss {again.loss})")
        self._track(iteration, why, again, "first_rerun_not_reproducible", where, ranks=differ)
        self.jsonl.write({"event": "rerun", "iteration": iteration, "diagnostic": "transient_error",
                          "ranks": differ, "reason": why, "lm_loss": again.loss})
        return again

    def _other_replica(self, hooks, iteration, why, g, where, consumed, num_microbatches):
        """The iteration run with every replica's data moved to the next replica: each suspect
        result compared with the one computed elsewhere."""
        hooks.restore_rng()
        hooks.rewind(ShiftedData(self.ps), 0)
        inj = self.injector.pick(iteration, self.grid.loss_ranks, num_microbatches) \
            if self.mode == "validate_results" else None
        other, _ = hooks.run_pass(self._fault(inj, OTHER_REPLICA))
        suspects = [r for r in self.grid.loss_ranks if not math.isfinite(g.rank_losses[r])] or self.grid.loss_ranks
        faulty = [r for r in suspects if not same(g.rank_losses[r], other.rank_losses[self.grid.previous[r]])]
        if faulty:
            self.log(f"> iteration {iteration}: Second rerun: unexpected result is not reproducible on a different "
                     f"rank, therefore was likely incorrect; Possible persistent error! on rank(s) {faulty}")
            self._track(iteration, why, g, "second_rerun_not_reproducible", where, ranks=faulty)
            raise RerunError(
                f"iteration {iteration}: {why}; reproduced on the same rank, not on another data-parallel replica: "
                f"a persistent fault of rank(s) {faulty} ({self._where_text(where, consumed, num_microbatches)}); "
                f"stopped before the optimizer step, nothing of this iteration saved. Take the rank's device out "
                f"and resume from the latest checkpoint")
        self.log(f"> iteration {iteration}: Second rerun: unexpected result is reproducible on a different rank, "
                 f"therefore it was likely correct; Correct result (but possible Application error) ({why})")
        self._track(iteration, why, g, "second_rerun_reproducible", where)
        if not math.isfinite(g.loss) or any(g.bad_loss) or why.startswith("the gradients"):  # not a spike
            raise RerunError(self._stop_message(iteration, why, where, consumed, num_microbatches,
                                                "reproduced on another data-parallel replica: the result is correct "
                                                "for this data and these weights"))
        # a spike the data gives: the spike guard decides (it skips the update); the iterators
        # go on from the next iteration's samples, the RNG states are those after one pass
        hooks.rewind(self.ps, self.micro_batch_size * self.ps.dp_size * num_microbatches)
        return g

    # -- naming where -------------------------------------------------------------------------------
    def _locate(self, stats) -> list:
        """Per global rank, the micro-batch to name (-1: none): where any rank's own loss is not
        finite, each such rank's first non-finite micro-batch; else (a spike) each loss rank's
        largest. One all-reduce, only when a result is rejected."""
        t = torch.zeros(len(self.grid.dp_index), dtype=torch.float64, device=self.device)
        if stats and self.ps.is_loss_stage and self.ps.tp_rank == 0:
            losses = [float(s[0]) / max(float(s[1]), 1.0) for s in stats]
            bad = [m for m, x in enumerate(losses) if not math.isfinite(x)]
            t[self.ps.rank] = 1 + bad[0] if bad else -1 - max(range(len(losses)), key=losses.__getitem__)
        v = [int(x) for x in comm.all_reduce(t, comm.world_group()).tolist()]
        if any(x > 0 for x in v):
            return [x - 1 if x > 0 else -1 for x in v]
        return [-x - 1 if x < 0 else -1 for x in v]

    def _where_text(self, where, consumed, num_microbatches, ranks=None) -> str:
        mbs, dp = self.micro_batch_size, self.ps.dp_size
        parts = []
        for r in ranks or self.grid.loss_ranks:
            if where[r] >= 0:
                first = consumed + where[r] * mbs * dp + self.grid.dp_index[r] * mbs
                parts.append(f"rank {r}: micro-batch {where[r]}, samples {first}..{first + mbs - 1}")
        return "; ".join(parts)

    def _stop_message(self, iteration, why, where, consumed, num_microbatches, verdict) -> str:
        return (f"iteration {iteration}: {why}, reproduced by its re-run ({verdict}; "
                f"{self._where_text(where, consumed, num_microbatches)}); stopped before the optimizer step, "
                f"nothing of this iteration saved. Resume from the latest checkpoint with other data "
                f"(--data-path, --seed) or a lower --lr")

    def _track(self, iteration, why, g, status, where, ranks=None) -> None:
        """--result-rejected-tracker-filename: one line per rank involved, Megatron-LM's format."""
        if self.tracker_file is None or self.ps.rank != self.ps.logging_rank:
            return
        ranks = ranks or [r for r in self.grid.loss_ranks if where[r] >= 0]
        with open(self.tracker_file, "a") as f:
            for r in ranks:
                f.write(f"ts={datetime.datetime.now()} node={os.uname()[1]} device=cpu "
                        f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={r} iteration={iteration} status={status} "
                        f"result={g.rank_losses[r] if r < len(g.rank_losses) else g.loss} message='{why}'\n")

    # -- report_stats ----------------------------------------------------------------------------------
    def _report_stats(self, hooks, g, iteration):
        hooks.restore_rng()
        hooks.rewind(self.ps, 0)
        again, _ = hooks.run_pass(None)
        self.spread.append(max([relative_difference(g.loss, again.loss)] +
                               [relative_difference(a, b) for a, b in zip(g.rank_losses, again.rank_losses)]))
        if iteration % self.log_interval == 0:
            worst, mean = max(self.spread), sum(self.spread) / len(self.spread)
            self.log(f"> rerun stats (iterations {iteration - len(self.spread) + 1}..{iteration}): relative loss "
                     f"difference between run and re-run: max {worst:.3e}, mean {mean:.3e}")
            self.jsonl.write({"event": "rerun_stats", "iteration": iteration, "max_relative_difference": worst,
                              "mean_relative_difference": mean, "iterations": len(self.spread)})
            self.spread = []
        return again


__all__ = ["ErrorInjector", "Grid", "Hooks", "Injection", "RerunError", "RerunMachine", "ShiftedData",
           "relative_difference", "same"]
