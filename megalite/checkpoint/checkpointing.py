"""Checkpoints that resume exactly, on the layout that wrote them or any other, reading only
what each rank needs.

Layout on disk (Megatron-LM's directory names):

    DIR/latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    DIR/iter_0000100/metadata.json             iteration, consumed samples, arguments, model config,
                                               the layout that wrote it, scheduler and loss scaler
    DIR/iter_0000100/index.jsonl               the global index (checkpoint_index.py): the metadata
                                               again, and where every saved piece of every tensor is
    DIR/iter_0000100/rank_00003.safetensors    rank 3's tensors (tensor_file.py; nothing pickled)

Each saved tensor is a flat range [lo, hi) of one parameter's *local shard* (of the weight, its
fp32 master, or an optimizer moment), recorded with how that shard was cut from the whole
tensor (TP partition dimension, stride, TP size, the real vocabulary rows of padded tables).
Which rank saves what ("ownership", `owned_pieces`): with the distributed optimizer every rank
its own slices (ZeRO-1/2/3) of parameters, masters and moments; with the plain optimizer whole
parameters spread over the data-parallel ranks by size, so DP replicas write (and read) disjoint,
about equal parts in parallel. A TP-replicated tensor is saved by TP rank 0 only.
Every element is saved once, plus the last pipeline stage's optimizer state for its copy of the
tied embedding (so that stage never reads the first stage's files).

Loading applies the same ownership rule to the *new* layout: each rank reads the elements it
owns there, from the saved pieces that overlap them (byte ranges computed by reshard.py, read
with pread), and the rest arrives by summing over the group where the others hold zeros: TP for
TP-replicated tensors, DP for parameters (and for the plain optimizer's state; not under ZeRO-3,
where a rank stores only its own slices of the parameters), the embedding group for the tied
copy. On the layout that saved it a rank therefore reads exactly its own
file, plus the index header and its sections; on another layout, only the saved pieces that
overlap what it owns. Each rank counts the bytes it read and the files it opened
(`LoadStats`; the loop writes one `checkpoint_load` JSONL record per rank).

Saves are atomic: files go to `iter_N.tmp`, which is renamed once every rank has finished, and
only then does the latest pointer move, so a run killed mid-save leaves the previous checkpoint
as the latest. `async_save` copies the tensors to host memory, writes them from a thread while
training goes on, and finalises at a later iteration. With `check_finite` (the default), a
save whose weights or optimizer state hold a NaN or an Inf is refused on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import comm
from .index import INDEX, CheckpointError, build_index, open_index
from ..model.init import global_shape, shard
from ..parallel_state import ParallelState, stage_layers
from .reshard import ShardLayout, coalesce, locate, runs, split_at
from .tensor_file import DTYPES, RangeReader, element_size, plan, write
from ..tensor_parallel.param_info import param_info

FORMAT_VERSION = 2  # 2: global index, safetensors-layout data files; 1: per-rank index + torch.save
TRACKER = "latest_checkpointed_iteration.txt"
STATE_KINDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
READ_GAP_BYTES = 4096  # two ranges of one piece closer than this are read as one (a page)

# model settings that must agree between a checkpoint and the run loading it: config key -> flag
MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (the tokenizer's vocabulary)", "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization", "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "rotary_percent": "--rotary-percent", "norm_epsilon": "--norm-epsilon", "openai_gelu": "--openai-gelu",
    "apply_layernorm_1p": "--apply-layernorm-1p",
}
# RoPE settings, compared for RoPE models only; a key older checkpoints lack means its default
ROPE_FLAGS = {"use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
              "rope_scaling_low_freq_factor": "--rope-scaling-low-freq-factor",
              "rope_scaling_high_freq_factor": "--rope-scaling-high-freq-factor",
              "rope_scaling_original_max_position_embeddings": "--rope-scaling-original-max-position-embeddings",
              "rotary_seq_len_interpolation_factor": "--rotary-seq-len-interpolation-factor"}


@dataclass
class TrainState:
    """What a checkpoint saves and restores: the model's parameters (global names), the optimizer
    (masters and moments of the pieces it steps), the schedule and loss scaler, RNG states, and
    where the run stands. `flags` is recorded in metadata.json for the tools."""
    ps: ParallelState
    model_config: object  # model.GPTConfig
    named_params: list
    optimizer: object  # optimizer.MixedPrecisionOptimizer
    scheduler: object  # optimizer.LRScheduler
    rng_tracker: object
    device: torch.device
    flags: dict
    iteration: int = 0
    consumed_samples: int = 0
    load_stats: object = None  # LoadStats of the checkpoint load, if any

    def log(self, msg: str) -> None:
        if self.ps.rank == self.ps.logging_rank:
            print(msg, flush=True)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def read_metadata(root: str, iteration: int | None = None) -> dict:
    """metadata.json of the latest (or the given) checkpoint under `root`."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"no checkpoint under {root}: {TRACKER} is missing")
    path = os.path.join(iteration_dir(root, iteration), "metadata.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {iteration_dir(root, iteration)} is not a complete checkpoint")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path}: format version {meta.get('format_version')}, expected 1 or {FORMAT_VERSION}")
    meta["dir"] = iteration_dir(root, iteration)
    return meta


