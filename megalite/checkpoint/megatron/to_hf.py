"""A Megatron-LM checkpoint to a Hugging Face model directory, streamed tensor by tensor
(`tools/checkpoint/convert.py --loader megatron --saver hf`).

The whole model never sits in memory: the tensors outside the layers are read, renamed and
written one at a time, then each layer's tensors (one slice of each stacked global tensor,
index.py reading only the chunks that hold it) are read, mapped by the same per-layer
functions megalite's own export uses (hf/conversion.py: QKV split by query group, SwiGLU's
[gate; up] split, GPT-2's Conv1D transposes; hf/moe.py for the experts), written to the sharded
safetensors files (hf/shards.py) and freed before the next layer. Peak memory is about one layer
or the largest single tensor (the word embedding, typically), whichever is larger, plus the
interpreter (benchmarks/RESULTS_megatron_convert.md).

The model's settings come from the checkpoint's own `args` (Megatron-LM's argument names, which
megalite's flags keep); the architecture is chosen and refused exactly as for a megalite
checkpoint (hf/config.py). The vocabulary keeps Megatron-LM's padded rows (args.padded_vocab_size):
the padding rows are part of the saved model. The tokenizer is written when the checkpoint's args
name one megalite builds (or the command line gives one); otherwise a notice says none was written.
"""
from __future__ import annotations

import dataclasses
import io

import torch

from ...data.saved_tokenizer import build_tokenizer_for
from ...errors import CheckpointError
from ..hf.config import ConversionError
from ..hf.conversion import (WORD_EMBEDDING, export_architecture, gpt2_layer_tensors, gpt2_outer_tensors,
                            llama_layer_tensors, llama_outer_tensors, staged_directory, write_hf_files)
from ..hf.shards import ShardedSafetensorsWriter
from ..hf.tokenizer import exportable
from ..native.region import read_region
from ..native.reshard import ShardLayout
from ..paths import TRACKER, iteration_dir, read_tracker
from .index import MegatronIndex
from .legacy import open_megatron


class Deferred:
    """A tensor not read yet: the mappings outside the layers only rename, so each is read when
    written and freed after."""

    def __init__(self, read):
        self.read = read


def model_config(meta: dict, index) -> dict:
    """megalite's model_config of a Megatron-LM checkpoint: its args' model settings (derived
    defaults filled as megalite's GPTConfig fills them), the vocabulary as the saved rows."""
    from ...model import GPTConfig
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    cfg = GPTConfig.from_dict({k: v for k, v in meta["args"].items() if k in names}).to_dict()
    layout, _ = index.entry(WORD_EMBEDDING)
    rows = layout["full_shape"][0]
    cfg.update(vocab_size=rows, padded_vocab_size=rows)
    if not cfg.get("max_position_embeddings"):
        cfg["max_position_embeddings"] = cfg["seq_length"]
    return cfg


def own_chunk(index, name: str):
    """torch_dist: the saved chunk that is exactly this parameter (megatron-core saves each layer's
    slice of a TP1 tensor as a chunk of its own), loaded without the reader's chunk cache and its
    copy out of it, so a tensor is in memory once; None when it is split over chunks."""
    if not isinstance(index, MegatronIndex):
        return None
    layout, pieces = index.entry(name)
    key, lead = pieces[0].where
    info = index.dist.info(key)
    box = (tuple(lead) + (0,) * (len(info.shape) - len(lead)), (1,) * len(lead) + tuple(info.shape[len(lead):]))
    for c in info.chunks:
        if (tuple(c.offsets), tuple(c.sizes)) == box:
            data = index.io.read(c.path, c.where, c.length)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True).view(layout["full_shape"])
    return None


