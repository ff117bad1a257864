"""A Megatron-LM torch_dist checkpoint seen as a megalite checkpoint index (native/index.py's interface),
so that checkpoint/load.py reads it on any layout exactly as it reads its own: each megalite parameter is one
whole "piece" (TP size 1, the full tensor) whose elements come from the slice of the stacked
global tensor at its layer (and expert) index (names.py), and a rank reads only the
chunks that overlap the elements it owns (format.py).

Besides the weights: the iteration, consumed samples, the LR schedule's position
(OptimizerParamScheduler.num_steps, in samples) and Megatron-LM's `args` (for
--use-checkpoint-args and the model check) come from common.pt; Adam's moments (and fp32 masters)
where a non-distributed optimizer (or a fully reshardable distributed one, and megalite's
torch_dist saves) saved them under `optimizer.state.<kind>.<key>`, with the optimizer's shared
step (`common_step`). RNG states are restored from the `megalite_rng` objects of megalite's own
torch_dist saves on the layout that wrote them; Megatron-LM's are not (per TP x PP rank of its own
layout and CUDA generator).
"""
from __future__ import annotations

import dataclasses
import itertools
from math import prod

import torch

from ..native.index import Piece
from ..native.tensor_file import RangeReader
from .format import DistCheckpoint, TensorInfo
from .names import MOMENT_PREFIXES, index_depth, megalite_name, megatron_keys
from .safe_pickle import namespace_dict

# megalite tensors that hold the (padded) vocabulary along dim 0: read as many rows as both have
VOCAB_TABLES = ("embedding.word_embeddings.weight", "output_layer.weight")
# Megatron-LM args that are GPTConfig fields of another name
_ARG_ALIASES = {"layernorm_epsilon": "norm_epsilon"}


def _holds(info: TensorInfo, index: tuple) -> bool:
    """Whether some saved chunk of the tensor lies at leading index `index`."""
    return any(all(o <= i < o + n for i, o, n in zip(index, c.offsets, c.sizes)) for c in info.chunks)


def plain_args(args) -> dict:
    """Megatron-LM's args as JSON-safe scalars (what the argument checks read)."""
    out = {}
    for k, v in namespace_dict(args).items():
        k = _ARG_ALIASES.get(k, k)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    if out.get("group_query_attention") is False and "num_attention_heads" in out:
        out["num_query_groups"] = out["num_attention_heads"]  # Megatron-LM's default of 1 applies to GQA only
    return out


