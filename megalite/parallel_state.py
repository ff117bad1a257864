"""The tensor/pipeline/data-parallel rank grid and its process groups.

Megatron-LM's default order puts TP fastest, then DP, then PP:

    rank = tp_rank + TP * dp_rank + TP * DP * pp_rank            (order "tp-dp-pp")

so that a TP group sits inside one node (NVLink) and a PP group spans nodes. The alternative
order "tp-pp-dp" (rank = tp_rank + TP * pp_rank + TP * PP * dp_rank) keeps a pipeline inside
a node instead.

The grid itself is pure arithmetic (`RankGrid`), testable without torch.distributed;
`ParallelState` adds the process groups for one rank. There is no hidden global: the trainer
builds one `ParallelState` and passes it to whatever needs it.
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

ORDERS = ("tp-dp-pp", "tp-pp-dp")


@dataclass(frozen=True)
class RankGrid:
    """World size split into tp x pp x dp, enumerated in `order` (fastest dimension first)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    order: str = "tp-dp-pp"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"unknown rank order {self.order!r}; expected one of {ORDERS}")
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"({self.tp}) x --pipeline-model-parallel-size ({self.pp})")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def _dims(self) -> list[str]:
        return self.order.split("-")

    def _size(self, dim: str) -> int:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}[dim]

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, pp, dp) coordinates of `rank`, by mixed-radix decoding in grid order."""
        out = {}
        for dim in self._dims():
            out[dim] = rank % self._size(dim)
            rank //= self._size(dim)
        return out

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        coords = {"tp": tp, "pp": pp, "dp": dp}
        rank, stride = 0, 1
        for dim in self._dims():
            rank += coords[dim] * stride
            stride *= self._size(dim)
        return rank

    def groups(self, *dims: str) -> list[list[int]]:
        """All groups of ranks that vary along `dims` and agree on every other dimension.

        groups("tp") are the TP groups, groups("tp", "pp") the model-parallel groups, and so on.
        Every rank must create the groups in this same order, so the order is deterministic.
        """
        fixed = [d for d in ("tp", "pp", "dp") if d not in dims]
        result = []
        for fixed_vals in itertools.product(*(range(self._size(d)) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = []
            for vals in itertools.product(*(range(self._size(d)) for d in dims)):
                members.append(self.rank_of(**base, **dict(zip(dims, vals))))
            result.append(sorted(members))
        return sorted(result)

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of every pipeline: they share the tied word embedding."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]


@dataclass
class ParallelState:
    """One rank's place in the grid plus its process groups (None where the size is 1 or
    torch.distributed is not initialised)."""

    grid: RankGrid
    rank: int = 0
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved schedule)
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])
    embedding_ranks: list[int] = field(default_factory=lambda: [0])

    # -- sizes and ranks ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def tp_rank(self) -> int:
        return self.grid.coords(self.rank)["tp"]

    @property
    def pp_rank(self) -> int:
        return self.grid.coords(self.rank)["pp"]

    @property
    def dp_rank(self) -> int:
        return self.grid.coords(self.rank)["dp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_logging_rank(self) -> bool:
        """The rank that owns the loss and writes logs: last stage, TP 0, DP 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0

    @property
    def logging_rank(self) -> int:
        return self.grid.rank_of(tp=0, pp=self.pp_size - 1, dp=0)

    def describe(self) -> str:
        return (f"world {self.world_size} = TP {self.tp_size} x PP {self.pp_size} x DP {self.dp_size}"
                f" (order {self.grid.order}" + (f", {self.vpp} virtual stages" if self.vpp > 1 else "")
                + ")")


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each model chunk on pipeline rank `pp_rank`.

    Megatron-LM's interleaved assignment: with v chunks per rank, chunk c of rank r holds the
    layers starting at c·L/v + r·L/(p·v); with v = 1 that is L/p contiguous layers per stage.
    """
    per_chunk = num_layers // (pp * vpp)
    return [(c * num_layers // vpp + pp_rank * per_chunk, per_chunk) for c in range(vpp)]


def single_process_state() -> ParallelState:
    """The trivial grid: every group has one member and no collective is issued."""
    return ParallelState(grid=RankGrid(1))


def initialize(tp: int = 1, pp: int = 1, vpp: int = 1, order: str = "tp-dp-pp",
               timeout_minutes: float | None = None) -> ParallelState:
    """Create every process group of the grid; torch.distributed must already be initialised
    (or the world must be a single process). `timeout_minutes` bounds each group's collectives
    (new groups do not inherit the default group's timeout: torch gives them its own default)."""
    if not dist.is_initialized():
        grid = RankGrid(1, tp, pp, order)
        return ParallelState(grid=grid, vpp=vpp)
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid(world, tp, pp, order)
    ps = ParallelState(grid=grid, rank=rank, vpp=vpp)

    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes is not None else None

    def make(groups: list[list[int]]):
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = (g, ranks)
        return mine

    ps.tp_group, ps.tp_ranks = make(grid.groups("tp"))
    ps.pp_group, ps.pp_ranks = make(grid.groups("pp"))
    ps.dp_group, ps.dp_ranks = make(grid.groups("dp"))
    ps.mp_group, _ = make(grid.groups("tp", "pp"))
    emb = make(grid.embedding_groups())
    # ranks outside the first/last stage belong to no embedding group
    if emb is not None:
        ps.embedding_group, ps.embedding_ranks = emb
    else:
        ps.embedding_group, ps.embedding_ranks = None, []
    return ps
