"""--non-persistent-ckpt-type in_memory: each rank's state in host memory, replicated on peers.

The same snapshot as a local checkpoint (native/local.py: parameters, masters, moments, buffers,
RNG states, counters and data position, one safetensors blob per rank), exchanged with the same
--replication groups, but kept in this process's memory instead of a file: saving costs a copy
and the exchange, not a write. Memory survives a failure only in a surviving process, so this
serves in-process restart (megalite/inprocess/): `HostSnapshots` belongs to the worker's restart
loop, outside any one `pretrain`, and the next generation restores from it. A replacement process
starts empty and gets its state from a peer of its replication group (`restore`'s `_fetch`).

Two iterations are kept, not one: a fault can strike during a save's exchange, after some ranks
kept iteration k and before others did; every rank still holds k - 1 (its own and its peers'),
so the newest iteration every state is held at (`newest`) always exists.
"""
from __future__ import annotations

from .local import LocalCheckpointer

KEEP = 2


class HostSnapshots:
    """The snapshots this process holds: {iteration: {owner rank: safetensors bytes}}, the newest
    KEEP iterations. Outlives a generation (owned by inprocess/worker.py)."""

    def __init__(self):
        self.by_iteration: dict[int, dict[int, bytes]] = {}

    def keep(self, iteration: int, blobs: dict[int, bytes]) -> None:
        self.by_iteration[iteration] = dict(blobs)
        for old in sorted(self.by_iteration)[:-KEEP]:
            del self.by_iteration[old]

    def nbytes(self) -> int:
        return sum(len(b) for blobs in self.by_iteration.values() for b in blobs.values())


class InMemoryCheckpointer(LocalCheckpointer):
    """LocalCheckpointer with `HostSnapshots` for the directory."""
    kind = "in_memory"

    def __init__(self, memory: HostSnapshots, ps, group: list[int]):
        self.root, self.ps, self.group, self.memory = None, ps, group, memory

    def where(self, iteration: int) -> str:
        return "in host memory"

    def _keep(self, iteration: int, blobs: dict[int, bytes]) -> None:
        self.memory.keep(iteration, blobs)

    def _read(self, iteration: int, owner: int) -> bytes:
        return self.memory.by_iteration[iteration][owner]

    def _size(self, iteration: int, owner: int) -> int | None:
        blob = self.memory.by_iteration.get(iteration, {}).get(owner)
        return None if blob is None else len(blob)

    def _held(self) -> list[tuple[int, int]]:
        return [(it, owner) for it, blobs in self.memory.by_iteration.items() for owner in blobs]


__all__ = ["HostSnapshots", "InMemoryCheckpointer"]
