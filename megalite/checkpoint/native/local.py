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

    def __init__(self, root: str, ps, group: list[int]):
        self.root, self.ps, self.group = root, ps, group
        self.dir = os.path.join(root, f"rank_{ps.rank:05d}")

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
        tmp = iteration_dir(self.dir, iteration) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for owner, data in [(self.ps.rank, blob)] + [(r, got[r].numpy().tobytes()) for r in peers]:
            with open(os.path.join(tmp, f"state_{owner:05d}.safetensors"), "wb") as f:
                f.write(data)
        previous = read_tracker(self.dir)
        final = iteration_dir(self.dir, iteration)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_text_atomic(os.path.join(self.dir, TRACKER), f"{iteration}\n")
        if previous is not None and previous != iteration:  # non-persistent: only the latest is kept
            shutil.rmtree(iteration_dir(self.dir, previous), ignore_errors=True)

    def held(self) -> tuple[int | None, list[int]]:
        """The iteration of this rank's latest local checkpoint, and whose states it holds there."""
        try:
            it = read_tracker(self.dir)
        except CheckpointError:
            return None, []
        if it is None:
            return None, []
        return it, [r for r in self.group if os.path.isfile(self._file(it, r))]

    def newest(self) -> tuple[int, dict] | None:
        """The newest iteration whose states are all held somewhere (one small all-gather), and for
        each rank who supplies its state (itself, or a group member holding a copy); None: none."""
        everyone = comm.all_gather_object(self.held(), comm.world_group())
        holders = {}  # (owner, iteration) -> the ranks holding that state
        for rank, (it, owners) in enumerate(everyone):
            for owner in owners:
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
            raise CheckpointError(f"{self._file(it, self.ps.rank)}: a local checkpoint of another layout or model; "
                                  "local checkpoints resume the same job only (drop the directory to start from "
                                  "--load's)")
        restore(ts, tensors, values)
        lost = sorted(r for r, s in source.items() if s != r)
        ts.log(f"> resumed from the local non-persistent checkpoint of iteration {it} under {self.root}"
               + (f" (rank(s) {lost} from their replicas)" if lost else ""))
        return it

    def _fetch(self, it: int, source: dict) -> bytes:
        """This rank's state at `it`: read here, or received from the rank holding its copy (which
        sends it); sizes travel first, in one small all-gather."""
        me = self.ps.rank
        sends = [r for r, s in source.items() if s == me and r != me]
        sizes = comm.all_gather_object({r: os.path.getsize(self._file(it, r)) for r in sends + [me]
                                        if os.path.isfile(self._file(it, r))}, comm.world_group())
        ops, keep = [], []
        for r in sends:
            with open(self._file(it, r), "rb") as f:
                keep.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
            ops.append(dist.P2POp(dist.isend, keep[-1], r))
        if source[me] != me:
            got = torch.empty(sizes[source[me]][me], dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, got, source[me]))
        comm.exchange(ops)
        if source[me] != me:
            return got.numpy().tobytes()
        with open(self._file(it, me), "rb") as f:
            return f.read()


__all__ = ["LocalCheckpointer", "from_bytes", "replication_groups", "restore", "snapshot", "to_bytes"]
