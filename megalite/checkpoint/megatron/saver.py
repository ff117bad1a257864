"""--save with --ckpt-format torch_dist: training writes Megatron-LM's torch_dist checkpoints, each
rank its own chunks, which megatron-core's `dist_checkpointing.load` reads into its GPTModel on
any layout and megalite's --load reads back (index.py), resuming exactly.

Who writes what: the pieces this rank owns (state.owned_pieces: with the plain optimizer whole
tensors spread over the data-parallel replicas by size, Megatron-LM's fully parallel save, or all
from the first replica with --no-ckpt-fully-parallel-save; with the distributed optimizer and
ZeRO-3 each rank's slices), TP rank 0 the TP-replicated ones; the last stage's copy of a tied
embedding is not written. A piece is a flat range of the local TP shard, written as the boxes of
the global tensor it covers (`piece_boxes`: SwiGLU's fc1 shard [gate_r; up_r] lies at rows r·f/T
and f + r·f/T of the global [gate; up], as megatron-core stores it). Layers and experts are
stacked along leading axes (names.py). Beside each weight: its fp32 master (16-bit runs)
and the optimizer's state under `optimizer.state.<kind>.<key>` in the same boxes, Megatron-LM's
fully reshardable optimizer layout (--dist-ckpt-optim-fully-reshardable; megalite always writes
it). common.pt holds Megatron-LM's `args` (the run's flags under their Megatron-LM names), the
iteration, consumed samples, the learning-rate schedule's state, the optimizer's step and, under
`megalite`, the loss scaler and spike guard; each rank's RNG states are an object of its own
(`megalite_rng/shard_<rank>_<world>`), restored on the same layout.

--async-save writes the rank files from a background thread and publishes at a later iteration
(as CheckpointSaver); --verify-integrity adds megatron-core's integrity.json;
--save-retain-interval deletes the previous checkpoint unless it is a multiple of the interval.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from math import prod

from ... import comm
from ...errors import CheckpointError
from ...model.init import global_shape
from ...tensor_parallel.param_info import param_info
from ..native.save import writers_done
from ..native.state import STATE_KINDS, TrainState, owned_pieces, rng_state, shard_layout
from ..paths import TRACKER, iteration_dir, read_tracker, retire_previous, write_integrity
from .export import LINEARS, megatron_args
from .format import flat_boxes, write_metadata, write_rank_file
from .names import MOMENT_PREFIXES, index_depth, megatron_keys


def piece_boxes(p, lo: int, hi: int, tp_rank: int, tp_size: int) -> list[tuple]:
    """[(offsets in the whole parameter, sizes, start in the piece)] of elements [lo, hi) of this
    rank's TP shard of `p`: each a box of the whole tensor covering consecutive elements."""
    lay = shard_layout(p, tp_rank, tp_size, 0)
    local = tuple(p.shape)
    out = []
    pos = 0
    for box in flat_boxes(local, lo, hi):
        numel = prod(b - a for a, b in box)
        if not lay["tp"]:
            out.append((tuple(a for a, _ in box), tuple(b - a for a, b in box), pos))
            pos += numel
            continue
        dim, stride, rank = lay["dim"], lay["stride"], lay["tp_rank"]
        block, full = local[dim] // stride, local[dim] * lay["tp_size"]
        a, b = box[dim]
        inner = numel // (b - a)
        while a < b:  # split at the stride's blocks: [gate_r; up_r] rows go to two places
            j = a // block
            end = min(b, (j + 1) * block)
            offsets = [x for x, _ in box]
            offsets[dim] = j * full // stride + rank * block + (a - j * block)
            sizes = [y - x for x, y in box]
            sizes[dim] = end - a
            out.append((tuple(offsets), tuple(sizes), pos))
            pos += (end - a) * inner
            a = end
    return out


def _extra_state(key: str, index: tuple, lead: tuple) -> dict:
    """megatron-core's (empty) `_extra_state` object of a linear layer's weight `key`."""
    module = key.rsplit(".", 2)
    if not (key.endswith(".weight") and len(module) == 3 and module[1] in LINEARS):
        return {}
    obj = f"{key[:-len('weight')]}_extra_state"
    return {f"{obj}/shard_{'.'.join(map(str, index or (0,)))}_{'.'.join(map(str, lead or (1,)))}": [None]}


