"""Megatron-LM's legacy `torch` checkpoints (--ckpt-format torch) as a megalite load index.

    iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt    one torch.save per model-parallel rank
                                                             (TP rank TT, PP rank PPP when PP > 1,
                                                             EP rank EEE when EP > 1)

Each file holds `model`, that rank's local state dict under megatron-core's local names: layers
numbered within the pipeline stage, experts within the expert-parallel rank, each tensor-parallel
tensor this TP rank's shard (`TP_SPLITS`: column-parallel weights split along their rows, SwiGLU's
fc1 as [gate_r; up_r], row-parallel ones along their columns). Besides `model`: `args`,
`iteration`, `opt_param_scheduler`, which index.megatron_metadata reads as for torch_dist.
The files are read through the allow-list unpickler, memory-mapped: a rank touches the pages of
the shards it owns. Optimizer moments are not read (they are stored by parameter position, per
rank: a notice says so); virtual pipeline stages (`model0`, `model1`, ...) are refused by name.
"""
from __future__ import annotations

import glob
import os
import re

import torch

from ...errors import CheckpointError
from ..native.index import Piece, PickledFilesIndex
from .format import is_dist_checkpoint
from .index import VOCAB_TABLES, MegatronIndex, megatron_metadata, plain_args
from .safe_pickle import torch_load
from ..native.tensor_file import RangeReader

FILE = "model_optim_rng.pt"
_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# megatron-core's tensor-parallel splits by name suffix: (partition dim, strided by SwiGLU's halves)
TP_SPLITS = (("self_attention.linear_qkv.weight", 0, False), ("self_attention.linear_qkv.bias", 0, False),
             ("self_attention.linear_proj.weight", 1, False), ("linear_fc1.weight", 0, True),
             ("linear_fc1.bias", 0, True), ("linear_fc2.weight", 1, False),
             ("embedding.word_embeddings.weight", 0, False), ("output_layer.weight", 0, False))
_UNSUPPORTED = ("linear_q_down_proj", "linear_kv_down_proj", "linear_q_proj", "mtp.")


def tp_split(name: str, swiglu: bool):
    """(dim, stride) of a tensor-parallel parameter, None for a replicated one."""
    for suffix, dim, strided in TP_SPLITS:
        if name.endswith(suffix):
            return dim, 2 if strided and swiglu else 1
    return None


def is_legacy_checkpoint(directory: str) -> bool:
    return bool(glob.glob(os.path.join(directory, "mp_rank_*", FILE)))


