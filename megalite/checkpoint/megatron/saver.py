"""--save with --ckpt-format torch_dist: training writes Megatron-LM's torch_dist checkpoints, each
rank its own chunks, which megatron-core's `dist_checkpointing.load` reads into its GPTModel on
any layout and megalite's --load reads back (index.py).

Who writes what: a parameter's first data-parallel replica writes its tensor-parallel shard, TP
rank 0 the TP-replicated ones (megalite's ownership of whole parameters, as megatron-core's
replica ids say); the last stage's copy of a tied embedding is not written. A shard is a box of
the global tensor, or `stride` boxes for SwiGLU's fc1 (each TP rank holds [gate_r; up_r], whose
rows lie at r·f/T and f + r·f/T of the global [gate; up], as megatron-core stores it). Layers
and experts are stacked along leading axes (names.py). common.pt holds Megatron-LM's
`args` (the run's flags under their Megatron-LM names), the iteration, consumed samples and the
learning-rate schedule's state.

What is not written (one notice per run): the optimizer's moments (a torch_dist checkpoint holds
them in Megatron-LM's optimizer-specific layouts; megalite's own format keeps them) and RNG
states. ZeRO-3 and --async-save are refused with it (arguments/validation.py).
"""
from __future__ import annotations

import os
import shutil
import time

import torch

from ... import comm
from ...tensor_parallel.param_info import param_info
from ..paths import TRACKER, iteration_dir
from .format import write_metadata, write_rank_file
from .export import LINEARS, megatron_args
from .names import index_depth, megatron_keys
from ..native.state import TrainState, shard_layout


def shard_boxes(name: str, p, tp_rank: int, tp_size: int, num_layers: int, num_experts: int) -> list:
    """[(key, global shape, offsets, chunk)] of this rank's shard of parameter `name`."""
    lay = shard_layout(p, tp_rank, tp_size, 0)
    key, index = megatron_keys(name)[0]
    lead = (num_layers, num_experts)[:index_depth(key)]
    local = p.detach()
    full = list(local.shape)
    if not lay["tp"]:
        return [(key, lead + tuple(full), index + (0,) * local.dim(), local.reshape((1,) * len(index) + local.shape))]
    dim, stride, rank, size = lay["dim"], lay["stride"], lay["tp_rank"], lay["tp_size"]
    full[dim] *= size
    out = []
    for j, block in enumerate(local.chunk(stride, dim=dim)):  # [gate_r; up_r] for SwiGLU's fc1
        offsets = [0] * local.dim()
        offsets[dim] = j * full[dim] // stride + rank * block.shape[dim]
        out.append((key, lead + tuple(full), index + tuple(offsets), block.reshape((1,) * len(index) + block.shape)))
    return out


def _extra_state(key: str, index: tuple, lead: tuple) -> dict:
    """megatron-core's (empty) `_extra_state` object of a linear layer's weight `key`."""
    module = key.rsplit(".", 2)
    if not (key.endswith(".weight") and len(module) == 3 and module[1] in LINEARS):
        return {}
    obj = f"{key[:-len('weight')]}_extra_state"
    return {f"{obj}/shard_{'.'.join(map(str, index or (0,)))}_{'.'.join(map(str, lead or (1,)))}": [None]}


def rank_items(train_state: TrainState) -> tuple[list, dict]:
    """This rank's chunks and objects (host copies)."""
    ps, cfg = train_state.ps, train_state.model_config
    train_state.optimizer.dp.finish_param_sync()
    num_layers, num_experts = cfg.num_layers, cfg.num_experts or 0
    tensors, objects = [], {}
    for name, p in train_state.named_params:
        info = param_info(p)
        tp_rank, _ = info.tp_place(ps.tp_rank, ps.tp_size)
        if info.tied_copy or ps.replica_rank(info.expert_parallel) != 0 or not info.is_owner(ps.tp_rank):
            continue
        for key, shape, offsets, chunk in shard_boxes(name, p, ps.tp_rank, ps.tp_size, num_layers, num_experts):
            tensors.append((key, shape, offsets, chunk.to("cpu", copy=True)))
        if tp_rank == 0:
            key, index = megatron_keys(name)[0]
            objects.update(_extra_state(key, index, (num_layers, num_experts)[:index_depth(key)]))
    if ps.tp_rank == 0 and ps.dp_cp_rank == 0:  # persistent buffers (the MoE expert bias), once per stage
        for name, b in train_state.named_buffers:
            key, index = megatron_keys(name)[0]
            lead = (num_layers, num_experts)[:index_depth(key)]
            tensors.append((key, lead + tuple(b.shape), index + (0,) * b.dim(),
                            b.detach().reshape((1,) * len(index) + b.shape).to("cpu", copy=True)))
    return tensors, objects


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
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "opt_param_scheduler": scheduler,
            "num_floating_point_operations_so_far": 0}


class MegatronSaver:
    """The saver of --ckpt-format torch_dist (CheckpointSaver's interface, synchronous)."""

    def __init__(self, root: str):
        self.root, self.noticed = root, False

    def save(self, train_state: TrainState, iteration: int) -> None:
        ps, start = train_state.ps, time.perf_counter()
        tmp = iteration_dir(self.root, iteration) + ".tmp"
        if ps.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        comm.barrier(comm.world_group())
        tensors, objects = rank_items(train_state)
        records = write_rank_file(tmp, ps.rank, tensors, objects)
        everyone = comm.gather_object(records, 0, comm.world_group())
        if ps.rank == 0:
            write_metadata(tmp, [r for part in everyone for r in part], common_state(train_state, iteration))
            final = iteration_dir(self.root, iteration)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            with open(os.path.join(self.root, TRACKER), "w") as f:
                f.write(f"{iteration}\n")
        comm.barrier(comm.world_group())
        if not self.noticed:
            self.noticed = True
            train_state.log("> --ckpt-format torch_dist: checkpoints hold the weights, iteration, consumed samples "
                            "and LR schedule; not the optimizer's moments or RNG states (megalite's own format does)")
        train_state.log(f"> saved torch_dist checkpoint {iteration_dir(self.root, iteration)} "
                        f"({time.perf_counter() - start:.2f} s)")

    def finalize(self, blocking: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
