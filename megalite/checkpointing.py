"""Checkpoints that resume exactly, on the layout that wrote them or any other.

Layout on disk (Megatron-LM's directory names):

    DIR/latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    DIR/iter_0000100/metadata.json             iteration, consumed samples, arguments, model config,
                                               the layout that wrote it, scheduler and loss scaler
    DIR/iter_0000100/rank_00003.pt             rank 3's tensors (torch.save, loaded weights_only)
    DIR/iter_0000100/rank_00003.json           what each of them is (below) and rank 3's RNG states

Every rank writes its own files in parallel; nothing is gathered. Each saved tensor is a flat
range [lo, hi) of one parameter's *local shard* (of the weight, its fp32 master, or an optimizer
moment), recorded with how that shard was cut from the whole tensor: TP partition dimension,
stride, TP rank and size, and the real vocabulary rows for padded tables. With the plain
optimizer a range is the whole shard; the distributed optimizer's slices cut through parameters
and each DP rank saves its own.

Loading on any layout rebuilds one whole tensor at a time from the pieces that cover it and
slices it to this rank's new shard (and flat range, for a ZeRO-1 slice). A rank materialises at
most one full parameter at once, never the model.

Saves are atomic: files go to `iter_N.tmp`, which is renamed once every rank has finished, and
only then does the latest pointer move, so a run killed mid-save leaves the previous checkpoint
as the latest. `async_save` copies the tensors to host memory, writes them from a thread while
training goes on, and finalises at a later iteration.
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import comm
from .model.init import shard, unshard
from .parallel_state import ParallelState, stage_layers
from .tensor_parallel.param_info import ParamInfo, param_info

FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
STATE_KINDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")

# model settings that must agree between a checkpoint and the run loading it: config key -> flag
MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (the tokenizer's vocabulary)", "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization", "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "rotary_percent": "--rotary-percent", "norm_epsilon": "--norm-epsilon",
}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or does not fit this run."""


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
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    meta["dir"] = iteration_dir(root, iteration)
    return meta


def check_model_config(saved: dict, current: dict, where: str) -> None:
    """Raise naming the first model setting that differs."""
    for key, flag in MODEL_FLAGS.items():
        if saved.get(key) != current.get(key):
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


def collect_rank_state(train_state: TrainState) -> tuple[dict, dict]:
    """This rank's tensors (host copies, safe to write from another thread) and their index."""
    ps, opt = train_state.ps, train_state.optimizer
    vocab_size = train_state.model_config.vocab_size
    opt.dp.finish_param_sync()
    tensors, entries = {}, []

    def add(kind, name, p, lo, hi, tensor):
        key = f"{kind}/{name}/{lo}"
        tensors[key] = tensor.detach().reshape(-1)[: hi - lo].to("cpu", copy=True)
        entries.append({"key": key, "kind": kind, "name": name, "lo": lo, "hi": hi,
                        "layout": shard_layout(p, ps.tp_rank, ps.tp_size, vocab_size)})

    # TP-replicated tensors are saved by TP rank 0 only; the tied embedding's copy on the last
    # stage is not saved at all (it equals the first stage's). Parameters replicated over DP are
    # saved by DP rank 0; under ZeRO-3 every DP rank saves the slices it stores.
    names = {id(p): n for n, p in train_state.named_params}
    if opt.dp.shards_params or ps.dp_rank == 0:
        for p, lo, hi, t in opt.dp.param_pieces():
            if param_info(p).is_owner(ps.tp_rank):
                add("param", names[id(p)], p, lo, hi, t)
    saves_states = opt.distributed or ps.dp_rank == 0  # plain optimizer: DP replicas are identical
    for p, lo, hi, master in opt.pieces():
        if not (saves_states and param_info(p).is_owner(ps.tp_rank)):
            continue
        name = names[id(p)]
        if not opt.fp32_params:
            add("master", name, p, lo, hi, master)
        state = opt.optimizer.state.get(master, {})
        for kind in STATE_KINDS:
            if kind in state:
                add(kind, name, p, lo, hi, state[kind])
    rng_tensors, rng_values = _rng_state(train_state)
    tensors.update(rng_tensors)
    index = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank, "entries": entries,
             "rng": rng_values, "optimizer_step": opt.step_count()}
    return tensors, index


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
                   "dp": ps.dp_size, "distributed_optimizer": bool(opt.distributed),
                   "data_parallel_sharding_strategy": opt.dp.strategy},
        "scheduler": train_state.scheduler.state_dict(),
        "grad_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "optimizer": {"type": train_state.flags.get("optimizer", "adam"), "fp32_params": bool(opt.fp32_params)},
        "has_optimizer_state": True,
    }


