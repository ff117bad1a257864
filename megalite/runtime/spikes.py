"""--check-for-spiky-loss / --check-for-large-grads: skip the update of an iteration whose loss or
gradient norm spikes, and never checkpoint weights that did not train on.

A value is a spike when it is at least `factor` times the largest of the last `window` accepted
values, however few there are yet (Megatron-LM's rerun state machine flags a loss or gradient
norm >= 10x the largest of the first 100 it saw, `is_unexpectedly_large`; here the baseline
follows the run and is there from the second value on), or when it is not finite. Only the
first value, with nothing accepted before it, is judged on finiteness alone: it is the loss of
weights no update of this run has touched. A healthy run's early values fall, or rise by far less
than 10x, so they are not flagged. Every rank sees the same global loss and gradient norm, so
every rank decides alike without a collective; the window (`state_dict`) is saved in checkpoints
and restored on resume, so a resumed run judges as the uninterrupted one would.

On a spike the update is not applied (the data still advances, the iteration counts, the
learning-rate schedule does not step, as for an fp16 overflow); after `patience` consecutive
spikes the run stops without saving. A spike in the loss of iteration k+1 means the update of
iteration k broke the weights: so while the guard is on, the checkpoint due after iteration k is
written during iteration k+1, once its loss is known to be no spike (before its update, with the
RNG states of the end of iteration k: the same checkpoint, one iteration later). Weights that any
update of this run produced have had an accepted value before them (the update's own iteration),
so the loss that vouches for their checkpoint is always judged against a baseline: even the
first update of a run, should it break the weights, is caught by the next loss against the first.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field


@dataclass
class SpikeGuard:
    factor: float
    window: int
    patience: int
    check_loss: bool
    check_grads: bool
    losses: collections.deque = field(default=None)
    grad_norms: collections.deque = field(default=None)
    consecutive: int = 0  # skipped iterations in a row

    def __post_init__(self):
        self.losses = collections.deque(maxlen=self.window)
        self.grad_norms = collections.deque(maxlen=self.window)

    @classmethod
    def from_config(cls, t) -> "SpikeGuard | None":
        """The guard of a TrainingConfig, or None when neither check is on."""
        if not (t.check_for_spiky_loss or t.check_for_large_grads):
            return None
        return cls(t.spike_factor, t.spike_window, t.spike_patience, t.check_for_spiky_loss, t.check_for_large_grads)

    def _spike(self, history: collections.deque, value: float, what: str) -> str | None:
        if not math.isfinite(value):
            return f"the {what} is {value}"
        if not history:  # the first value: no baseline yet
            return None
        baseline = max(history)
        if value >= self.factor * baseline:
            return (f"the {what} {value:.4g} is {value / baseline:.1f}x the largest of the last {len(history)} "
                    f"accepted ({baseline:.4g}; --spike-factor {self.factor:g})")
        return None

    def loss_spike(self, loss: float) -> str | None:
        """Why `loss` is a spike (None: it is not, or the loss is not checked)."""
        return self._spike(self.losses, loss, "loss") if self.check_loss else None

    def grad_norm_spike(self, grad_norm: float) -> str | None:
        return self._spike(self.grad_norms, grad_norm, "gradient norm") if self.check_grads else None

    def accept(self, loss: float, grad_norm: float | None) -> None:
        """An iteration whose update was applied: its values join the baseline."""
        self.consecutive = 0
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)

    def reject(self) -> bool:
        """A skipped iteration; True when it is the `patience`-th in a row (time to stop)."""
        self.consecutive += 1
        return self.consecutive >= self.patience

    def state_dict(self) -> dict:
        """The window and the count of skips in a row, JSON-safe (accepted values are finite)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "consecutive": self.consecutive}

    def load_state_dict(self, saved: dict | None) -> None:
        """A saved window (its last `window` values, should --spike-window have changed); None (a
        checkpoint without one: older, or written without the guard) leaves the guard empty."""
        saved = saved or {}
        self.losses = collections.deque(map(float, saved.get("losses", ())), maxlen=self.window)
        self.grad_norms = collections.deque(map(float, saved.get("grad_norms", ())), maxlen=self.window)
        self.consecutive = int(saved.get("consecutive", 0))