def read_param(index, name: str, plus_one: bool) -> torch.Tensor:
    """One megalite parameter, whole, through the load index's interface (a torch_dist checkpoint:
    its slice of the stacked global tensor, from the chunks that hold it; a torch one: its TP
    shards from the memory-mapped files, joined as every load joins them)."""
    t = own_chunk(index, name)
    if t is None:
        layout, _ = index.entry(name)
        shape = list(layout["full_shape"])
        if layout["rows"] is not None:
            shape[0] = layout["rows"]
        whole = ShardLayout(tuple(shape))
        t = read_region(index, name, "param", whole, 0, 0, whole.local_numel).view(shape)
    if plus_one and name.endswith("layernorm.weight"):  # --apply-layernorm-1p stores w - 1; HF stores w
        t = t + 1
    return t


def layer_names(names: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    """(names outside the layers, {layer: its names})."""
    outer, layers = [], {}
    for name in names:
        if name.startswith("decoder.layers."):
            layers.setdefault(int(name.split(".")[2]), []).append(name)
        else:
            outer.append(name)
    return outer, layers


def _write(writer: ShardedSafetensorsWriter, tensors: dict) -> None:
    for name in list(tensors):
        t = tensors.pop(name)
        t = t.read() if isinstance(t, Deferred) else t
        writer.add(name, t.to(torch.float32) if t.is_floating_point() else t)
        del t


def _placed_all(state: dict, arch: str, where: str) -> None:
    if state:
        raise ConversionError(f"{where} has tensors the {arch} mapping does not place: {', '.join(sorted(state)[:5])}")


def _open_latest(load_dir: str):
    """The load index of the latest checkpoint under `load_dir`, which must be Megatron-LM's (torch_dist or torch)."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        raise CheckpointError(f"--load-dir {load_dir}: no checkpoint there ({TRACKER} is missing)")
    try:
        index = open_megatron(iteration_dir(load_dir, iteration))
    except CheckpointError as e:
        raise CheckpointError(f"--load-dir {load_dir}: {e}") from None
    if index is None:
        raise ConversionError(f"--load-dir {load_dir}: a megalite checkpoint, not Megatron-LM's: use --loader megalite")
    return index


def megatron_to_hf(load_dir: str, out_dir: str, tokenizer_overrides: dict | None = None, tokenizer: bool = True,
                   max_shard_bytes: int = 5 * 10**9) -> tuple[str, object, list[str]]:
    """Convert; returns (architecture, tokenizer or None, the safetensors files written). A missing
    or corrupt file, or a megalite checkpoint, is a one-line error naming --load-dir."""
    index = _open_latest(load_dir)
    meta = dict(index.metadata, dir=index.directory)
    cfg = model_config(meta, index)
    meta = dict(meta, model_config=cfg)
    tok = None
    if tokenizer:
        tok = exportable(build_tokenizer_for(meta, tokenizer_overrides), load_dir)
    arch = export_architecture(cfg, tok)  # refuses before anything is written
    if arch not in ("gpt2", "llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"):
        raise ConversionError(f"--loader megatron: the {arch} architecture is not streamed; convert with "
                              "--saver megalite first, then --loader megalite --saver hf")
    outer_fn, layer_fn = ((gpt2_outer_tensors, gpt2_layer_tensors) if arch == "gpt2"
                          else (llama_outer_tensors, lambda c, s, i: llama_layer_tensors(c, s, i, arch)))
    plus_one = bool(cfg.get("apply_layernorm_1p"))
    outer, layers = layer_names(index.names())
    if sorted(layers) != list(range(cfg["num_layers"])):
        raise ConversionError(f"{meta['dir']}: holds layers {sorted(layers)[:8]}..., args.num_layers is {cfg['num_layers']}")
    with staged_directory(out_dir) as tmp:
        write_hf_files(cfg, arch, tmp, tok)
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        state = {n: Deferred(lambda n=n: read_param(index, n, plus_one)) for n in outer}
        _write(writer, outer_fn(cfg, state))
        _placed_all(state, arch, meta["dir"])
        for i in range(cfg["num_layers"]):
            state = {n: read_param(index, n, plus_one) for n in layers[i]}
            _write(writer, layer_fn(cfg, state, i))
            _placed_all(state, arch, f"{meta['dir']} layer {i}")
        files = writer.close()
    index.io.close()
    return arch, tok, files