def _find_step(tree):
    """The optimizer's shared step: megatron-core saves `common_step` (torch Adam) or a
    param group's `step` (fused Adam); None if neither."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("common_step", "step") and isinstance(v, (int, float, torch.Tensor)):
                    return int(v)
                stack.append(v)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return None


class MegatronIndex:
    """Index interface over a torch_dist checkpoint directory (iter_NNNNNNN)."""
    foreign = "Megatron-LM torch_dist"

    def __init__(self, directory: str, io: RangeReader | None = None):
        self.directory = directory
        self.dist = DistCheckpoint(directory, io)
        self.io = self.dist.io
        self.common = self.dist.common()
        self.args = plain_args(self.common.get("args"))
        self.optimizer_step = _find_step(self.common.get("optimizer"))
        moments = tuple(v for k, v in MOMENT_PREFIXES.items() if k != "master")
        self.has_moments = any(k.startswith(moments) for k in self.dist.tensors)
        self.metadata = megatron_metadata(self)

    def prefetch(self, keys) -> None:
        pass

    def _resolve(self, name: str):
        for key, index in megatron_keys(name):
            info = self.dist.tensors.get(key)
            if info is not None and _holds(info, index):
                return key, index
        return None

    def entry(self, name: str):
        found = self._resolve(name)
        if found is None:
            return None
        key, index = found
        shape = self.dist.tensors[key].shape[len(index):]
        layout = {"full_shape": list(shape), "dim": 0, "stride": 1, "tp_size": 1,
                  "rows": shape[0] if name in VOCAB_TABLES else None}
        numel = prod(shape)
        # the weight (found above), and Adam's moments and masters where they were saved
        tensors = self.dist.tensors
        saved = [("param", key)] + [(kind, prefix + key) for kind, prefix in MOMENT_PREFIXES.items()
                                    if prefix + key in tensors and _holds(tensors[prefix + key], index)]
        return layout, [Piece(kind, 0, 0, numel, 0, (k, index), None, False) for kind, k in saved]

    def read(self, piece: Piece, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the parameter's slice of its stacked global tensor (fp32)."""
        key, index = piece.where
        shape = self.dist.tensors[key].shape
        base = sum(i * prod(shape[d + 1:]) for d, i in enumerate(index))
        return self.dist.read_flat(key, base + a, base + b).float()

    def names(self) -> list[str]:
        """megalite's names of every parameter the checkpoint holds."""
        out = set()
        for key, info in self.dist.tensors.items():
            depth = index_depth(key)
            for c in info.chunks:
                for index in itertools.product(*(range(o, o + n) for o, n in zip(c.offsets[:depth], c.sizes[:depth]))):
                    name = megalite_name(key, index)
                    if name is not None:
                        out.add(name)
        return sorted(out)

    def rank_state(self, rank: int):
        """(RNG values, RNG tensors) of `rank` where megalite's torch_dist saver wrote them, else None."""
        world = self.metadata["layout"]["world_size"]
        key = f"megalite_rng/shard_{rank}_{world}"
        if key not in self.dist.objects:
            return None
        saved = self.dist.read_object(key)
        return saved["values"], saved["tensors"]


def megatron_metadata(index: MegatronIndex) -> dict:
    """megalite's checkpoint metadata for a Megatron-LM checkpoint: what checkpoint/load.py and the argument
    checks read (iteration, consumed samples, layout, schedule, the model's settings as args)."""
    args, common = index.args, index.common
    tp, pp = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
    dp, cp = args.get("data_parallel_size") or 1, args.get("context_parallel_size") or 1
    sched = common.get("opt_param_scheduler") or {}
    from ...model import GPTConfig
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model_config = {k: v for k, v in args.items() if k in fields and v is not None}
    if args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size"):
        # Megatron-LM's --vocab-size V is NullTokenizer's argument: ids 0..V-1 and the eod id V,
        # V + 1 tokens in the model (as megalite counts them: data/tokenizers.py model_vocab_size)
        model_config["vocab_size"] = args["vocab_size"] + 1
    derived = []
    if "vocab_size" not in model_config and args.get("padded_vocab_size"):
        # Megatron-LM records the tokenizer's vocabulary only as padded_vocab_size: the tools build
        # that many rows; a training run's check leaves the vocabulary to the tokenizer (rows are
        # read as far as both tables go)
        model_config["vocab_size"], derived = args["padded_vocab_size"], ["vocab_size"]
    return {"megatron": index.foreign,
            "iteration": int(common.get("iteration", args.get("iteration", 0)) or 0),
            "consumed_samples": int(args.get("consumed_train_samples") or 0),
            "args": args, "model_config": model_config,
            "layout": {"world_size": args.get("world_size") or tp * pp * dp * cp, "tp": tp, "pp": pp, "cp": cp,
                       "vpp": args.get("virtual_pipeline_model_parallel_size") or 1, "dp": dp,
                       "distributed_optimizer": bool(args.get("use_distributed_optimizer"))},
            "scheduler": {"num_steps": int(sched["num_steps"]), "unit": "samples"} if "num_steps" in sched else None,
            "grad_scaler": (common.get("megalite") or {}).get("grad_scaler"),
            "spike_guard": (common.get("megalite") or {}).get("spike_guard"),
            "optimizer": {"type": args.get("optimizer", "adam"), "fp32_params": True},
            "has_optimizer_state": index.has_moments, "dir": index.directory, "derived": derived}

