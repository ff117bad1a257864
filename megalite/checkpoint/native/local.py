"""--non-persistent-ckpt-type local: each rank's own state in its own directory, replicated on peers.

A persistent checkpoint (save.py) is written for any future layout: pieces spread over ranks, a
global index, one directory every rank can read. A non-persistent one is for the next restart of
this very job, on the same layout: each rank writes exactly what it holds (its parameters, the
masters and moments its optimizer steps, buffers, RNG states, counters) as one safetensors file
into its own directory, `<dir>/rank_RRRRR/iter_NNNNNNN/state_RRRRR.safetensors` (the directory can be
a node-local SSD or a RAM disk: nothing else reads it), with no collective but the replication.
Only the latest is kept. Loading one on the same layout restores every rank bit for bit.

Losing a rank's node loses its disk. With --replication, as Megatron-LM's (nvidia-resiliency-ext's
replication strategy), the ranks form groups of --replication-factor ranks --replication-jump
apart ({n, n+J, ..., n+(F-1)J} in blocks of J·F ranks: with J the ranks per node, every copy is on
another node); each rank also writes the states of its group's other members, sent to it point to
point at the save. A resume takes, for each rank, its own file or a group member's copy of it (sent
back to it), at the newest iteration every rank can get (`newest`, `restore`).
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load, save as st_save

from ... import comm
from ...errors import CheckpointError, InputError
from ..paths import TRACKER, iteration_dir, read_tracker
from .save import _write_text_atomic
from .state import TrainState, rng_state, set_rng_state



def replication_groups(world: int, jump: int, factor: int) -> list[list[int]]:
    """The replication groups: in each block of jump·factor ranks, {b+i, b+i+J, ..., b+i+(F-1)J}."""
    if factor < 1 or jump < 1 or world % (jump * factor):
        raise InputError(f"--replication-jump {jump} x --replication-factor {factor} must divide the world size "
                         f"({world})")
    return [[b + i + k * jump for k in range(factor)] for b in range(0, world, jump * factor) for i in range(jump)]


# -- one rank's state ---------------------------------------------------------------------------------
def snapshot(ts: TrainState) -> tuple[dict, dict]:
    """Host copies of everything this rank holds of the run's state (tensors), and its counters."""
    opt = ts.optimizer
    opt.dp.finish_param_sync()
    tensors = {f"param/{i}": p.detach().to("cpu", copy=True).contiguous() for i, (_, p) in enumerate(ts.named_params)}
    for i, (_, b) in enumerate(ts.named_buffers):
        tensors[f"buffer/{i}"] = b.detach().to("cpu", copy=True).contiguous()
    for i, (_, _, _, m) in enumerate(opt.pieces()):
        if not opt.fp32_params:
            tensors[f"master/{i}"] = m.detach().to("cpu", copy=True).contiguous()
        for kind, t in opt.optimizer.state.get(m, {}).items():
            if torch.is_tensor(t):
                tensors[f"state/{i}/{kind}"] = t.detach().to("cpu", copy=True).contiguous()
    rng_tensors, rng_values = rng_state(ts)
    tensors.update(rng_tensors)
    ps = ts.ps
    values = {"iteration": ts.iteration, "consumed_samples": ts.consumed_samples, "rng": rng_values,
              "scheduler": ts.scheduler.state_dict(), "step": opt.step_count(),
              "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
              "spike_guard": ts.spike_guard.state_dict() if ts.spike_guard is not None else None,
              "layout": [ps.world_size, ps.tp_size, ps.pp_size, ps.cp_size, ps.rank],
              "names": [n for n, _ in ts.named_params]}
    return tensors, values


def restore(ts: TrainState, tensors: dict, values: dict) -> None:
    """Put a snapshot of this rank back, in place (the same layout: checked by `fits`)."""
    opt = ts.optimizer
    with torch.no_grad():
        for i, (_, p) in enumerate(ts.named_params):
            p.copy_(tensors[f"param/{i}"])
        for i, (_, b) in enumerate(ts.named_buffers):
            b.copy_(tensors[f"buffer/{i}"])
        for i, (_, _, _, m) in enumerate(opt.pieces()):
            if not opt.fp32_params:
                m.copy_(tensors[f"master/{i}"])
            for kind, t in opt.optimizer.state.get(m, {}).items():
                if torch.is_tensor(t):
                    t.copy_(tensors[f"state/{i}/{kind}"])
    if values["step"] is not None:
        opt.set_step_count(values["step"])
    ts.scheduler.load_state_dict(values["scheduler"])
    if opt.scaler is not None:
        opt.scaler.load_state_dict(values["scaler"])
    if ts.spike_guard is not None:
        ts.spike_guard.load_state_dict(values["spike_guard"])
    set_rng_state(ts, {k: v for k, v in tensors.items() if k.startswith("rng/")}, values["rng"])
    ts.iteration, ts.consumed_samples = int(values["iteration"]), int(values["consumed_samples"])


def fits(ts: TrainState, values: dict) -> bool:
    ps = ts.ps
    return (values["layout"] == [ps.world_size, ps.tp_size, ps.pp_size, ps.cp_size, ps.rank]
            and values["names"] == [n for n, _ in ts.named_params])


def to_bytes(tensors: dict, values: dict) -> bytes:
    return st_save(tensors, metadata={"values": json.dumps(values)})


