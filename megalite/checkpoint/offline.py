"""Whole-model state in one process, without a process group (tools/checkpoint/convert.py,
generation): read every tensor of a checkpoint whole, or write whole tensors as a weights-only
checkpoint for a TP x PP layout."""
from __future__ import annotations

import os
import shutil

import torch

from .. import comm
from ..errors import CheckpointError
from ..parallel_state import stage_layers
from ..config.run import CONFIG_VERSION
from ..tensor_parallel.param_info import param_info
from .load import open_checkpoint
from .native.region import read_region
from .native.reshard import ShardLayout
from .native.save import publish, write_metadata_and_index
from .native.state import local_shard, shard_layout
from .native.tensor_file import plan, write
from .paths import FORMAT_VERSION, data_file, iteration_dir


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


def save_full_state_dict(root: str, state: dict[str, torch.Tensor], model_config: dict, run_config: dict,
                         iteration: int = 0, tp: int = 1, pp: int = 1) -> str:
    """Write whole-model weights as a weights-only megalite checkpoint for a TP x PP layout,
    one process playing every (tp, pp) rank; returns the iteration directory. `run_config` is the
    RunConfig record (RunConfig.to_dict()) the checkpoint carries for the tools."""
    from ..model import GPTConfig, pad_vocab_size

    cfg = dict(model_config)
    divisible_by = cfg.get("make_vocab_size_divisible_by") or run_config["model"].get("make_vocab_size_divisible_by", 128)
    cfg["padded_vocab_size"] = pad_vocab_size(cfg["vocab_size"], divisible_by, tp)
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
            # persistent buffers (MoE expert biases), replicated: written by TP rank 0, when present
            buffers = [(n, b) for n, b in chunk.global_named_buffers() if tp_rank == 0 and n in state]
            for name, p in list(chunk.global_named_parameters()) + buffers:
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
            write(os.path.join(tmp, data_file(rank)), tensors, head)
            records.append({"rank": rank, "file": data_file(rank), "entries": entries, "rng": None, "tensors": {}})
    if missing:
        shutil.rmtree(tmp)
        raise CheckpointError(f"weights missing for: {', '.join(sorted(missing)[:5])}")
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": 0,
            "config_version": CONFIG_VERSION, "config": run_config, "model_config": config.to_dict(),
            "layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "vpp": 1, "dp": 1, "distributed_optimizer": False},
            "scheduler": {"num_steps": iteration}, "grad_scaler": None,
            "optimizer": {"type": run_config["optimizer"]["optimizer"], "fp32_params": True},
            "has_optimizer_state": False}
    write_metadata_and_index(tmp, meta, None, records)
    os.makedirs(root, exist_ok=True)
    publish(root, iteration)
    return iteration_dir(root, iteration)


def _build_chunk_on_meta(config, pre, post, offset, n, tp, tp_rank):
    """A model chunk whose parameters have this rank's shard shapes and partition attributes but
    no storage."""
    from ..model import GPTModel
    return GPTModel(config, comm.OfflineGroup(tp, tp_rank), None, pre_process=pre, post_process=post,
                    layer_offset=offset, num_layers=n, device="meta")
