"""Loading a checkpoint of any format (megalite's, Megatron-LM's torch_dist or torch) on any
layout: each rank reads the elements it owns in this run (state.owned_pieces) from the saved
pieces that overlap them (native/region.py's `read_region`, the one reader of saved pieces), and
group sums bring the rest (see the package docstring)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .. import comm
from ..errors import CheckpointError
from ..tensor_parallel.param_info import param_info
from .files import read_metadata
from .megatron.legacy import open_megatron
from .native.index import INDEX, open_index
from .native.region import read_region
from .native.reshard import ShardLayout
from .native.state import STATE_KINDS, TrainState, check_model_config, owned_pieces, set_rng_state, target_layout
from .native.tensor_file import RangeReader
from .paths import FORMAT_VERSION, TRACKER, iteration_dir, read_tracker



@dataclass
class LoadStats:
    """What one rank's load cost: bytes read and files opened (the tracker file included)."""
    bytes_read: int = 0
    files_opened: int = 0
    seconds: float = 0.0


def open_checkpoint(root: str, iteration: int | None = None, io: RangeReader | None = None):
    """(metadata, index) of the latest (or given) checkpoint under `root`: format 2 reads the
    global index only (its header holds the metadata); format 1 every rank index."""
    io = io or RangeReader()
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"no checkpoint under {root}: {TRACKER} is missing")
        io.opened.add(tracker)
        io.bytes_read += os.path.getsize(tracker)
    directory = iteration_dir(root, iteration)
    foreign = open_megatron(directory, io)  # Megatron-LM's torch_dist or torch, else None
    if foreign is not None:
        index, meta = foreign, dict(foreign.metadata)
    elif os.path.isfile(os.path.join(directory, INDEX)):
        index = open_index(directory, {"format_version": FORMAT_VERSION}, io)
        meta = dict(index.metadata)
    else:
        meta = read_metadata(root, iteration)
        if int(meta["format_version"]) >= 2:
            raise CheckpointError(f"{directory}/{INDEX} is missing: {directory} is not a complete checkpoint")
        io.opened.add(os.path.join(directory, "metadata.json"))
        index = open_index(directory, meta, io)
    meta["dir"] = directory
    return meta, index


def load_checkpoint(train_state: TrainState, root: str, finetune: bool = False, load_optim: bool = True,
                    load_rng: bool = True, strictness: str = "assume_ok_unexpected",
                    verify_integrity: bool = False) -> int:
    """Load the latest checkpoint under `root` into `train_state`; returns its iteration (0 with
    --finetune). No checkpoint there: a notice, and training starts from scratch. What this rank
    read is left in `train_state.load_stats`. `strictness`: Megatron-LM's --dist-ckpt-strictness
    (`mismatches`); `verify_integrity`: the files checked against their integrity.json first."""
    ps, opt = train_state.ps, train_state.optimizer
    if read_tracker(root) is None:
        train_state.log(f"> no checkpoint found under {root} ({TRACKER} missing): training from scratch")
        return 0
    start = time.perf_counter()
    io = RangeReader()
    meta, index = open_checkpoint(root, io=io)
    where = meta["dir"]
    if verify_integrity:  # rank 0 hashes, every rank learns the outcome (Megatron-LM's verify_integrity_manifest)
        from .files import verify_integrity as verify
        outcome = [None]
        if ps.rank == 0:
            try:
                verify(where)
            except CheckpointError as e:
                outcome = [str(e)]
        outcome = comm.all_gather_object(outcome[0], comm.world_group())[0]
        if outcome:
            raise CheckpointError(outcome)
    current = train_state.model_config.to_dict()
    foreign = getattr(index, "foreign", None)
    # a Megatron-LM checkpoint's args name some settings only (none without args): those are
    # compared, the weights' shapes always
    saved = {k: v for k, v in meta["model_config"].items() if k not in meta.get("derived", ())}
    check_model_config({**current, **saved} if foreign else saved, current, where)
    restore_optim = load_optim and not finetune
    if foreign and restore_optim and not meta["has_optimizer_state"]:
        train_state.log(f"> {where} ({foreign}) holds no Adam moments in a layout-independent form (a "
                        "non-distributed optimizer's optimizer.state.exp_avg.*): the moments start at zero; "
                        "weights, iteration, consumed samples and the LR schedule are read")
    elif restore_optim and not meta.get("has_optimizer_state", True):
        raise CheckpointError(f"{where} holds weights only (no optimizer state); "
                              "load it with --no-load-optim or --finetune")
    if restore_optim:
        _check_same_optimizer(meta, train_state.config["optimizer"])
    lay = meta["layout"]
    same_layout = ((lay["world_size"], lay["tp"], lay["pp"], lay.get("cp", 1))
                   == (ps.world_size, ps.tp_size, ps.pp_size, ps.cp_size))
    reader = _OwnedReader(train_state, index, mismatches(train_state, index, strictness, where))
    index.prefetch([f"param/{reader.names[id(pc[0])]}" for pc in reader.owned]
                   + ([f"rank/{ps.rank}"] if same_layout else []))
    with torch.no_grad():
        _load_weights(train_state, reader)
        _load_buffers(train_state, index)
        _load_optimizer_state(train_state, reader, restore_optim and meta.get("has_optimizer_state", True), meta)
        if opt.fp32_params:
            opt.masters_from_params()
    if finetune:
        _finish_stats(train_state, io, start)
        train_state.log(f"> loaded weights from {where} (--finetune: iteration 0, fresh optimizer)")
        return 0
    iteration = int(meta["iteration"])
    _restore_progress(train_state, meta, index, restore_optim, load_rng and same_layout, load_rng)
    _finish_stats(train_state, io, start)
    train_state.log(f"> loaded {foreign + ' ' if foreign else ''}checkpoint {where} (iteration {iteration}, "
                    f"written with TP {lay['tp']} x PP {lay['pp']} "
                    f"x DP {lay['dp']}{', distributed optimizer' if lay['distributed_optimizer'] else ''})")
    return iteration


