"""Saving a checkpoint: every rank collects what it owns (state.owned_pieces) into one tensor
file, rank 0 writes metadata.json and the global index, and the iteration directory is renamed
into place and the latest pointer moved only once every rank has finished (atomic; see the
package docstring). --async-save writes from a thread and publishes at a later iteration."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import torch

from ... import comm
from ...errors import CheckpointError
from ...config.run import CONFIG_VERSION
from ...tensor_parallel.param_info import param_info
from ..paths import FORMAT_VERSION, TRACKER, data_file, iteration_dir, read_tracker, retire_previous
from .index import INDEX, build_index
from .state import STATE_KINDS, TrainState, owned_pieces, rng_state, shard_layout
from .tensor_file import DTYPES, plan, write


def collect_rank_state(train_state: TrainState, fully_parallel: bool = True) -> tuple[dict, dict]:
    """This rank's tensors (host copies, safe to write from another thread) and its record for
    the global index: entries, with byte offsets in its file, and RNG states."""
    ps, opt = train_state.ps, train_state.optimizer
    vocab_size = train_state.model_config.vocab_size
    opt.dp.finish_param_sync()
    names = {id(p): n for n, p in train_state.named_params}
    tensors, entries = {}, []

    def add(kind, name, p, lo, hi, tensor, tied):
        key = f"{kind}/{name}/{lo}" + ("/tied" if tied else "")
        tensors[key] = tensor.detach().reshape(-1)[: hi - lo].to("cpu", copy=True)
        entries.append({"key": key, "kind": kind, "name": name, "lo": lo, "hi": hi, "tied": tied,
                        "layout": shard_layout(p, ps.tp_rank, ps.tp_size, vocab_size)})

    for p, lo, hi, master in owned_pieces(train_state, spread=fully_parallel):
        name, tied = names[id(p)], param_info(p).tied_copy
        if not tied:  # the tied copy's weight is the first stage's; its optimizer state is saved
            add("param", name, p, lo, hi, opt.dp.param_slice(p, lo, hi), False)
        if not opt.fp32_params:
            add("master", name, p, lo, hi, master, tied)
        state = opt.optimizer.state.get(master, {})
        for kind in STATE_KINDS:
            if kind in state:
                add(kind, name, p, lo, hi, state[kind], tied)
    if ps.tp_rank == 0 and ps.dp_cp_rank == 0:  # the replicated buffers, once per pipeline stage
        for name, b in train_state.named_buffers:
            add("param", name, b, 0, b.numel(), b, False)
    rng_tensors, rng_values = rng_state(train_state)
    tensors.update(rng_tensors)
    head, offsets = plan(tensors)
    for e in entries:
        e["offset"], e["dtype"] = offsets[e["key"]], _dtype_name(tensors[e["key"]])
    record = {"rank": ps.rank, "file": data_file(ps.rank), "entries": entries, "rng": rng_values,
              "tensors": {k: [offsets[k], _dtype_name(t), list(t.shape)] for k, t in rng_tensors.items()},
              "head": head}
    return tensors, record


def _dtype_name(t: torch.Tensor) -> str:
    return DTYPES[t.dtype]


def non_finite(tensors: dict) -> list[str]:
    """Keys of saved weights and optimizer state that hold a NaN or an Inf."""
    return [k for k, t in tensors.items() if not k.startswith("rng/") and t.is_floating_point()
            and not bool(torch.isfinite(t).all())]


def build_metadata(train_state: TrainState, iteration: int) -> dict:
    ps, opt = train_state.ps, train_state.optimizer
    return {
        "format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": train_state.consumed_samples,
        "config_version": CONFIG_VERSION, "config": train_state.config,
        "model_config": train_state.model_config.to_dict(),
        "layout": {"world_size": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "vpp": ps.vpp,
                   "dp": ps.dp_size, "cp": ps.cp_size, "distributed_optimizer": bool(opt.distributed),
                   "data_parallel_sharding_strategy": opt.dp.strategy.name},
        "scheduler": train_state.scheduler.state_dict(),
        "grad_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "optimizer": {"type": train_state.config["optimizer"]["optimizer"], "fp32_params": bool(opt.fp32_params)},
        "has_optimizer_state": True,
        "spike_guard": train_state.spike_guard.state_dict() if train_state.spike_guard is not None else None,
    }


def write_metadata_and_index(directory: str, meta: dict, optimizer_step, records: list[dict]) -> None:
    """Rank 0: metadata.json (for people and tools) and the global index (for loads)."""
    records = sorted(records, key=lambda r: r["rank"])
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(directory, INDEX), "wb") as f:
        f.write(build_index(meta, optimizer_step, records))
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(root: str, iteration: int, retain_interval: int | None = None) -> int | None:
    """Rank 0, after every rank has written: rename the temporary directory into place, then
    move the latest pointer. A crash before the pointer moves leaves the previous one valid.
    With --save-retain-interval the previous checkpoint is then deleted unless it is a multiple
    of it (returned when it is)."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    previous = read_tracker(root)
    if os.path.isdir(final):  # re-saving an iteration: keep the old one until the new is in place
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _write_text_atomic(os.path.join(root, TRACKER), f"{iteration}\n")
    return retire_previous(root, previous, iteration, retain_interval)