def from_bytes(blob: bytes) -> tuple[dict, dict]:
    (n,) = struct.unpack("<Q", blob[:8])
    values = json.loads(json.loads(blob[8:8 + n])["__metadata__"]["values"])
    return st_load(blob), values


# -- the directory of each rank -----------------------------------------------------------------------
class LocalCheckpointer:
    """Saves and finds this rank's non-persistent checkpoints (and its group members' copies)."""
    kind = "local"

    def __init__(self, root: str, ps, group: list[int]):
        self.root, self.ps, self.group = root, ps, group
        self.dir = os.path.join(root, f"rank_{ps.rank:05d}")

    def where(self, iteration: int) -> str:
        return f"under {self.root}"

    def _file(self, iteration: int, owner: int) -> str:
        return os.path.join(iteration_dir(self.dir, iteration), f"state_{owner:05d}.safetensors")

    def save(self, ts: TrainState, iteration: int) -> None:
        blob = to_bytes(*snapshot(ts))
        peers = [r for r in self.group if r != self.ps.rank]
        sizes = comm.all_gather_object(len(blob), comm.world_group())
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        got = {r: torch.empty(sizes[r], dtype=torch.uint8) for r in peers}
        comm.exchange([dist.P2POp(dist.isend, mine, r) for r in peers]
                      + [dist.P2POp(dist.irecv, got[r], r) for r in peers])
        self._keep(iteration, {self.ps.rank: blob, **{r: got[r].numpy().tobytes() for r in peers}})

    # -- where the states live: this rank's directory (checkpoint/native/memory.py: host memory) ----
    def _keep(self, iteration: int, blobs: dict[int, bytes]) -> None:
        """Iteration `iteration`'s states ({owner: bytes}) kept as the latest, atomically."""
        tmp = iteration_dir(self.dir, iteration) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for owner, data in blobs.items():
            with open(os.path.join(tmp, f"state_{owner:05d}.safetensors"), "wb") as f:
                f.write(data)
        previous = read_tracker(self.dir)
        final = iteration_dir(self.dir, iteration)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_text_atomic(os.path.join(self.dir, TRACKER), f"{iteration}\n")
        if previous is not None and previous != iteration:  # non-persistent: only the latest is kept
            shutil.rmtree(iteration_dir(self.dir, previous), ignore_errors=True)

    def _read(self, iteration: int, owner: int) -> bytes:
        with open(self._file(iteration, owner), "rb") as f:
            return f.read()

    def _size(self, iteration: int, owner: int) -> int | None:
        path = self._file(iteration, owner)
        return os.path.getsize(path) if os.path.isfile(path) else None

    def _held(self) -> list[tuple[int, int]]:
        """(iteration, owner) of every state this rank holds."""
        try:
            it = read_tracker(self.dir)
        except CheckpointError:
            return []
        if it is None:
            return []
        return [(it, r) for r in self.group if os.path.isfile(self._file(it, r))]

    def newest(self) -> tuple[int, dict] | None:
        """The newest iteration whose states are all held somewhere (one small all-gather), and for
        each rank who supplies its state (itself, or a group member holding a copy); None: none."""
        everyone = comm.all_gather_object(self._held(), comm.world_group())
        holders = {}  # (owner, iteration) -> the ranks holding that state
        for rank, held in enumerate(everyone):
            for it, owner in held:
                holders.setdefault((owner, it), []).append(rank)
        common = set.intersection(*({it for (o, it) in holders if o == r} for r in range(self.ps.world_size)))
        if not common:
            return None
        it = max(common)
        return it, {r: (r if r in holders[(r, it)] else min(holders[(r, it)])) for r in range(self.ps.world_size)}

    def restore(self, ts: TrainState, it: int, source: dict) -> int:
        """Every rank's state of iteration `it` put back (`newest`'s answer); returns `it`."""
        tensors, values = from_bytes(self._fetch(it, source))
        if not fits(ts, values):
            raise CheckpointError(f"{self.where(it)}: a local checkpoint of another layout or model; "
                                  "local checkpoints resume the same job only (drop the directory to start from "
                                  "--load's)")
        restore(ts, tensors, values)
        lost = sorted(r for r, s in source.items() if s != r)
        ts.log(f"> resumed from the {self.kind} non-persistent checkpoint of iteration {it} {self.where(it)}"
               + (f" (rank(s) {lost} from their replicas)" if lost else ""))
        return it

    def _fetch(self, it: int, source: dict) -> bytes:
        """This rank's state at `it`: read here, or received from the rank holding its copy (which
        sends it); sizes travel first, in one small all-gather."""
        me = self.ps.rank
        sends = [r for r, s in source.items() if s == me and r != me]
        sizes = comm.all_gather_object({r: self._size(it, r) for r in sends + [me]}, comm.world_group())
        ops, keep = [], []
        for r in sends:
            keep.append(torch.frombuffer(bytearray(self._read(it, r)), dtype=torch.uint8))
            ops.append(dist.P2POp(dist.isend, keep[-1], r))
        if source[me] != me:
            got = torch.empty(sizes[source[me]][me], dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, got, source[me]))
        comm.exchange(ops)
        return got.numpy().tobytes() if source[me] != me else self._read(it, me)


__all__ = ["LocalCheckpointer", "from_bytes", "replication_groups", "restore", "snapshot", "to_bytes"]
