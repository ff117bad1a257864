"""--moe-use-upcycling, the load: a dense checkpoint (any layout) read into this run's MoE model
(any layout: TP, PP, EP, ZeRO), as Megatron-LM's training.py does it: the weights converted
(plan.py says which dense weight each MoE weight starts from), no optimizer state and no
learning-rate schedule taken (both start fresh), the consumed samples and, on the same layout,
the RNG states taken (unless --finetune / --no-load-rng), and the run continues at iteration 1,
which the caller saves to --save before training (initialize.py).

Each rank reads only the elements it owns, through checkpoint/load.py's readers: an expert's TP shard of
slice j = e mod g of the dense MLP is TP shard j·T + r of the dense weight cut into g·T parts
(fc1 with SwiGLU's stride 2, fc2 along its input dimension), so native/reshard.py's arithmetic finds
the saved pieces whatever layout wrote them."""
from __future__ import annotations

import time

import torch

from ...errors import CheckpointError
from ...model.init import full_tensor, global_shape, initial_value
from ...tensor_parallel.param_info import param_info
from ..load import (_finish_stats, _load_buffers, _load_optimizer_state, _load_weights, _OwnedReader, _restore_progress,
                   open_checkpoint)
from ..native.region import read_region
from ..native.reshard import ShardLayout
from ..native.state import TrainState, check_model_config
from ..native.tensor_file import RangeReader
from ..paths import read_tracker
from .plan import ROUTER_WEIGHT, dense_ffn_problem, dense_source, weight_scale

UPCYCLED_ITERATION = 1  # Megatron-LM's args.iteration = 1 after upcycling


class _UpcycleReader(_OwnedReader):
    """Reads this run's MoE parameters from a dense checkpoint: experts from the dense MLP (sliced
    and scaled), the weights both models share under their own names, and the parameters the
    dense model lacks (router, shared expert) as this run initialised them."""

    def __init__(self, train_state: TrainState, index, granularity: int, scale: float, seed: int):
        super().__init__(train_state, index)
        self.granularity, self.scale, self.seed = granularity, scale, seed
        self.gated = train_state.model_config.gated_linear_unit  # fc1 holds [gate; up]: sliced alike

    def has(self, name: str, kind: str) -> bool:
        source = dense_source(name)
        if source is not None:
            return super().has(source[0], kind)
        return super().has(name, kind) if self.index.entry(name) is not None else kind == "param"

    def read(self, p, kind: str, lo: int, hi: int) -> torch.Tensor:
        name = self.names[id(p)]
        source = dense_source(name)
        if source is not None:
            return self._read_expert(p, source, kind, lo, hi)
        if self.index.entry(name) is not None:
            return super().read(p, kind, lo, hi)
        return self._initial(p, name).reshape(-1)[lo:hi]

    def _read_expert(self, p, source, kind: str, lo: int, hi: int) -> torch.Tensor:
        dense_name, expert, linear, what = source
        g, info = self.granularity, param_info(p)
        T = self.ps.tp_size if info.tensor_parallel else 1
        r = self.ps.tp_rank if info.tensor_parallel else 0
        shape = list(global_shape(p, T))
        if what == "bias" and linear == "linear_fc2":  # added whole by every expert: copied, unscaled
            layout, rank, scale = ShardLayout(tuple(shape)), 0, 1.0
        else:  # slice e mod g of the dense weight's hidden units, then this rank's TP shard of it
            dim = 0 if linear == "linear_fc1" else 1
            shape[dim] *= g
            stride = 2 if linear == "linear_fc1" and self.gated else 1
            layout, rank, scale = ShardLayout(tuple(shape), dim, stride, g * T), (expert % g) * T + r, self.scale
        out = read_region(self.index, dense_name, kind, layout, rank, lo, hi)
        return out.mul_(scale) if scale != 1.0 else out

    def _initial(self, p, name: str) -> torch.Tensor:
        """This rank's TP shard of `p` as the run initialised it (fp32); the router's rows repeated
        in runs of g with granularity g (Megatron-LM's _process_router_param)."""
        if self.granularity > 1 and ROUTER_WEIGHT.search(name):
            full = full_tensor(p, name, self.seed, global_shape(p, 1))
            return full[torch.arange(full.shape[0]) // self.granularity]
        return initial_value(p, name, self.seed, self.ps.tp_group)


def load_upcycled(train_state: TrainState, root: str, granularity: int, seed: int, finetune: bool = False,
                  load_rng: bool = True) -> int:
    """Read the dense checkpoint under `root` into this MoE run (see the module docstring);
    returns the iteration the run continues from."""
    if read_tracker(root) is None:
        raise CheckpointError(f"--moe-use-upcycling: no checkpoint under --load {root} to upcycle")
    start = time.perf_counter()
    io = RangeReader()
    meta, index = open_checkpoint(root, io=io)
    where, dense, moe = meta["dir"], meta["model_config"], train_state.model_config.to_dict()
    if dense.get("num_experts"):
        raise CheckpointError(f"--moe-use-upcycling: {where} is already an MoE checkpoint (--num-experts "
                              f"{dense['num_experts']}); upcycling converts a dense one")
    problem = dense_ffn_problem(dense, moe, granularity)
    if problem:
        raise CheckpointError(f"--moe-use-upcycling: {where}: {problem}")
    # every other architecture flag must be the dense model's (Megatron-LM's upcycling note)
    check_model_config(dense, dict(moe, num_experts=None, ffn_hidden_size=dense["ffn_hidden_size"]), where)
    reader = _UpcycleReader(train_state, index, granularity, weight_scale(moe, granularity), seed)
    with torch.no_grad():
        _load_weights(train_state, reader)
        _load_buffers(train_state, index)
        _load_optimizer_state(train_state, reader, False, meta)  # the 16-bit run's masters only
        if train_state.optimizer.fp32_params:
            train_state.optimizer.masters_from_params()
    if not finetune:  # consumed samples and (same layout) RNG, as Megatron-LM's load of the dense model
        lay, ps = meta["layout"], train_state.ps
        same_layout = ((lay["world_size"], lay["tp"], lay["pp"], lay.get("cp", 1))
                       == (ps.world_size, ps.tp_size, ps.pp_size, ps.cp_size))
        _restore_progress(train_state, meta, index, False, load_rng and same_layout, load_rng)
    _finish_stats(train_state, io, start)
    train_state.log(f"> upcycled dense checkpoint {where} (iteration {meta['iteration']}) to {moe['num_experts']} "
                    f"experts per MoE layer (granularity {granularity}); continuing at iteration {UPCYCLED_ITERATION} "
                    "with a fresh optimizer and learning-rate schedule")
    return UPCYCLED_ITERATION
