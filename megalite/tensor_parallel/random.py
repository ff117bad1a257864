"""RNG tracker: named generator states for randomness that must differ across TP ranks.

Dropout on activations that every TP rank holds whole (hidden dropout, outside the
tensor-parallel regions) must draw the same mask on every TP rank, or the replicas drift apart:
it uses the default generator, seeded identically across TP. Dropout on activations sharded
across TP (attention probabilities of each rank's heads) must differ per rank: it runs inside
`tracker.fork()`, whose state is seeded with the TP rank (Megatron's `model-parallel-rng`).
"""
from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        orig = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(orig, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added to the tracker")
        orig = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(orig, self.device)

    # for activation recompute and checkpoints
    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> tuple[int, int]:
    """(default seed, tensor-parallel seed) for one rank, as Megatron-LM derives them: the
    default stream differs per pipeline stage (different layers), the TP stream per TP rank."""
    default = seed + 100 * pp_rank
    return default, default + 2718 + tp_rank


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> RNGTracker:
    import random

    import numpy as np

    default, tp_seed = model_parallel_seed(seed, tp_rank, pp_rank)
    random.seed(default)
    np.random.seed(default % 2**32)
    torch.manual_seed(default)
    tracker = RNGTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)
    return tracker