def _write_rank_files(directory: str, rank: int, tensors: dict, index: dict) -> None:
    torch.save(tensors, os.path.join(directory, f"rank_{rank:05d}.pt"))
    with open(os.path.join(directory, f"rank_{rank:05d}.json"), "w") as f:
        json.dump(index, f)


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

    def __init__(self, root: str, async_save: bool = False):
        self.root, self.async_save = root, async_save
        self.pending: tuple[int, threading.Thread] | None = None
        self.error: BaseException | None = None

    def save(self, train_state: TrainState, iteration: int) -> None:
        self.finalize(blocking=True)  # at most one save in flight
        ps = train_state.ps
        tmp = iteration_dir(self.root, iteration) + ".tmp"
        if ps.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            if os.path.isdir(tmp):  # left by a run killed mid-save
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            with open(os.path.join(tmp, "metadata.json"), "w") as f:
                json.dump(build_metadata(train_state, iteration), f, indent=1)
        comm.barrier(comm.world_group())
        tensors, index = collect_rank_state(train_state)
        start = time.perf_counter()
        if not self.async_save:
            _write_rank_files(tmp, ps.rank, tensors, index)
            self._finish(train_state, iteration)
            train_state.log(f"> saved checkpoint {iteration_dir(self.root, iteration)} "
                        f"({time.perf_counter() - start:.2f} s)")
            return

        def write():
            try:
                _write_rank_files(tmp, ps.rank, tensors, index)
            except BaseException as e:  # reported at finalisation, on the training thread
                self.error = e

        thread = threading.Thread(target=write, name="megalite-async-save", daemon=True)
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
class CheckpointReader:
    """Rebuilds whole tensors from the pieces of a checkpoint written on any layout."""

    def __init__(self, directory: str):
        self.directory = directory
        self.index_files = sorted(glob.glob(os.path.join(directory, "rank_*.json")))
        if not self.index_files:
            raise CheckpointError(f"{directory} holds no rank files: not a complete checkpoint")
        self.ranks = {}
        self.pieces: dict[tuple[str, str], list[tuple[str, dict]]] = {}
        for path in self.index_files:
            with open(path) as f:
                index = json.load(f)
            data = path[:-len(".json")] + ".pt"
            if not os.path.isfile(data):
                raise CheckpointError(f"{data} is missing (its index {path} exists)")
            self.ranks[index["rank"]] = (index, data)
            for e in index["entries"]:
                self.pieces.setdefault((e["name"], e["kind"]), []).append((data, e))
        self._files: dict[str, dict] = {}

    def _file(self, path: str) -> dict:
        if path not in self._files:
            try:
                self._files[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointError(f"cannot read {path}: {e}") from e
        return self._files[path]

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.pieces

    def names(self, kind: str = "param") -> list[str]:
        return sorted(n for n, k in self.pieces if k == kind)

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The whole tensor (vocabulary rows unpadded), rebuilt from every piece of it."""
        pieces = self.pieces.get((name, kind))
        if not pieces:
            raise CheckpointError(f"{self.directory} has no {kind} for {name}")
        layout0 = pieces[0][1]["layout"]
        shards: dict[int, torch.Tensor] = {}
        covered: dict[int, int] = {}
        for path, e in pieces:
            lay = e["layout"]
            r = lay["tp_rank"]
            if r not in shards:
                shards[r] = torch.empty(int(np.prod(lay["local_shape"])), dtype=torch.float32)
                covered[r] = 0
            shards[r][e["lo"]:e["hi"]] = self._file(path)[e["key"]].float()
            covered[r] += e["hi"] - e["lo"]
        tp_size = layout0["tp_size"]
        for r in range(tp_size):
            if covered.get(r) != (shards[r].numel() if r in shards else -1):
                raise CheckpointError(f"{self.directory}: {kind} of {name} is incomplete for TP rank {r}")
        info = ParamInfo(tensor_parallel=layout0["tp"], partition_dim=layout0["dim"],
                         partition_stride=layout0["stride"])
        full = unshard([shards[r].view(layout0["local_shape"]) for r in range(tp_size)], info)
        if layout0["rows"] is not None:
            full = full[: layout0["rows"]]
        return full

    def rank_tensors(self, rank: int) -> tuple[dict, dict]:
        index, data = self.ranks[rank]
        return index, self._file(data)


def load_checkpoint(train_state: TrainState, root: str, finetune: bool = False, load_optim: bool = True,
                    load_rng: bool = True) -> int:
    """Load the latest checkpoint under `root` into `train_state`; returns its iteration (0 with
    --finetune). No checkpoint there: a notice, and training starts from scratch."""
    ps, opt = train_state.ps, train_state.optimizer
    if read_tracker(root) is None:
        train_state.log(f"> no checkpoint found under {root} ({TRACKER} missing): training from scratch")
        return 0
    meta = read_metadata(root)
    where = meta["dir"]
    check_model_config(meta["model_config"], train_state.model_config.to_dict(), where)
    reader = CheckpointReader(where)
    tp_rank, tp_size = ps.tp_rank, ps.tp_size
    prefer_master = opt.fp32_params  # an fp32 run takes the fp32 masters of a 16-bit checkpoint
    cache: dict[tuple[str, str], torch.Tensor] = {}

    def local(name, p, kind):
        key = (name, kind)
        if key not in cache:
            cache.clear()  # one whole tensor at a time
            cache[key] = local_shard(reader.full(name, kind), p, tp_rank, tp_size).reshape(-1)
        return cache[key]

    with torch.no_grad():
        names = {id(p): n for n, p in train_state.named_params}
        for p, lo, hi, t in opt.dp.param_pieces():  # whole parameters, or ZeRO-3's slices
            name = names[id(p)]
            kind = "master" if prefer_master and reader.has(name, "master") else "param"
            t.view(-1).copy_(local(name, p, kind)[lo:hi].to(t.dtype))
        restore_optim = load_optim and not finetune
        if restore_optim and not meta.get("has_optimizer_state", True):
            raise CheckpointError(f"{where} holds weights only (no optimizer state); "
                                  "load it with --no-load-optim or --finetune")
        for p, lo, hi, master in opt.pieces():
            name = names[id(p)]
            # fp32: the master is usually the parameter (or a view of it), loaded above; an
            # offloaded one is a host copy, so every master is loaded
            kind = "master" if reader.has(name, "master") else "param"
            master.view(-1).copy_(local(name, p, kind)[lo:hi])
            if not restore_optim:
                continue
            state = opt.optimizer.state.get(master, {})
            for kind in STATE_KINDS:
                if kind in state:
                    if not reader.has(name, kind):
                        raise CheckpointError(f"{where} has no optimizer state {kind!r} for {name} "
                                              f"(written with --optimizer {meta['optimizer']['type']}); "
                                              "use --no-load-optim")
                    state[kind].view(-1).copy_(local(name, p, kind)[lo:hi])
        cache.clear()
    if finetune:
        train_state.log(f"> loaded weights from {where} (--finetune: iteration 0, fresh optimizer)")
        return 0
    iteration = int(meta["iteration"])
    train_state.consumed_samples = int(meta["consumed_samples"])
    if restore_optim:
        steps = [idx.get("optimizer_step") for idx, _ in reader.ranks.values() if idx.get("optimizer_step") is not None]
        if steps:
            opt.set_step_count(steps[0])
        train_state.scheduler.load_state_dict(meta["scheduler"])
        if opt.scaler is not None and meta.get("grad_scaler"):
            opt.scaler.load_state_dict(meta["grad_scaler"])
    lay = meta["layout"]
    same_layout = (lay["world_size"], lay["tp"], lay["pp"]) == (ps.world_size, ps.tp_size, ps.pp_size)
    if load_rng and same_layout and ps.rank in reader.ranks and reader.ranks[ps.rank][0].get("rng"):
        index, tensors = reader.rank_tensors(ps.rank)
        _set_rng_state(train_state, {k: v for k, v in tensors.items() if k.startswith("rng/")}, index["rng"])
    elif load_rng:
        train_state.log(f"> checkpoint layout (world {lay['world_size']}, TP {lay['tp']}, PP {lay['pp']}) differs from "
                    "this run's: RNG states are not restored (dropout masks will differ from an uninterrupted run)")
    train_state.log(f"> loaded checkpoint {where} (iteration {iteration}, written with TP {lay['tp']} x PP {lay['pp']} "
                f"x DP {lay['dp']}{', distributed optimizer' if lay['distributed_optimizer'] else ''})")
    return iteration


# -- whole-model state, offline (converters, generation) ------------------------------------------
def load_full_state_dict(root: str, iteration: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, {global name: whole fp32 tensor}) of a checkpoint, in one process. Prefers the
    fp32 masters of a 16-bit run."""
    meta = read_metadata(root, iteration)
    reader = CheckpointReader(meta["dir"])
    state = {}
    for name in reader.names("param"):
        state[name] = reader.full(name, "master" if reader.has(name, "master") else "param")
    return meta, state


def save_full_state_dict(root: str, state: dict[str, torch.Tensor], model_config: dict, args: dict,
                         iteration: int = 0, tp: int = 1, pp: int = 1) -> str:
    """Write whole-model weights as a weights-only megalite checkpoint for a TP x PP layout,
    one process playing every (tp, pp) rank; returns the iteration directory."""
    from .model import GPTConfig, pad_vocab_size

    cfg = dict(model_config)
    cfg["padded_vocab_size"] = pad_vocab_size(cfg["vocab_size"], int(args.get("make_vocab_size_divisible_by", 128)), tp)
    config = GPTConfig.from_dict(cfg)
    if config.num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} does not divide {config.num_layers} layers")
    tmp = iteration_dir(root, iteration) + ".tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    missing = set()
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
                entries.append({"key": key, "kind": "param", "name": name, "lo": 0, "hi": p.numel(),
                                "layout": shard_layout(p, tp_rank, tp, config.vocab_size)})
            _write_rank_files(tmp, rank, tensors, {"rank": rank, "tp": tp_rank, "pp": pp_rank, "dp": 0,
                                                   "entries": entries, "rng": None, "optimizer_step": None})
    if missing:
        shutil.rmtree(tmp)
        raise CheckpointError(f"weights missing for: {', '.join(sorted(missing)[:5])}")
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": 0,
            "args": _json_safe(args), "model_config": config.to_dict(),
            "layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "vpp": 1, "dp": 1, "distributed_optimizer": False},
            "scheduler": {"num_steps": iteration}, "grad_scaler": None,
            "optimizer": {"type": args.get("optimizer", "adam"), "fp32_params": True},
            "has_optimizer_state": False}
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
    os.makedirs(root, exist_ok=True)
    _publish(root, iteration)
    return iteration_dir(root, iteration)


def _build_chunk_on_meta(config, pre, post, offset, n, tp, tp_rank):
    """A model chunk whose parameters have this rank's shard shapes and partition attributes but
    no storage."""
    from .model import GPTModel
    return GPTModel(config, comm.OfflineGroup(tp, tp_rank), None, pre_process=pre, post_process=post,
                    layer_offset=offset, num_layers=n, device="meta")