def rank_items(train_state: TrainState, fully_parallel: bool = True) -> tuple[list, dict]:
    """This rank's chunks (weights, masters, optimizer state) and objects (host copies)."""
    ps, cfg, opt = train_state.ps, train_state.model_config, train_state.optimizer
    opt.dp.finish_param_sync()
    num_layers, num_experts = cfg.num_layers, cfg.num_experts or 0
    names = {id(p): n for n, p in train_state.named_params}
    tensors, objects = [], {}
    for p, lo, hi, master in owned_pieces(train_state, spread=fully_parallel):
        info = param_info(p)
        if info.tied_copy:
            continue
        key, index = megatron_keys(names[id(p)])[0]
        lead = (num_layers, num_experts)[:index_depth(key)]
        full = global_shape(p, info.tp_place(0, ps.tp_size)[1] if info.tensor_parallel else 1)
        state = opt.optimizer.state.get(master, {})
        kinds = [("", opt.dp.param_slice(p, lo, hi))] + ([] if opt.fp32_params else [(MOMENT_PREFIXES["master"],
                                                                                        master)])
        kinds += [(MOMENT_PREFIXES[k], state[k]) for k in STATE_KINDS if k in state]
        boxes = piece_boxes(p, lo, hi, ps.tp_rank, ps.tp_size)
        for prefix, t in kinds:
            flat = t.detach().reshape(-1)
            for offsets, sizes, start in boxes:
                chunk = flat[start:start + prod(sizes)].reshape((1,) * len(index) + sizes)
                tensors.append((prefix + key, lead + tuple(full), index + offsets, chunk.to("cpu", copy=True)))
        if lo == 0 and info.tp_place(ps.tp_rank, ps.tp_size)[0] == 0:
            objects.update(_extra_state(key, index, lead))
    if ps.tp_rank == 0 and ps.dp_cp_rank == 0:  # persistent buffers (the MoE expert bias), once per stage
        for name, b in train_state.named_buffers:
            key, index = megatron_keys(name)[0]
            lead = (num_layers, num_experts)[:index_depth(key)]
            tensors.append((key, lead + tuple(b.shape), index + (0,) * b.dim(),
                            b.detach().reshape((1,) * len(index) + b.shape).to("cpu", copy=True)))
    rng_tensors, rng_values = rng_state(train_state)
    objects[rng_key(ps.rank, ps.world_size)] = {"values": rng_values, "tensors": rng_tensors}
    return tensors, objects


def rng_key(rank: int, world_size: int) -> str:
    """The object holding rank `rank`'s RNG states (a ShardedObject's unique key)."""
    return f"megalite_rng/shard_{rank}_{world_size}"


def common_state(train_state: TrainState, iteration: int) -> dict:
    """common.pt: Megatron-LM's args, iteration and OptimizerParamScheduler state (in samples)."""
    c, ps = train_state.config, train_state.ps
    opt = c.get("optimizer", {})
    args = megatron_args(train_state.model_config.to_dict(), c, {
        "iteration": iteration, "consumed_train_samples": train_state.consumed_samples, "ckpt_format": "torch_dist",
        "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
        "data_parallel_size": ps.dp_size, "context_parallel_size": ps.cp_size, "world_size": ps.world_size})
    scheduler = {"max_lr": opt.get("lr"), "min_lr": opt.get("min_lr"), "lr_decay_style": opt.get("lr_decay_style"),
                 "lr_warmup_steps": opt.get("lr_warmup_samples"), "lr_decay_steps": opt.get("lr_decay_samples"),
                 "start_wd": opt.get("start_weight_decay"), "end_wd": opt.get("end_weight_decay"),
                 "wd_incr_style": opt.get("weight_decay_incr_style"), "wd_incr_steps": opt.get("lr_decay_samples"),
                 "num_steps": train_state.scheduler.state_dict()["num_steps"]}
    step = train_state.optimizer.step_count()
    opt_state = train_state.optimizer
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "opt_param_scheduler": scheduler,
            "num_floating_point_operations_so_far": 0,
            "optimizer": {"param_groups": [{"step": int(step)}]} if step is not None else {},
            "megalite": {"grad_scaler": opt_state.scaler.state_dict() if opt_state.scaler is not None else None,
                         "spike_guard": train_state.spike_guard.state_dict()
                         if train_state.spike_guard is not None else None}}