def check_model_config(saved: dict, current: dict, where: str) -> None:
    """Raise naming the first model setting that differs."""
    from ..model import GPTConfig
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    flags = dict(MODEL_FLAGS, **(ROPE_FLAGS if current.get("position_embedding_type") == "rope" else {}))
    if not current.get("use_rope_scaling"):  # the scaling parameters matter only when scaling is on
        flags = {k: f for k, f in flags.items() if not k.startswith("rope_scaling_")}
    for key, flag in flags.items():
        if saved.get(key, defaults.get(key)) != current.get(key, defaults.get(key)):
            raise CheckpointError(f"checkpoint {where} does not match this model: {flag} is {saved.get(key)!r} in "
                                  f"the checkpoint and {current.get(key)!r} in this run")
    if current.get("position_embedding_type") == "rope" and saved.get("rotary_base") != current.get("rotary_base"):
        raise CheckpointError(f"checkpoint {where} does not match this model: --rotary-base is "
                              f"{saved.get('rotary_base')} in the checkpoint and {current.get('rotary_base')} in this run")
    if current.get("position_embedding_type") == "learned_absolute" and \
            saved.get("max_position_embeddings") != current.get("max_position_embeddings"):
        raise CheckpointError(f"checkpoint {where} does not match this model: --max-position-embeddings is "
                              f"{saved.get('max_position_embeddings')} in the checkpoint and "
                              f"{current.get('max_position_embeddings')} in this run")


# -- how a local shard was cut from the whole tensor ----------------------------------------------
def shard_layout(p: torch.nn.Parameter, tp_rank: int, tp_size: int, vocab_size: int) -> dict:
    info = param_info(p)
    is_tp = info.tensor_parallel
    return {"tp": is_tp, "dim": info.partition_dim, "stride": info.partition_stride,
            "tp_rank": tp_rank if is_tp else 0, "tp_size": tp_size if is_tp else 1,
            "local_shape": list(p.shape), "rows": vocab_size if info.init_rows is not None else None}