def writers_done(thread, device) -> bool:
    """Whether every rank's background writer has finished: one small all-reduce (MIN), so that
    all ranks decide alike whether to publish now."""
    done = torch.tensor([0.0 if thread.is_alive() else 1.0], device=device)
    comm.all_reduce(done, comm.world_group(), op=torch.distributed.ReduceOp.MIN)
    return done.item() >= 1.0

class CheckpointSaver:
    """Synchronous or asynchronous (--async-save) atomic saves."""

    def __init__(self, root: str, async_save: bool = False, check_finite: bool = True, fully_parallel: bool = True,
                 retain_interval: int | None = None):
        self.root, self.async_save, self.check_finite = root, async_save, check_finite
        self.fully_parallel, self.retain_interval = fully_parallel, retain_interval
        self.pending: tuple[int, threading.Thread] | None = None
        self.error: BaseException | None = None

    def save(self, train_state: TrainState, iteration: int) -> None:
        self.finalize(blocking=True)  # at most one save in flight
        ps = train_state.ps
        tensors, record = collect_rank_state(train_state, self.fully_parallel)
        if self.check_finite:  # before anything is written: a diverged run keeps its last good checkpoint
            bad = comm.all_gather_object(non_finite(tensors)[:3], comm.world_group())
            if any(bad):
                where = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in enumerate(bad) if keys)
                raise CheckpointError(f"refusing to save the checkpoint of iteration {iteration}: non-finite values "
                                      f"in {where}. The latest checkpoint stays the previous one")
        head = record.pop("head")  # this rank's file header: not needed by rank 0
        records = comm.gather_object(record, 0, comm.world_group())
        tmp = iteration_dir(self.root, iteration) + ".tmp"
        if ps.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            if os.path.isdir(tmp):  # left by a run killed mid-save
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            write_metadata_and_index(tmp, build_metadata(train_state, iteration), train_state.optimizer.step_count(),
                                      records)
        comm.barrier(comm.world_group())
        path = os.path.join(tmp, record["file"])
        start = time.perf_counter()
        if not self.async_save:
            write(path, tensors, head)
            self._finish(train_state, iteration)
            train_state.log(f"> saved checkpoint {iteration_dir(self.root, iteration)} "
                            f"({time.perf_counter() - start:.2f} s)")
            return

        def write_in_background():
            try:
                write(path, tensors, head)
            except BaseException as e:  # reported at finalisation, on the training thread
                self.error = e

        thread = threading.Thread(target=write_in_background, name="megalite-async-save", daemon=True)
        thread.start()
        self.pending = (iteration, thread)
        self.train_state = train_state
        train_state.log(f"> saving checkpoint {iteration_dir(self.root, iteration)} in the background")

    def _finish(self, train_state: TrainState, iteration: int) -> None:
        hook = os.environ.get("MEGALITE_TEST_SAVE_DELAY_S")  # tests: widen the window before publishing
        if hook:
            time.sleep(float(hook))
        comm.barrier(comm.world_group())
        if train_state.ps.rank == 0:
            gone = publish(self.root, iteration, self.retain_interval)
            if gone is not None:
                train_state.log(f"> --save-retain-interval {self.retain_interval}: deleted the checkpoint of "
                                f"iteration {gone}")
        comm.barrier(comm.world_group())

    def close(self) -> None:
        """At the end of a run, also one that failed: wait for a background write (a local
        file; nothing is published, no collective: peers may be gone)."""
        if self.pending is not None:
            self.pending[1].join()
            self.pending = None

    def finalize(self, blocking: bool = False) -> None:
        """Publish a finished background save. Non-blocking calls ask every rank whether its
        writer is done (one small all-reduce) so that all ranks decide alike."""
        if self.pending is None:
            return
        iteration, thread = self.pending
        train_state = self.train_state
        if not blocking and not writers_done(thread, train_state.device):
            return
        thread.join()
        if self.error is not None:
            raise CheckpointError(f"background save of iteration {iteration} failed: {self.error}") from self.error
        self.pending = None
        self._finish(train_state, iteration)
        train_state.log(f"> saved checkpoint {iteration_dir(self.root, iteration)} (background)")
