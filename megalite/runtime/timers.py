"""--timing-log-level / --log-timers-to-tensorboard: Megatron-LM's per-phase timers.

Each timer has a name (Megatron-LM's, where it times the same phase) and a level; a `Timers`
at level L keeps the timers of level <= L and hands out a no-op for the others, so a phase
that is not timed costs a dictionary lookup and nothing else: no clock read, no CUDA
synchronisation, no collective.

  level 0  the iteration time of the log line (metrics.Timer; no timer here)
  level 1  forward-backward, all-grads-sync, params-all-gather, optimizer, save-checkpoint
  level 2  batch-generator (a synchronisation around every micro-batch on CUDA, which is why
           Megatron-LM keeps it at level 2)

Nesting follows Megatron-LM: forward-backward holds batch-generator and all-grads-sync (its
schedule ends with the gradient reduction), optimizer holds params-all-gather.

On CUDA a running timer synchronises the device at start and stop, so the GPU work of a phase
is counted in it rather than in whichever phase next waits for the device; never a barrier
(Megatron-LM's --no-barrier-with-level-1-timing behaviour), so each rank's time is its own.
`collect` is a collective: one all-reduce (max over ranks of [t, -t]) gives every timer's min and
max over ranks; every rank calls it with the same names at the same points.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import comm

LEVELS = {"forward-backward": 1, "batch-generator": 2, "all-grads-sync": 1, "params-all-gather": 1,
          "optimizer": 1, "save-checkpoint": 1}
# logged at each log interval, in Megatron-LM's order (its training_log's timers_to_log)
INTERVAL_TIMERS = ("forward-backward", "batch-generator", "all-grads-sync", "params-all-gather", "optimizer")


class _Timer:
    """Seconds spent between start() and stop(), summed until read."""

    def __init__(self, name: str, sync: bool):
        self.name, self.sync = name, sync
        self.elapsed_s, self.started_at, self.ran = 0.0, None, False

    def start(self) -> None:
        if self.started_at is not None:
            raise RuntimeError(f"timer {self.name} started twice")
        if self.sync:
            torch.cuda.synchronize()
        self.started_at = time.perf_counter()

    def stop(self) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.elapsed_s += time.perf_counter() - self.started_at
        self.started_at, self.ran = None, True

    def read(self) -> float | None:
        """Seconds since the last read (None if it never ran), then zero; a running timer goes on."""
        if self.started_at is not None:  # as Megatron-LM: count up to now, keep running
            self.stop()
            self.start()
        value = self.elapsed_s if self.ran else None
        self.elapsed_s, self.ran = 0.0, False
        return value

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Off:
    """A timer below the level: does nothing."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class Timers:
    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        sync = device.type == "cuda"
        self._timers = {name: _Timer(name, sync) for name, lvl in LEVELS.items() if lvl <= level}
        self._off = _Off()

    def __call__(self, name: str):
        """The timer `name` (start/stop, or a `with` block); a no-op below the level."""
        if name not in LEVELS:
            raise KeyError(f"no timer named {name!r} (known: {', '.join(LEVELS)})")
        return self._timers.get(name, self._off)

    def enabled(self, name: str) -> bool:
        return name in self._timers

    def wrap(self, name: str, it):
        """An iterator whose next() runs under timer `name`; `it` itself when that timer is off."""
        if not self.enabled(name):
            return it
        return _timed(self._timers[name], it)

    def collect(self, names, normalizer: float = 1.0) -> dict[str, tuple[float, float]]:
        """{name: (min, max) over ranks of the ms each rank spent in it since the last collect,
        divided by `normalizer`}, for the named timers at or below the level that ran on some
        rank. A collective over the world when any named timer is on; nothing at all otherwise."""
        names = [n for n in names if self.enabled(n)]
        if not names:
            return {}
        values = [self._timers[n].read() for n in names]
        # max over ranks of t and of -t: a rank where a timer did not run gives -inf to both
        t = torch.tensor([v if v is not None else -float("inf") for v in values]
                         + [-v if v is not None else -float("inf") for v in values],
                         dtype=torch.float64, device=self.device)
        reduced = comm.all_reduce(t, comm.world_group(), op=dist.ReduceOp.MAX).tolist()
        n, scale = len(names), 1e3 / normalizer
        return {name: (-reduced[n + i] * scale, reduced[i] * scale)
                for i, name in enumerate(names) if reduced[i] != -float("inf")}


def _timed(timer: _Timer, it):
    while True:
        with timer:
            try:
                batch = next(it)
            except StopIteration:
                return
        yield batch


def timers_text(times: dict[str, tuple[float, float]]) -> str:
    """Megatron-LM's block under the log line (its --timing-log-option minmax)."""
    lines = ["(min, max) time across ranks (ms):"]
    lines += [f"    {(name + ' ').ljust(48, '.')}: ({lo:.2f}, {hi:.2f})" for name, (lo, hi) in times.items()]
    return "\n".join(lines)