def _optimizer_kind(optimizer: str, config: dict) -> str:
    if optimizer == "muon":
        return f"muon with --muon-scalar-optimizer {config.get('muon_scalar_optimizer', 'adam')}"
    return optimizer


def _check_same_optimizer(meta: dict, current: dict) -> None:
    """The optimizer state of one optimizer is meaningless to another (Adam's moments are not
    Muon's momentum): resuming it across --optimizer is refused."""
    saved = _optimizer_kind(meta["optimizer"]["type"], meta.get("config", {}).get("optimizer", {}))
    mine = _optimizer_kind(current["optimizer"], current)
    if saved != mine:
        raise CheckpointError(f"{meta['dir']} holds the state of --optimizer {saved}, this run uses --optimizer "
                              f"{mine}: load it with --no-load-optim (its weights, a fresh optimizer state)")


def mismatches(train_state: TrainState, index, strictness: str, where: str) -> set:
    """--dist-ckpt-strictness (Megatron-LM's StrictHandling, in its words "unexpected" keys: ones
    this model asks for and the checkpoint lacks; "missing": ones the checkpoint holds and this
    model does not ask for). Returns the parameters to leave as initialised: the ones the
    checkpoint lacks, where the mode allows that; raises where it does not; logs where it says so."""
    names = [n for n, _ in train_state.named_params]
    lacking = [n for n in names if index.entry(n) is None]
    if strictness in ("raise_all", "log_all"):  # the checkpoint's extra tensors, against every stage's
        everyone = comm.all_gather_object(names, comm.world_group())
        known = {n for part in everyone for n in part} | {n for n, _ in train_state.named_buffers}
        extra = [n for n in index.names() if n not in known]
        if extra and strictness == "raise_all":
            raise CheckpointError(f"--dist-ckpt-strictness raise_all: {where} holds tensors this model does not have: "
                                  f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
        if extra:
            train_state.log(f"> --dist-ckpt-strictness log_all: {where} holds {len(extra)} tensors this model does "
                            f"not have, not read: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    if not lacking:
        return set()
    shown = f"{', '.join(lacking[:5])}{' ...' if len(lacking) > 5 else ''}"
    if strictness in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        raise CheckpointError(f"{where} has no param for {shown} (--dist-ckpt-strictness {strictness}; "
                              f"log_unexpected, log_all, return_* or ignore_all keep them as initialised)")
    if strictness.startswith("log_"):
        train_state.log(f"> --dist-ckpt-strictness {strictness}: {where} lacks {len(lacking)} parameters of this "
                        f"model, kept as initialised: {shown}")
    return set(lacking)


class _OwnedReader:
    """Reads, from one checkpoint's index, the pieces this rank owns in this run (`absent`: the
    parameters the checkpoint lacks, left as initialised by --dist-ckpt-strictness)."""

    def __init__(self, train_state: TrainState, index, absent: set = frozenset()):
        self.index, self.ps = index, train_state.ps
        self.names = {id(p): n for n, p in train_state.named_params}
        self.absent = {id(p) for n, p in train_state.named_params if n in absent}
        self.owned = [pc for pc in owned_pieces(train_state) if id(pc[0]) not in self.absent]

    def has(self, name: str, kind: str) -> bool:
        found = self.index.entry(name)
        return found is not None and any(pc.kind == kind for pc in found[1])

    def read(self, p, kind: str, lo: int, hi: int) -> torch.Tensor:
        tp_rank = param_info(p).tp_place(self.ps.tp_rank, self.ps.tp_size)[0]  # an MoE expert's: its ETP rank
        return read_region(self.index, self.names[id(p)], kind, target_layout(p, self.ps.tp_size), tp_rank,
                           lo, hi, tied=param_info(p).tied_copy)


def _load_weights(train_state: TrainState, reader: _OwnedReader) -> None:
    """Owners read, the group sums bring the weights to everyone else (who hold zeros). What a
    rank stores of a parameter: all of it, or under ZeRO-3 its slices (whose DP ranks own
    disjoint parts, so nothing is summed over DP there)."""
    ps, opt, names = train_state.ps, train_state.optimizer, reader.names
    prefer_master = opt.fp32_params  # an fp32 run takes the fp32 masters of a 16-bit checkpoint
    stored = [pc for pc in opt.dp.param_pieces() if id(pc[0]) not in reader.absent]
    for _, _, _, t in stored:
        t.zero_()
    for p, lo, hi, _ in reader.owned:
        if param_info(p).tied_copy and not ps.v_shape:
            continue  # arrives from the first stage over the embedding group (zbv: read here, beside it)
        kind = "master" if prefer_master and reader.has(names[id(p)], "master") else "param"
        t = opt.dp.param_slice(p, lo, hi)
        t.copy_(reader.read(p, kind, lo, hi).to(t.dtype))
    _sum_to_all([(p, t) for p, _, _, t in stored], ps, replicated_over_dp=not opt.dp.strategy.shards_params)


def _load_buffers(train_state: TrainState, index) -> None:
    """Every rank reads its persistent buffers whole (a checkpoint without one leaves it as built)."""
    for name, b in train_state.named_buffers:
        if index.entry(name) is not None:
            b.copy_(read_region(index, name, "param", ShardLayout(tuple(b.shape)), 0, 0, b.numel()).view_as(b))


def _load_optimizer_state(train_state: TrainState, reader: _OwnedReader, restore_optim: bool, meta: dict) -> None:
    """Masters (16-bit runs) and moments of the pieces this rank steps, read where this rank
    owns them, summed over the groups that share them."""
    ps, opt, names = train_state.ps, train_state.optimizer, reader.names
    owned_ids = {(id(p), lo) for p, lo, _, _ in reader.owned}
    to_sum = []
    for p, lo, hi, master in opt.pieces():
        if id(p) in reader.absent:  # left as initialised: its master is the weight's, a fresh state
            continue
        name, state = names[id(p)], opt.optimizer.state.get(master, {})
        mine = (id(p), lo) in owned_ids
        # fp32 runs: the master is the parameter (or a view of it), loaded with the weights, or a
        # host copy of it (offload), copied after
        tensors = [] if opt.fp32_params else [(master, "master" if mine and reader.has(name, "master") else "param")]
        tensors += [(state[k], k) for k in STATE_KINDS if restore_optim and k in state]
        for t, kind in tensors:
            if not mine:
                t.zero_()
                continue
            if not reader.has(name, kind):
                raise CheckpointError(f"{meta['dir']} has no optimizer state {kind!r} for {name} (written with "
                                      f"--optimizer {meta['optimizer']['type']}); use --no-load-optim")
            t.view(-1).copy_(reader.read(p, kind, lo, hi))
        to_sum.append((p, [t for t, _ in tensors]))
    _sum_optimizer_state(to_sum, ps, replicated_over_dp=not opt.distributed)


def _restore_progress(train_state: TrainState, meta: dict, index, restore_optim: bool, restore_rng: bool,
                      load_rng: bool) -> None:
    """Where the run stood: consumed samples, the spike guard's window, the optimizer's step
    count, the schedule and loss scaler, and (on the layout that saved it) this rank's RNG states."""
    ps, opt, lay = train_state.ps, train_state.optimizer, meta["layout"]
    train_state.consumed_samples = int(meta["consumed_samples"])
    if train_state.spike_guard is not None:  # the losses of these weights' run (none saved: an empty guard)
        train_state.spike_guard.load_state_dict(meta.get("spike_guard"))
    if restore_optim:
        if index.optimizer_step is not None and meta.get("has_optimizer_state", True):  # with its moments only
            opt.set_step_count(index.optimizer_step)
        if meta["scheduler"] is not None:  # None: a Megatron-LM checkpoint without opt_param_scheduler
            train_state.scheduler.load_state_dict(meta["scheduler"])
        if opt.scaler is not None and meta.get("grad_scaler"):
            opt.scaler.load_state_dict(meta["grad_scaler"])
    saved_rng = index.rank_state(ps.rank) if restore_rng else None
    if saved_rng is not None and saved_rng[0]:
        set_rng_state(train_state, saved_rng[1], saved_rng[0])
    elif load_rng and getattr(index, "foreign", None):
        train_state.log(f"> {index.foreign}: RNG states are not restored (Megatron-LM's are per rank of its layout)")
    elif load_rng:
        train_state.log(f"> checkpoint layout (world {lay['world_size']}, TP {lay['tp']}, PP {lay['pp']}) differs from "
                        "this run's: RNG states are not restored (dropout masks will differ from an uninterrupted run)")


def _finish_stats(train_state: TrainState, io: RangeReader, start: float) -> None:
    io.close()
    train_state.load_stats = LoadStats(io.bytes_read, len(io.opened), time.perf_counter() - start)


def _sum_to_all(stored: list, ps, replicated_over_dp: bool) -> None:
    """Complete what only the owners filled (zeros elsewhere), given as (param, tensor stored
    of it) pairs: over TP for the TP-replicated, over DP, then over the embedding group for the
    tied pair. Each phase walks the same list in the same order on every member of its groups
    (TP ranks, and the tied embedding's two stages, lay their slices out alike)."""
    for p, t in stored:
        if not param_info(p).tensor_parallel:
            _sum(t, ps.tp_group)
    if replicated_over_dp:
        for p, t in stored:
            _sum(t, ps.replica_group(param_info(p).expert_parallel))
    elif ps.instances > 1:  # ZeRO-3 slices: the first instance read them, the others are its replicas
        for p, t in stored:
            _sum(t, ps.across_group(param_info(p).expert_parallel))
    for p, t in stored:
        if param_info(p).embedding_group_sync and not ps.v_shape:  # zbv: both copies read on one rank
            _sum(t, ps.embedding_group)


def _sum_optimizer_state(pieces: list, ps, replicated_over_dp: bool) -> None:
    """Masters and moments: over TP for TP-replicated parameters; over DP with the plain
    optimizer (whose state every DP rank holds whole)."""
    for p, tensors in pieces:
        if not param_info(p).tensor_parallel:
            for t in tensors:
                _sum(t, ps.tp_group)
    if replicated_over_dp:
        for p, tensors in pieces:
            for t in tensors:
                _sum(t, ps.replica_group(param_info(p).expert_parallel))
    elif ps.instances > 1:  # the first instance read the slices; the others are its replicas
        for p, tensors in pieces:
            for t in tensors:
                _sum(t, ps.across_group(param_info(p).expert_parallel))


def _sum(t: torch.Tensor, group) -> None:
    if comm.group_size(group) > 1:
        comm.all_reduce(t.data, group)
