"""A run's FP8 state: the recipe, the delayed-scaling history, and whether casts record amaxes
(training iterations only: an evaluation must not move the next iteration's scales)."""
from __future__ import annotations

from . import backend
from .delayed import AmaxHistory
from .operand import mm_config
from .recipe import Recipe


class FP8Context:
    def __init__(self, recipe: Recipe, reduce_groups=()):
        """`reduce_groups`: the groups over which delayed scaling's amaxes are reduced at the end
        of an iteration (TP, then DP x CP: every rank of this pipeline stage)."""
        self.recipe, self.reduce_groups = recipe, tuple(reduce_groups)
        self.history = AmaxHistory(recipe.history_len, recipe.amax_compute_algo, recipe.margin)
        self.mm_config = mm_config(recipe.emulate)
        self.recording = False
        self.sites: list = []  # every GemmSite, in the order they were made (the same on every rank of a stage)

    def add_slots(self, dtypes) -> int:
        return self.history.add(dtypes)

    def register(self, site) -> None:
        self.sites.append(site)

    def materialize(self, device) -> None:
        """After every site is made: the history's tensors (delayed scaling)."""
        if self.recipe.delayed:
            self.history.materialize(device)

    # -- the iteration -------------------------------------------------------------------------------
    def start_iteration(self) -> None:
        self.recording = True

    def finish_iteration(self) -> None:
        """After the iteration's last backward (every rank of the stage calls it: a collective)."""
        self.recording = False
        if self.recipe.delayed:
            self.history.finish_iteration(self.reduce_groups)

    def describe(self) -> str:
        return (f"FP8 (torchao {backend.version()}): {self.recipe.describe()}; {len(self.sites)} linear layers "
                f"in FP8 on this rank")


__all__ = ["FP8Context"]