class MegatronLegacyIndex(PickledFilesIndex):
    """Index interface over a legacy torch checkpoint directory (iter_NNNNNNN)."""
    foreign = "Megatron-LM torch"
    has_moments = False
    optimizer_step = None

    def __init__(self, directory: str, io: RangeReader | None = None):
        self.directory, self.io = directory, io or RangeReader()
        paths = sorted(glob.glob(os.path.join(directory, "mp_rank_*", FILE)))
        if not paths:
            raise CheckpointError(f"{directory} holds no mp_rank_*/{FILE}: not a Megatron-LM torch checkpoint")
        self.paths, self._loaded = paths, {}
        first = self._file(0)
        self.common = {k: v for k, v in first.items() if k not in ("model", "optimizer", "rng_state")}
        self.args = plain_args(first.get("args"))
        if any(k.startswith("model") and k != "model" for k in first):
            raise CheckpointError(f"{paths[0]}: virtual pipeline stages (model0, model1, ...) are not read from "
                                  "Megatron-LM torch checkpoints; convert it to torch_dist in Megatron-LM")
        self._entries = {}
        for fid, path in enumerate(paths):
            self._index_file(fid, path)
        self.metadata = megatron_metadata(self)

    def _file(self, fid: int) -> dict:
        if fid not in self._loaded:
            path = self.paths[fid]
            self.io.opened.add(path)
            out = torch_load(path, mmap=True)
            if not isinstance(out, dict) or "model" not in out and "model0" not in out:
                raise CheckpointError(f"{path}: no 'model' state dict in it: not a Megatron-LM checkpoint file")
            self._loaded[fid] = out
        return self._loaded[fid]

    def _ranks(self, path: str) -> tuple[int, int, int]:
        """(tp, pp, ep rank) from the directory name; one suffix is PP's unless args say PP is 1."""
        m = _DIR.match(os.path.basename(os.path.dirname(path)))
        if m is None:
            raise CheckpointError(f"{path}: not an mp_rank_TT[_PPP][_EEE] directory")
        tp, a, b = int(m.group(1)), m.group(2), m.group(3)
        pp_size = self.args.get("pipeline_model_parallel_size") or 1
        if b is not None:
            return tp, int(a), int(b)
        if a is None:
            return tp, 0, 0
        return (tp, int(a), 0) if pp_size > 1 else (tp, 0, int(a))

    def _index_file(self, fid: int, path: str) -> None:
        args = self.args
        tp_rank, pp_rank, ep_rank = self._ranks(path)
        tp, pp, ep = (args.get(k) or 1 for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                  "expert_model_parallel_size"))
        etp = args.get("expert_tensor_parallel_size") or tp
        if etp != tp:
            raise CheckpointError(f"{path}: expert tensor parallelism {etp} differs from TP {tp}; not read from "
                                  "Megatron-LM torch checkpoints")
        layers, experts = args["num_layers"], args.get("num_experts") or 0
        for local, t in self._file(fid)["model"].items():
            if "_extra_state" in local or not isinstance(t, torch.Tensor):
                continue
            if local.startswith(_UNSUPPORTED) or any(u in local for u in _UNSUPPORTED):
                raise CheckpointError(f"{path}: {local} (multi-latent attention / MTP) is not read from Megatron-LM "
                                      "torch checkpoints")
            name = _global_name(local, pp_rank * layers // pp, ep_rank * experts // max(ep, 1) if experts else 0)
            if ep_rank != 0 and ".mlp.experts." not in name:
                continue  # every expert-parallel rank's file holds the dense tensors too: EP rank 0's are read
            split = tp_split(name, bool(args.get("swiglu")))
            if split is None and tp_rank != 0:
                continue  # replicated: TP rank 0's copy
            shape = list(t.shape)
            if split is not None:
                shape[split[0]] *= tp
            rows = shape[0] if name in VOCAB_TABLES else None
            layout = {"full_shape": shape, "dim": split[0] if split else 0, "stride": split[1] if split else 1,
                      "tp_size": tp if split else 1, "rows": rows}
            entry = self._entries.setdefault(name, (layout, []))
            entry[1].append(Piece("param", tp_rank if split else 0, 0, t.numel(), fid, local, None, False))

    def _tensors(self, fid: int) -> dict:
        return self._file(fid)["model"]

    def read(self, piece: Piece, a: int, b: int) -> torch.Tensor:
        return super().read(piece, a, b).float()

    def rank_state(self, rank: int):
        return None


def _global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    """A stage's local name with global layer (and expert) numbers."""
    m = _LAYER.match(local)
    if m is None:
        return local
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


def open_megatron(directory: str, io: RangeReader | None = None):
    """The index of a Megatron-LM checkpoint directory (torch_dist or torch), or None if it is neither."""
    if is_dist_checkpoint(directory):
        return MegatronIndex(directory, io)
    if is_legacy_checkpoint(directory):
        return MegatronLegacyIndex(directory, io)
    return None


def read_megatron_metadata(directory: str, flag: str, root: str) -> dict:
    """The metadata (index.megatron_metadata) of a Megatron-LM checkpoint; errors name `flag`."""
    try:
        index = open_megatron(directory)
        if index is None:
            raise CheckpointError(f"{directory}: neither .metadata (torch_dist) nor mp_rank_*/{FILE} (torch)")
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {root}: {e}") from None
    index.io.close()
    return index.metadata
