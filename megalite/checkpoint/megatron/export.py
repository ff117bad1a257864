"""Writing megalite weights as a Megatron-LM torch_dist checkpoint that megatron-core's
`dist_checkpointing.load` reads into its own GPTModel (tools/checkpoint/convert.py --saver megatron).

Each parameter becomes one chunk of its stacked global tensor (names.py): layer i of
`decoder.layers.self_attention.linear_qkv.weight` is the chunk at offsets (i, 0, 0) of the
[layers, qkv rows, h] tensor, expert e of layer i the chunk at (i, e, 0, 0) of
`decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, 2f, h]. Every linear
layer also gets the `_extra_state` object megatron-core's modules save and expect back (empty:
no FP8 scaling state). The vocabulary is padded as Megatron-LM pads it for the target TP size
(rows of zeros). common.pt holds `args` (the model's settings under Megatron-LM's argument names,
for its --use-checkpoint-args), the iteration and checkpoint_version 3.0.
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch

from ...errors import CheckpointError
from ..paths import TRACKER, iteration_dir
from .format import write_metadata, write_rank_file
from .index import VOCAB_TABLES
from .names import index_depth, megatron_keys

# the linear layers whose megatron-core modules save an `_extra_state` object
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
           "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


def megatron_items(state: dict, num_layers: int, num_experts: int, padded_vocab: int | None = None):
    """(tensors [(key, global shape, offsets, chunk)], objects {unique key: value}) of whole
    megalite tensors `state` {name: tensor}."""
    tensors, objects = [], {}
    for name, t in state.items():
        if name.startswith("mtp."):
            raise CheckpointError(f"{name}: multi-token prediction modules are not written to Megatron-LM checkpoints")
        key, index = megatron_keys(name)[0]
        lead = (num_layers, num_experts)[:index_depth(key)]
        if name in VOCAB_TABLES and padded_vocab and padded_vocab > t.shape[0]:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        tensors.append((key, lead + tuple(t.shape), index + (0,) * t.dim(), t.reshape((1,) * len(index) + t.shape)))
        module = key.rsplit(".", 2)
        if key.endswith(".weight") and len(module) == 3 and module[1] in LINEARS:
            obj = f"{key[:-len('weight')]}_extra_state"
            # ShardedObject.unique_key: offsets and shape joined by '.' (megatron-core's mapping.py)
            objects[f"{obj}/shard_{'.'.join(map(str, index or (0,)))}_{'.'.join(map(str, lead or (1,)))}"] = [None]
    return tensors, objects


def megatron_args(model_config: dict, run_config: dict | None, extra: dict) -> argparse.Namespace:
    """Megatron-LM's `args`: megalite's flags keep Megatron-LM's names, so the run's config
    sections flattened, the model's settings over them, and Megatron-LM's own spellings."""
    fields = {}
    for section in (run_config or {}).values():
        if isinstance(section, dict):
            fields.update(section)
    fields.update(model_config)
    tokenizer = (run_config or {}).get("tokenizer") or {}
    if tokenizer.get("tokenizer_type") == "NullTokenizer" and tokenizer.get("vocab_size"):
        fields["vocab_size"] = tokenizer["vocab_size"]  # Megatron-LM's args.vocab_size: NullTokenizer's V, not V + 1
    fields["layernorm_epsilon"] = model_config.get("norm_epsilon")
    fields.update(extra)
    return argparse.Namespace(**fields)


def write_megatron_checkpoint(root: str, state: dict, model_config: dict, run_config: dict | None = None,
                              iteration: int = 0, padded_vocab: int | None = None, common: dict | None = None) -> str:
    """Write whole-model weights `state` {megalite name: tensor} as a torch_dist checkpoint
    root/iter_NNNNNNN (one writer) and point root's latest_checkpointed_iteration.txt at it.
    Returns the iteration directory."""
    cfg = model_config
    tensors, objects = megatron_items(state, cfg["num_layers"], cfg.get("num_experts") or 0, padded_vocab)
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    records = write_rank_file(tmp, 0, tensors, objects)
    args = megatron_args(cfg, run_config, {"padded_vocab_size": padded_vocab or cfg.get("padded_vocab_size"),
                                           "iteration": iteration, "ckpt_format": "torch_dist"})
    write_metadata(tmp, records, {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                                  "num_floating_point_operations_so_far": 0, **(common or {})})
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return final