class MegatronSaver:
    """The saver of --ckpt-format torch_dist (CheckpointSaver's interface): synchronous, or with
    --async-save the rank files written by a background thread and published at a later
    iteration, every rank deciding alike when."""

    def __init__(self, root: str, async_save: bool = False, fully_parallel: bool = True,
                 retain_interval: int | None = None, verify_integrity: bool = False):
        self.root, self.async_save, self.fully_parallel = root, async_save, fully_parallel
        self.retain_interval, self.verify_integrity = retain_interval, verify_integrity
        self.pending = None  # (iteration, thread, train_state, common, start)
        self.result: list | BaseException | None = None

    def save(self, train_state: TrainState, iteration: int) -> None:
        self.finalize(blocking=True)  # at most one save in flight
        ps, start = train_state.ps, time.perf_counter()
        tmp = iteration_dir(self.root, iteration) + ".tmp"
        if ps.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        tensors, objects = rank_items(train_state, self.fully_parallel)
        common = common_state(train_state, iteration) if ps.rank == 0 else None
        comm.barrier(comm.world_group())
        if not self.async_save:
            self._publish(train_state, iteration, write_rank_file(tmp, ps.rank, tensors, objects), common, start)
            return

        def write_in_background():
            try:
                self.result = write_rank_file(tmp, ps.rank, tensors, objects)
            except BaseException as e:  # reported at finalisation, on the training thread
                self.result = e

        self.result = None
        thread = threading.Thread(target=write_in_background, name="megalite-async-save", daemon=True)
        thread.start()
        self.pending = (iteration, thread, train_state, common, start)
        train_state.log(f"> saving torch_dist checkpoint {iteration_dir(self.root, iteration)} in the background")

    def _publish(self, train_state: TrainState, iteration: int, records: list, common, start: float) -> None:
        """Every rank's records to rank 0, which writes the metadata, renames the directory into
        place, moves the latest pointer and retires the previous checkpoint."""
        ps = train_state.ps
        everyone = comm.gather_object(records, 0, comm.world_group())
        if ps.rank == 0:
            tmp, final = iteration_dir(self.root, iteration) + ".tmp", iteration_dir(self.root, iteration)
            write_metadata(tmp, [r for part in everyone for r in part], common)
            if self.verify_integrity:
                write_integrity(tmp)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            previous = read_tracker(self.root)
            with open(os.path.join(self.root, TRACKER), "w") as f:
                f.write(f"{iteration}\n")
            gone = retire_previous(self.root, previous, iteration, self.retain_interval)
            if gone is not None:
                train_state.log(f"> --save-retain-interval {self.retain_interval}: deleted the checkpoint of "
                                f"iteration {gone}")
        comm.barrier(comm.world_group())
        train_state.log(f"> saved torch_dist checkpoint {iteration_dir(self.root, iteration)} "
                        f"({time.perf_counter() - start:.2f} s)")

    def finalize(self, blocking: bool = False) -> None:
        """Publish a finished background save. Non-blocking calls ask every rank whether its
        writer is done (one small all-reduce) so that all ranks decide alike."""
        if self.pending is None:
            return
        iteration, thread, train_state, common, start = self.pending
        if not blocking and not writers_done(thread, train_state.device):
            return
        thread.join()
        self.pending = None
        if isinstance(self.result, BaseException):
            raise CheckpointError(f"background save of iteration {iteration} failed: {self.result}") from self.result
        self._publish(train_state, iteration, self.result, common, start)

    def close(self) -> None:
        """At the end of a run, also one that failed: wait for a background write (nothing is
        published, no collective: peers may be gone)."""
        if self.pending is not None:
            self.pending[1].join()
            self.pending = None