def local_shard(full: torch.Tensor, p: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of `full` (the whole tensor, vocabulary unpadded)."""
    info = param_info(p)
    if info.init_rows is not None:  # pad the vocabulary rows to this layout's size
        rows = p.shape[0] * (tp_size if info.tensor_parallel else 1)
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))])
    return shard(full, info, tp_rank, tp_size)


# -- what a rank saves ---------------------------------------------------------------------------
def _rng_state(train_state: TrainState) -> tuple[dict, dict]:
    """RNG states as (tensors, JSON-safe values)."""
    np_state = np.random.get_state()
    tensors = {"rng/torch": torch.get_rng_state(), "rng/numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available() and train_state.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(train_state.device)
    for name, state in train_state.rng_tracker.get_states().items():
        tensors[f"rng/tracker/{name}"] = state
    py = random.getstate()
    values = {"python": [py[0], list(py[1]), py[2]], "numpy": [np_state[0], int(np_state[2]), int(np_state[3]),
                                                                  float(np_state[4])]}
    return tensors, values


def _set_rng_state(train_state: TrainState, tensors: dict, values: dict) -> None:
    py = values["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = values["numpy"]
    np.random.set_state((n[0], tensors["rng/numpy"].numpy().astype(np.uint32), n[1], n[2], n[3]))
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and train_state.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng/cuda"], train_state.device)
    train_state.rng_tracker.set_states({k[len("rng/tracker/"):]: v for k, v in tensors.items()
                                    if k.startswith("rng/tracker/")})


def _tp_owner(p, tp_rank: int) -> bool:
    """The copy that is saved: TP-sharded tensors on every TP rank, replicated ones on TP rank 0
    (the tied embedding's last-stage copy counts: its optimizer state is saved, tagged tied)."""
    return param_info(p).tensor_parallel or tp_rank == 0


def owned_pieces(train_state: TrainState) -> list[tuple]:
    """(param, lo, hi, master) pieces this rank saves, and on load reads: with the distributed
    optimizer its own slices; with the plain one whole parameters, spread over the DP ranks by
    size (`dp_owners`). The same rule on every layout (see the module docstring)."""
    ps, opt = train_state.ps, train_state.optimizer
    pieces = opt.pieces()
    if not opt.distributed:
        # CP ranks are replicas like DP ranks: whole tensors spread over DP x CP, each written once
        owners = dp_owners([p.numel() for p, *_ in pieces], ps.dp_cp_size)
        pieces = [pc for pc, owner in zip(pieces, owners) if owner == ps.dp_cp_rank]
    return [pc for pc in pieces if _tp_owner(pc[0], ps.tp_rank)]


def dp_owners(sizes: list[int], dp_size: int) -> list[int]:
    """The DP rank that owns each whole tensor: largest first, each to the least loaded rank
    (ties: the lowest), so DP replicas read and write about equal shares. A function of the
    sizes alone, hence the same on every DP rank."""
    load, owners = [0] * dp_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(dp_size), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def collect_rank_state(train_state: TrainState) -> tuple[dict, dict]:
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

    for p, lo, hi, master in owned_pieces(train_state):
        name, tied = names[id(p)], param_info(p).tied_copy
        if not tied:  # the tied copy's weight is the first stage's; its optimizer state is saved
            add("param", name, p, lo, hi, opt.dp.param_slice(p, lo, hi), False)
        if not opt.fp32_params:
            add("master", name, p, lo, hi, master, tied)
        state = opt.optimizer.state.get(master, {})
        for kind in STATE_KINDS:
            if kind in state:
                add(kind, name, p, lo, hi, state[kind], tied)
    rng_tensors, rng_values = _rng_state(train_state)
    tensors.update(rng_tensors)
    head, offsets = plan(tensors)
    for e in entries:
        e["offset"], e["dtype"] = offsets[e["key"]], _dtype_name(tensors[e["key"]])
    record = {"rank": ps.rank, "file": _data_file(ps.rank), "entries": entries, "rng": rng_values,
              "tensors": {k: [offsets[k], _dtype_name(t), list(t.shape)] for k, t in rng_tensors.items()},
              "head": head}
    return tensors, record


def _dtype_name(t: torch.Tensor) -> str:
    return DTYPES[t.dtype]


def _data_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def non_finite(tensors: dict) -> list[str]:
    """Keys of saved weights and optimizer state that hold a NaN or an Inf."""
    return [k for k, t in tensors.items() if not k.startswith("rng/") and t.is_floating_point()
            and not bool(torch.isfinite(t).all())]


def _json_safe(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float, bool)) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


def build_metadata(train_state: TrainState, iteration: int) -> dict:
    ps, opt = train_state.ps, train_state.optimizer
    return {
        "format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": train_state.consumed_samples,
        "args": _json_safe(train_state.flags), "model_config": train_state.model_config.to_dict(),
        "layout": {"world_size": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "vpp": ps.vpp,
                   "dp": ps.dp_size, "cp": ps.cp_size, "distributed_optimizer": bool(opt.distributed),
                   "data_parallel_sharding_strategy": opt.dp.strategy.name},
        "scheduler": train_state.scheduler.state_dict(),
        "grad_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "optimizer": {"type": train_state.flags.get("optimizer", "adam"), "fp32_params": bool(opt.fp32_params)},
        "has_optimizer_state": True,
    }


def _write_metadata_and_index(directory: str, meta: dict, optimizer_step, records: list[dict]) -> None:
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


def _publish(root: str, iteration: int) -> None:
    """Rank 0, after every rank has written: rename the temporary directory into place, then
    move the latest pointer. A crash before the pointer moves leaves the previous one valid."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if os.path.isdir(final):  # re-saving an iteration: keep the old one until the new is in place
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _write_text_atomic(os.path.join(root, TRACKER), f"{iteration}\n")


class CheckpointSaver:
    """Synchronous or asynchronous (--async-save) atomic saves."""

    def __init__(self, root: str, async_save: bool = False, check_finite: bool = True):
        self.root, self.async_save, self.check_finite = root, async_save, check_finite
        self.pending: tuple[int, threading.Thread] | None = None
        self.error: BaseException | None = None

    def save(self, train_state: TrainState, iteration: int) -> None:
        self.finalize(blocking=True)  # at most one save in flight
        ps = train_state.ps
        tensors, record = collect_rank_state(train_state)
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
            _write_metadata_and_index(tmp, build_metadata(train_state, iteration), train_state.optimizer.step_count(),
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
            _publish(self.root, iteration)
        comm.barrier(comm.world_group())

    def finalize(self, blocking: bool = False) -> None:
        """Publish a finished background save. Non-blocking calls ask every rank whether its
        writer is done (one small all-reduce) so that all ranks decide alike."""
        if self.pending is None:
            return
        iteration, thread = self.pending
        train_state = self.train_state
        if not blocking:
            done = torch.tensor([0.0 if thread.is_alive() else 1.0], device=train_state.device)
            comm.all_reduce(done, comm.world_group(), op=torch.distributed.ReduceOp.MIN)
            if done.item() < 1.0:
                return
        thread.join()
        if self.error is not None:
            raise CheckpointError(f"background save of iteration {iteration} failed: {self.error}") from self.error
        self.pending = None
        self._finish(train_state, iteration)
        train_state.log(f"> saved checkpoint {iteration_dir(self.root, iteration)} (background)")


# -- loading ---------------------------------------------------------------------------------------
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
    if os.path.isfile(os.path.join(directory, INDEX)):
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


def read_region(index, name: str, kind: str, target: ShardLayout, tp_rank: int, lo: int, hi: int,
                tied: bool = False) -> torch.Tensor:
    """Elements [lo, hi) of TP rank `tp_rank`'s local shard of `kind` of `name`, in the layout
    `target`, read from the saved pieces that overlap them (fp32; zeros in padded vocabulary
    rows). `tied`: prefer the pieces saved for the tied embedding's last-stage copy."""
    found = index.entry(name)
    pieces = [pc for pc in (found[1] if found else []) if pc.kind == kind]
    pieces = ([pc for pc in pieces if pc.tied] if tied else []) or [pc for pc in pieces if not pc.tied]
    if not pieces:
        raise CheckpointError(f"{index.directory} has no {kind} for {name}")
    lay = found[0]
    old = ShardLayout(tuple(lay["full_shape"]), lay["dim"], lay["stride"], lay["tp_size"])
    row_elems = int(np.prod(target.full_shape[1:], dtype=np.int64))
    if lay["rows"] is None and tuple(target.full_shape) != old.full_shape:
        raise CheckpointError(f"{index.directory}: {name} has shape {old.full_shape} in the checkpoint and "
                              f"{tuple(target.full_shape)} in this run")
    out = torch.zeros(hi - lo, dtype=torch.float32)
    full_start, length = runs(target, tp_rank, lo, hi)
    dest = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    if lay["rows"] is not None:  # padded vocabulary: rows past the real ones stay zero
        limit = lay["rows"] * row_elems
        length = np.clip(limit - full_start, 0, length)
        keep = length > 0
        full_start, length, dest = full_start[keep], length[keep], dest[keep]
    old_rank, start, length, dest = locate(old, full_start, length, dest)
    for r in np.unique(old_rank):
        mine = sorted((pc for pc in pieces if pc.tp_rank == r), key=lambda pc: pc.lo)
        if not mine or mine[0].lo != 0 or mine[-1].hi != old.local_numel or \
                any(a.hi != b.lo for a, b in zip(mine, mine[1:])):
            raise CheckpointError(f"{index.directory}: the saved pieces of {kind} of {name} do not cover TP rank "
                                  f"{int(r)}'s shard (incomplete or duplicated)")
        sel = old_rank == r
        cuts = np.array([pc.lo for pc in mine] + [mine[-1].hi], dtype=np.int64)
        which, s, n, d = split_at(cuts, start[sel], length[sel], dest[sel])
        for k in np.unique(which):
            pc, sk = mine[k], which == k
            s_k, n_k, d_k = s[sk] - pc.lo, n[sk], d[sk]
            gap = READ_GAP_BYTES // (4 if pc.dtype is None else element_size(pc.dtype))  # format 1: dtype unknown
            for a, b, members in coalesce(s_k, n_k, gap):
                data = index.read(pc, a, b)
                for m in members:
                    o = int(s_k[m]) - a
                    out[int(d_k[m]):int(d_k[m]) + int(n_k[m])] = data[o:o + int(n_k[m])]
    return out


def target_layout(p: torch.nn.Parameter, tp_size: int) -> ShardLayout:
    """How this run cut `p`'s shard from the whole tensor (vocabulary padded as this run pads it)."""
    info = param_info(p)
    if not info.tensor_parallel or tp_size == 1:
        return ShardLayout(global_shape(p, tp_size if info.tensor_parallel else 1))
    return ShardLayout(global_shape(p, tp_size), info.partition_dim, info.partition_stride, tp_size)


def load_checkpoint(train_state: TrainState, root: str, finetune: bool = False, load_optim: bool = True,
                    load_rng: bool = True) -> int:
    """Load the latest checkpoint under `root` into `train_state`; returns its iteration (0 with
    --finetune). No checkpoint there: a notice, and training starts from scratch. What this rank
    read is left in `train_state.load_stats`."""
    ps, opt = train_state.ps, train_state.optimizer
    if read_tracker(root) is None:
        train_state.log(f"> no checkpoint found under {root} ({TRACKER} missing): training from scratch")
        return 0
    start = time.perf_counter()
    io = RangeReader()
    meta, index = open_checkpoint(root, io=io)
    where = meta["dir"]
    check_model_config(meta["model_config"], train_state.model_config.to_dict(), where)
    restore_optim = load_optim and not finetune
    if restore_optim and not meta.get("has_optimizer_state", True):
        raise CheckpointError(f"{where} holds weights only (no optimizer state); "
                              "load it with --no-load-optim or --finetune")
    lay = meta["layout"]
    same_layout = ((lay["world_size"], lay["tp"], lay["pp"], lay.get("cp", 1))
                   == (ps.world_size, ps.tp_size, ps.pp_size, ps.cp_size))
    names = {id(p): n for n, p in train_state.named_params}
    owned = owned_pieces(train_state)
    index.prefetch([f"param/{names[id(pc[0])]}" for pc in owned] + ([f"rank/{ps.rank}"] if same_layout else []))

    def has(name, kind):
        found = index.entry(name)
        return found is not None and any(pc.kind == kind for pc in found[1])

    prefer_master = opt.fp32_params  # an fp32 run takes the fp32 masters of a 16-bit checkpoint

    def read(p, kind, lo, hi):
        return read_region(index, names[id(p)], kind, target_layout(p, ps.tp_size), ps.tp_rank, lo, hi,
                           tied=param_info(p).tied_copy)

    with torch.no_grad():
        # weights: owners read, the group sums bring them to everyone else (who hold zeros).
        # What a rank stores of a parameter: all of it, or under ZeRO-3 its slices (whose DP
        # ranks own disjoint parts, so nothing is summed over DP there)
        stored = opt.dp.param_pieces()
        for _, _, _, t in stored:
            t.zero_()
        for p, lo, hi, _ in owned:
            if param_info(p).tied_copy:
                continue  # arrives from the first stage over the embedding group
            kind = "master" if prefer_master and has(names[id(p)], "master") else "param"
            t = opt.dp.param_slice(p, lo, hi)
            t.copy_(read(p, kind, lo, hi).to(t.dtype))
        _sum_to_all([(p, t) for p, _, _, t in stored], ps, replicated_over_dp=not opt.dp.strategy.shards_params)
        # optimizer: masters (16-bit runs) and moments of the pieces this rank steps, read where
        # this rank owns them, summed over the groups that share them
        owned_ids = {(id(p), lo) for p, lo, _, _ in owned}
        to_sum = []
        for p, lo, hi, master in opt.pieces():
            name, state = names[id(p)], opt.optimizer.state.get(master, {})
            mine = (id(p), lo) in owned_ids
            # fp32 runs: the master is the parameter (or a view of it), loaded above, or a host
            # copy of it (offload), copied below
            tensors = [] if opt.fp32_params else [(master, "master" if mine and has(name, "master") else "param")]
            tensors += [(state[k], k) for k in STATE_KINDS if restore_optim and k in state]
            for t, kind in tensors:
                if not mine:
                    t.zero_()
                    continue
                if not has(name, kind):
                    raise CheckpointError(f"{where} has no optimizer state {kind!r} for {name} (written with "
                                          f"--optimizer {meta['optimizer']['type']}); use --no-load-optim")
                t.view(-1).copy_(read(p, kind, lo, hi))
            to_sum.append((p, [t for t, _ in tensors]))
        _sum_optimizer_state(to_sum, ps, replicated_over_dp=not opt.distributed)
        if opt.fp32_params:
            opt.masters_from_params()
    if finetune:
        _finish_stats(train_state, io, start)
        train_state.log(f"> loaded weights from {where} (--finetune: iteration 0, fresh optimizer)")
        return 0
    iteration = int(meta["iteration"])
    train_state.consumed_samples = int(meta["consumed_samples"])
    if restore_optim:
        if index.optimizer_step is not None:
            opt.set_step_count(index.optimizer_step)
        train_state.scheduler.load_state_dict(meta["scheduler"])
        if opt.scaler is not None and meta.get("grad_scaler"):
            opt.scaler.load_state_dict(meta["grad_scaler"])
    saved_rng = index.rank_state(ps.rank) if load_rng and same_layout else None
    if saved_rng is not None and saved_rng[0]:
        _set_rng_state(train_state, saved_rng[1], saved_rng[0])
    elif load_rng:
        train_state.log(f"> checkpoint layout (world {lay['world_size']}, TP {lay['tp']}, PP {lay['pp']}) differs from "
                        "this run's: RNG states are not restored (dropout masks will differ from an uninterrupted run)")
    _finish_stats(train_state, io, start)
    train_state.log(f"> loaded checkpoint {where} (iteration {iteration}, written with TP {lay['tp']} x PP {lay['pp']} "
                    f"x DP {lay['dp']}{', distributed optimizer' if lay['distributed_optimizer'] else ''})")
    return iteration


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
        for _, t in stored:
            _sum(t, ps.dp_cp_group)
    for p, t in stored:
        if param_info(p).embedding_group_sync:
            _sum(t, ps.embedding_group)


def _sum_optimizer_state(pieces: list, ps, replicated_over_dp: bool) -> None:
    """Masters and moments: over TP for TP-replicated parameters; over DP with the plain
    optimizer (whose state every DP rank holds whole)."""
    for p, tensors in pieces:
        if not param_info(p).tensor_parallel:
            for t in tensors:
                _sum(t, ps.tp_group)
    if replicated_over_dp:
        for _, tensors in pieces:
            for t in tensors:
                _sum(t, ps.dp_cp_group)


def _sum(t: torch.Tensor, group) -> None:
    if comm.group_size(group) > 1:
        comm.all_reduce(t.data, group)


# -- whole-model state, offline (converters, generation) ------------------------------------------
def load_full_state_dict(root: str, iteration: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, {global name: whole fp32 tensor, vocabulary unpadded}) of a checkpoint, in one
    process. Prefers the fp32 masters of a 16-bit run."""
    meta, index = open_checkpoint(root, iteration)
    state = {}
    for name in index.names():
        lay, pieces = index.entry(name)
        kinds = {pc.kind for pc in pieces}
        if "param" not in kinds:
            continue
        shape = list(lay["full_shape"])
        if lay["rows"] is not None:
            shape[0] = lay["rows"]
        whole = ShardLayout(tuple(shape))
        kind = "master" if "master" in kinds else "param"
        state[name] = read_region(index, name, kind, whole, 0, 0, whole.local_numel).view(shape)
    return meta, state


def save_full_state_dict(root: str, state: dict[str, torch.Tensor], model_config: dict, args: dict,
                         iteration: int = 0, tp: int = 1, pp: int = 1) -> str:
    """Write whole-model weights as a weights-only megalite checkpoint for a TP x PP layout,
    one process playing every (tp, pp) rank; returns the iteration directory."""
    from ..model import GPTConfig, pad_vocab_size

    cfg = dict(model_config)
    cfg["padded_vocab_size"] = pad_vocab_size(cfg["vocab_size"], int(args.get("make_vocab_size_divisible_by", 128)), tp)
    config = GPTConfig.from_dict(cfg)
    if config.num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} does not divide {config.num_layers} layers")
    tmp = iteration_dir(root, iteration) + ".tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    missing, records = set(), []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = tp_rank + tp * pp_rank  # DP = 1: Megatron's order
            (offset, n), = stage_layers(config.num_layers, pp, 1, pp_rank)
            chunk = _build_chunk_on_meta(config, pp_rank == 0, pp_rank == pp - 1, offset, n, tp, tp_rank)
            tensors, entries = {}, []
            for name, p in chunk.global_named_parameters():
                if not param_info(p).is_owner(tp_rank):
                    continue
                if name not in state:
                    missing.add(name)
                    continue
                key = f"param/{name}/0"
                tensors[key] = local_shard(state[name].float(), p, tp_rank, tp).reshape(-1).clone()
                entries.append({"key": key, "kind": "param", "name": name, "lo": 0, "hi": p.numel(), "tied": False,
                                "layout": shard_layout(p, tp_rank, tp, config.vocab_size), "dtype": "F32"})
            head, offsets = plan(tensors)
            for e in entries:
                e["offset"] = offsets[e["key"]]
            write(os.path.join(tmp, _data_file(rank)), tensors, head)
            records.append({"rank": rank, "file": _data_file(rank), "entries": entries, "rng": None, "tensors": {}})
    if missing:
        shutil.rmtree(tmp)
        raise CheckpointError(f"weights missing for: {', '.join(sorted(missing)[:5])}")
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": 0,
            "args": _json_safe(args), "model_config": config.to_dict(),
            "layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "vpp": 1, "dp": 1, "distributed_optimizer": False},
            "scheduler": {"num_steps": iteration}, "grad_scaler": None,
            "optimizer": {"type": args.get("optimizer", "adam"), "fp32_params": True},
            "has_optimizer_state": False}
    _write_metadata_and_index(tmp, meta, None, records)
    os.makedirs(root, exist_ok=True)
    _publish(root, iteration)
    return iteration_dir(root, iteration)


def _build_chunk_on_meta(config, pre, post, offset, n, tp, tp_rank):
    """A model chunk whose parameters have this rank's shard shapes and partition attributes but
    no storage."""
    from ..model import GPTModel
    return GPTModel(config, comm.OfflineGroup(tp, tp_rank), None, pre_process=pre, post_process=post,
                    layer_offset=offset, num_layers=n, device="meta")
