"""The tensor/context/pipeline/data-parallel rank grid and its process groups.

Megatron-LM's default order puts TP fastest, then CP, then DP, then PP (its "tp-cp-ep-dp-pp"
without experts):

    rank = tp + TP·cp + TP·CP·dp + TP·CP·DP·pp                    (order "tp-cp-dp-pp")

so that a TP group sits inside one node (NVLink), the CP group (which exchanges keys and values
every layer) next to it, and a PP group spans nodes. The alternative order "tp-cp-pp-dp"
(--use-tp-pp-dp-mapping) keeps a pipeline inside a node instead. The names of the orders before
context parallelism, "tp-dp-pp" and "tp-pp-dp", are accepted and mean the same with CP after TP.

Context-parallel ranks hold the same parameters and different parts of each sequence, so
gradients are reduced (and ZeRO-1 shards the optimizer) over the data-parallel x
context-parallel group, `dp_cp_group` (Megatron's get_data_parallel_group(with_context_parallel=
True)); the data sampler still splits samples over `dp_group` only.

Mixture-of-Experts layers have a grid of their own over the same ranks, Megatron-LM's expert
RankGenerator "tp-ep-dp-pp" ("tp-ep-pp-dp" with --use-tp-pp-dp-mapping, where PP > 1 needs ETP x EP
= TP x CP so that both grids keep the same pipeline groups): expert tensor parallelism ETP (--expert-tensor-parallel-size, by
default TP) fastest, then expert parallelism EP, then the expert-data-parallel ranks, then PP:

    rank = etp + ETP·ep + ETP·EP·edp + ETP·EP·EDP·pp,   EDP = world / (ETP·EP·PP)

PP is the slowest dimension of both grids, so a pipeline stage holds the same ranks in each.
With ETP = TP the expert grid cuts each (tp, pp)'s DP x CP ranks, k = cp + CP·dp, into
ep = k mod EP and edp = k div EP; with ETP < TP (ETP 1: experts whole while dense layers are
split) the EP and expert-DP groups take TP ranks too. An ETP group splits each expert's MLP as
TP splits the dense one; an EP group holds other experts of every MoE layer (tokens exchanged);
an expert's replicas, over which its gradients are reduced and its optimizer state sharded, form
the expert-data-parallel group (world / (ETP·EP·PP) ranks).

The grid itself is pure arithmetic (`RankGrid`), testable without torch.distributed;
`ParallelState` adds the process groups for one rank. There is no hidden global: the trainer
builds one `ParallelState` and passes it to whatever needs it.
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from .config.pipeline_layout import layout_of

ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp")
# the orders' names before CP existed: the same grids with CP right after TP
LEGACY_ORDERS = {"tp-dp-pp": "tp-cp-dp-pp", "tp-pp-dp": "tp-cp-pp-dp"}
DIMS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class RankGrid:
    """World size split into tp x cp x pp x dp, enumerated in `order` (fastest dimension first)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    order: str = "tp-cp-dp-pp"
    cp: int = 1
    ep: int = 1  # expert parallelism (MoE)
    etp: int | None = None  # expert tensor parallelism (MoE); None: TP

    def __post_init__(self):
        if self.order in LEGACY_ORDERS:
            object.__setattr__(self, "order", LEGACY_ORDERS[self.order])
        if self.order not in ORDERS:
            raise ValueError(f"unknown rank order {self.order!r}; expected one of {ORDERS}")
        if self.tp < 1 or self.pp < 1 or self.cp < 1 or self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"({self.tp}) x --pipeline-model-parallel-size ({self.pp}) x --context-parallel-size ({self.cp})")

        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.etp < 1 or self.ep < 1 or (self.tp * self.dp * self.cp) % (self.etp * self.ep):
            raise ValueError(f"--expert-tensor-parallel-size ({self.etp}) x --expert-model-parallel-size ({self.ep}) "
                             f"does not divide TP x DP x CP ({self.tp * self.dp * self.cp})")
        if self.separate_expert_grid and self.order != "tp-cp-dp-pp" and self.pp > 1 and self.edp != self.dp:
            # Megatron-LM's assertion: the two grids' pipeline groups must be the same ranks
            raise ValueError(f"with --use-tp-pp-dp-mapping (rank order tp-cp-pp-dp) and PP > 1 the expert grid's "
                             f"data-parallel size ({self.edp} = world / (ETP x EP x PP)) must equal the dense "
                             f"grid's ({self.dp}): ETP x EP must equal TP x CP")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: world / (ETP x EP x PP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def separate_expert_grid(self) -> bool:
        """Whether the expert grid's groups differ from the dense grid's (EP > 1 or ETP != TP)."""
        return self.ep > 1 or self.etp != self.tp

    def expert_coords(self, rank: int) -> dict[str, int]:
        """(etp, ep, edp, pp) coordinates of `rank` in the expert grid (order tp-ep-dp-pp, or
        tp-ep-pp-dp with --use-tp-pp-dp-mapping: Megatron-LM's expert RankGenerator)."""
        dims = (("etp", self.etp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp))
        if self.order == "tp-cp-pp-dp":
            dims = dims[:2] + dims[3:] + dims[2:3]
        out = {}
        for dim, size in dims:
            out[dim], rank = rank % size, rank // size
        return {d: out[d] for d in ("etp", "ep", "edp", "pp")}

    def expert_grid_groups(self, *dims: str) -> list[list[int]]:
        """The groups of ranks that vary along `dims` (of etp, ep, edp, pp) of the expert grid and
        agree on the others: ("etp",) the expert-TP groups, ("ep",) the EP groups, ("edp",) the
        expert-data-parallel groups, ("etp", "ep") Megatron-LM's expert tensor-and-model group."""
        by_key: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.expert_coords(r)
            by_key.setdefault(tuple(v for d, v in c.items() if d not in dims), []).append(r)
        return sorted(by_key.values())

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(EP groups, expert-data-parallel groups)."""
        return self.expert_grid_groups("ep"), self.expert_grid_groups("edp")

    def _dims(self) -> list[str]:
        return self.order.split("-")

    def _size(self, dim: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp}[dim]

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, pp, dp) coordinates of `rank`, by mixed-radix decoding in grid order."""
        out = {}
        for dim in self._dims():
            out[dim] = rank % self._size(dim)
            rank //= self._size(dim)
        return out

    def rank_of(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        coords = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        rank, stride = 0, 1
        for dim in self._dims():
            rank += coords[dim] * stride
            stride *= self._size(dim)
        return rank

    def groups(self, *dims: str) -> list[list[int]]:
        """All groups of ranks that vary along `dims` and agree on every other dimension.

        groups("tp") are the TP groups, groups("tp", "pp") the model-parallel groups (CP ranks
        hold the same model part, so they are not in it, as in Megatron-LM), groups("dp", "cp")
        the gradient-reduction groups, and so on. Every rank must create the groups in this same
        order, so the order is deterministic.
        """
        fixed = [d for d in DIMS if d not in dims]
        result = []
        for fixed_vals in itertools.product(*(range(self._size(d)) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = []
            for vals in itertools.product(*(range(self._size(d)) for d in dims)):
                members.append(self.rank_of(**base, **dict(zip(dims, vals))))
            result.append(sorted(members))
        return sorted(result)

    def hierarchical_cp_groups(self, sizes) -> list[list[list[int]]]:
        """--hierarchical-context-parallel-sizes: per level, the groups of ranks that differ only in
        that level's digit of the CP rank (mixed radix, the first level fastest: with sizes (2, 2)
        CP ranks {0, 1} and {2, 3} form the first level, {0, 2} and {1, 3} the second, as
        Megatron-LM's "every two adjacent ranks" and "the same odevity")."""
        if sizes is None:
            return []
        levels, stride = [], 1
        for size in sizes:
            groups = []
            for cp_group in self.groups("cp"):  # sorted by global rank, i.e. by CP rank
                for base in range(len(cp_group)):
                    if (base // stride) % size == 0:
                        groups.append([cp_group[base + i * stride] for i in range(size)])
            levels.append(sorted(groups))
            stride *= size
        return levels

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
    v_shape: bool = False  # zbv: chunk 1 of rank r is virtual stage 2p-1-r; rank 0 holds the loss
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    cp_group: object = None
    dp_cp_group: object = None  # gradient reduction / ZeRO-1 sharding: DP x CP
    mp_group: object = None
    embedding_group: object = None
    ep_group: object = None  # expert parallelism: other experts, tokens exchanged
    etp_group: object = None  # expert tensor parallelism: one expert's MLP split (the TP group when ETP = TP)
    expert_dp_group: object = None  # an expert's replicas: its gradient reduction, ZeRO sharding
    tp_dp_cp_group: object = None  # MoE: every rank of this pipeline stage (expert-bias token counts)
    tp_cp_group: object = None  # MoE: the ranks holding one micro-batch's tokens (TP under SP, x CP)
    hcp_groups: list = field(default_factory=list)  # --hierarchical-context-parallel-sizes: this rank's group per level
    # --num-distributed-optimizer-instances N: each replica group (DP x CP, an expert's expert-DP)
    # cut into N instances of consecutive ranks, the state sharded within an instance ("shard")
    # and the instances replicas of each other ("across"); N = 1: the shard groups are the
    # replica groups themselves and there is nothing across
    instances: int = 1
    dp_cp_shard_group: object = None
    dp_cp_shard_ranks: list[int] = field(default_factory=lambda: [0])
    dp_cp_across_group: object = None
    expert_dp_shard_group: object = None
    expert_dp_shard_ranks: list[int] = field(default_factory=lambda: [0])
    expert_dp_across_group: object = None
    groups: list = field(default_factory=list)  # every group this rank is in, for destroy()
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])
    cp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_cp_ranks: list[int] = field(default_factory=lambda: [0])
    embedding_ranks: list[int] = field(default_factory=lambda: [0])
    ep_ranks: list[int] = field(default_factory=lambda: [0])
    expert_dp_ranks: list[int] = field(default_factory=lambda: [0])
    etp_ranks: list[int] = field(default_factory=lambda: [0])

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
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def dp_cp_size(self) -> int:
        return self.grid.dp * self.grid.cp

    @property
    def ep_size(self) -> int:
        return self.grid.ep

    @property
    def etp_size(self) -> int:
        return self.grid.etp

    @property
    def etp_rank(self) -> int:
        return self.grid.expert_coords(self.rank)["etp"]

    @property
    def expert_dp_size(self) -> int:
        return self.grid.edp

    @property
    def separate_expert_grid(self) -> bool:
        """Whether experts have groups of their own (EP > 1 or ETP != TP): their weights are then
        replicated over the expert-DP group, not DP x CP."""
        return self.grid.separate_expert_grid

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(self.rank) if self.ep_size > 1 else 0

    @property
    def expert_dp_rank(self) -> int:
        return self.expert_dp_ranks.index(self.rank) if self.expert_dp_size > 1 else 0

    def replica_group(self, expert: bool):
        """The ranks holding the same copy of a weight: DP x CP, or for an MoE expert's weight
        (`expert`) its expert-data-parallel group."""
        return self.expert_dp_group if expert and self.separate_expert_grid else self.dp_cp_group

    def shard_group(self, expert: bool):
        """The ranks over which the distributed optimizer shards a weight's state: its replica
        group, or with --num-distributed-optimizer-instances this rank's instance of it."""
        if self.instances == 1:
            return self.replica_group(expert)
        return self.expert_dp_shard_group if expert and self.separate_expert_grid else self.dp_cp_shard_group

    def across_group(self, expert: bool):
        """The same shard in the other instances (None: one instance)."""
        if self.instances == 1:
            return None
        return self.expert_dp_across_group if expert and self.separate_expert_grid else self.dp_cp_across_group

    def instance_rank(self, expert: bool) -> int:
        """This rank's instance (0 with one)."""
        if self.instances == 1:
            return 0
        size = len(self.replica_ranks(expert)) // self.instances
        return self.replica_ranks(expert).index(self.rank) // size

    def replica_ranks(self, expert: bool) -> list[int]:
        return self.expert_dp_ranks if expert and self.separate_expert_grid else self.dp_cp_ranks

    def replica_rank(self, expert: bool) -> int:
        """This rank's place in `replica_group(expert)`."""
        return self.expert_dp_rank if expert and self.separate_expert_grid else self.dp_cp_rank

    @property
    def cp_rank(self) -> int:
        return self.grid.coords(self.rank)["cp"]

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in dp_cp_group (whose members are sorted by global rank)."""
        return self.dp_cp_ranks.index(self.rank) if self.dp_cp_size > 1 else 0

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
    def is_loss_stage(self) -> bool:
        """The pipeline rank whose last chunk computes the loss: the last, or rank 0 in a V (zbv)."""
        return self.pp_rank == (0 if self.v_shape else self.pp_size - 1)

    @property
    def next_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_logging_rank(self) -> bool:
        """The rank that owns the loss and writes logs: last stage, TP 0, CP 0, DP 0."""
        return self.rank == self.logging_rank

    @property
    def logging_rank(self) -> int:
        return self.grid.rank_of(tp=0, pp=0 if self.v_shape else self.pp_size - 1, dp=0, cp=0)

    def destroy(self) -> None:
        """Destroy the groups `initialize` made (the default group is its creator's to destroy)."""
        if dist.is_initialized():
            for g in self.groups:
                dist.destroy_process_group(g)
        self.groups = []

    def describe(self) -> str:
        cp = f" x CP {self.cp_size}" if self.cp_size > 1 else ""
        etp = f"ETP {self.etp_size} x " if self.etp_size != self.tp_size else ""
        ep = f", {etp}EP {self.ep_size} x expert-DP {self.expert_dp_size}" if self.separate_expert_grid else ""
        return (f"world {self.world_size} = TP {self.tp_size}{cp} x PP {self.pp_size} x DP {self.dp_size}{ep}"
                f" (order {self.grid.order}" + (f", {self.vpp} virtual stages" if self.vpp > 1 else "")
                + ")")


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, layout: str | None = None,
                 v_shape: bool = False) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each model chunk on pipeline rank `pp_rank`.

    Megatron-LM's interleaved assignment: with v chunks per rank, chunk c of rank r holds the
    layers starting at c·L/v + r·L/(p·v); with v = 1 that is L/p contiguous layers per stage.
    `v_shape` (zbv, 2 chunks): chunk 1 of rank r is virtual stage 2p-1-r, so rank 0 holds the
    first and the last L/(2p) layers.
    """
    if layout is not None:  # --pipeline-model-parallel-layout: the stages as it lists them
        return layout_of(layout, pp).chunk_layers(pp_rank)
    per_chunk = num_layers // (pp * vpp)
    if v_shape:
        return [(pp_rank * per_chunk, per_chunk), ((2 * pp - 1 - pp_rank) * per_chunk, per_chunk)]
    return [(c * num_layers // vpp + pp_rank * per_chunk, per_chunk) for c in range(vpp)]


def single_process_state() -> ParallelState:
    """The trivial grid: every group has one member and no collective is issued."""
    return ParallelState(grid=RankGrid(1))


def split_instances(groups: list[list[int]], n: int) -> list[list[int]]:
    """Each group cut into `n` instances of consecutive members (Megatron-LM's intra-instance
    partial data-parallel groups)."""
    size = len(groups[0]) // n
    return [g[i * size:(i + 1) * size] for g in groups for i in range(n)]


def across_instances(groups: list[list[int]], n: int) -> list[list[int]]:
    """The members at the same place of each instance (Megatron-LM's inter-instance groups)."""
    size = len(groups[0]) // n
    return [g[j::size] for g in groups for j in range(size)]


def initialize(tp: int = 1, pp: int = 1, vpp: int = 1, order: str = "tp-cp-dp-pp",
               timeout_minutes: float | None = None, cp: int = 1, ep: int = 1, moe: bool = False,
               etp: int | None = None, hierarchical_cp: list[int] | None = None,
               instances: int = 1) -> ParallelState:
    """Create every process group of the grid; torch.distributed must already be initialised
    (or the world must be a single process). `timeout_minutes` bounds each group's collectives
    (new groups do not inherit the default group's timeout: torch gives them its own default)."""
    if not dist.is_initialized():
        grid = RankGrid(1, tp, pp, order, cp, ep, etp)
        return ParallelState(grid=grid, vpp=vpp)  # (one rank: one instance)
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid(world, tp, pp, order, cp, ep, etp)
    ps = ParallelState(grid=grid, rank=rank, vpp=vpp)

    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes is not None else None

    def make(groups: list[list[int]]):
        """(this rank's group, its ranks). A group of one rank is None: comm treats None as a
        group of size one, and each real group costs a rendezvous, a gloo context and its
        threads (or an NCCL communicator). The groups of one dimension are all of one size, so
        every rank skips the same ones and the creation order stays the same everywhere."""
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                mine = (g, ranks)
                if g is not None:
                    ps.groups.append(g)
        return mine

    ps.tp_group, ps.tp_ranks = make(grid.groups("tp"))
    ps.pp_group, ps.pp_ranks = make(grid.groups("pp"))
    ps.dp_group, ps.dp_ranks = make(grid.groups("dp"))
    ps.cp_group, ps.cp_ranks = make(grid.groups("cp"))
    ps.dp_cp_group, ps.dp_cp_ranks = make(grid.groups("dp", "cp"))
    ps.mp_group, _ = make(grid.groups("tp", "pp"))
    # MoE's groups only for an MoE model, and only those that differ from one above: each group
    # costs a rendezvous at start-up (and, with NCCL, a communicator's memory)
    ps.expert_dp_group, ps.expert_dp_ranks = ps.dp_cp_group, ps.dp_cp_ranks
    ps.etp_group, ps.etp_ranks = ps.tp_group, ps.tp_ranks
    if grid.separate_expert_grid:
        ps.ep_group, ps.ep_ranks = make(grid.expert_grid_groups("ep"))
        ps.expert_dp_group, ps.expert_dp_ranks = make(grid.expert_grid_groups("edp"))
        if grid.etp != tp:
            ps.etp_group, ps.etp_ranks = make(grid.expert_grid_groups("etp"))
    if moe:
        ps.tp_cp_group = ps.tp_group if cp == 1 else ps.cp_group if tp == 1 else make(grid.groups("tp", "cp"))[0]
        ps.tp_dp_cp_group = make(grid.groups("tp", "dp", "cp"))[0]
    ps.hcp_groups = [make(level)[0] for level in grid.hierarchical_cp_groups(hierarchical_cp)]
    if instances > 1:  # --num-distributed-optimizer-instances (Megatron-LM's intra/inter partial DP groups)
        ps.instances = instances
        ps.dp_cp_shard_group, ps.dp_cp_shard_ranks = make(split_instances(grid.groups("dp", "cp"), instances))
        ps.dp_cp_across_group = make(across_instances(grid.groups("dp", "cp"), instances))[0]
        if grid.separate_expert_grid:
            experts = grid.expert_grid_groups("edp")
            ps.expert_dp_shard_group, ps.expert_dp_shard_ranks = make(split_instances(experts, instances))
            ps.expert_dp_across_group = make(across_instances(experts, instances))[0]
    emb = make(grid.embedding_groups())
    # ranks outside the first/last stage belong to no embedding group
    if emb is not None:
        ps.embedding_group, ps.embedding_ranks = emb
    else:
        ps.embedding_group, ps.embedding_ranks = None, []
    return ps
