"""Megatron-LM's `torch_dist` checkpoint files (torch.distributed.checkpoint, DCP), read and written
without megatron-core.

    iter_NNNNNNN/.metadata       pickled torch.distributed.checkpoint.metadata.Metadata:
                                 state_dict_metadata {key: TensorStorageMetadata(properties.dtype,
                                 size = the global shape, chunks = [ChunkStorageMetadata(offsets,
                                 sizes)]) or BytesStorageMetadata}; storage_data {MetadataIndex(key,
                                 chunk offsets): _StorageInfo(relative_path, offset, length)}
    iter_NNNNNNN/__R_N.distcp    the saving ranks' data: each chunk is one torch.save'd tensor
                                 (each object one torch.save'd value) at the byte range above
    iter_NNNNNNN/common.pt       torch.save of what is not sharded: args, iteration, the LR
                                 scheduler, optimizer param_groups, ...
    iter_NNNNNNN/metadata.json   {"sharded_backend": "torch_dist", ...}

Keys are megatron-core's *sharded* keys: layers stacked along a leading axis (for example
`decoder.layers.self_attention.linear_qkv.weight` [layers, qkv rows, h]; experts
`decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, 2f, h]), whatever
TP/PP/EP/DP saved them: each rank's pieces are chunks at their global offsets. A reader therefore
asks for a region of a global tensor and loads only the chunks that overlap it (byte ranges from
storage_data; each chunk torch.load(weights_only=True) from its bytes). The pickles (.metadata,
common.pt, objects) go through safe_pickle's allow-list.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass
from math import prod

import torch

from ...errors import CheckpointError
from .safe_pickle import load_pickle, torch_load
from ..native.tensor_file import RangeReader

METADATA = ".metadata"
COMMON = "common.pt"
BACKEND = "metadata.json"
CACHED_CHUNKS = 16  # loaded chunks kept while one key is read (a region's runs revisit the same chunks)
BACKEND_RECORD = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a global tensor: its box (offsets, sizes) and where its bytes lie."""
    offsets: tuple
    sizes: tuple
    path: str
    where: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple
    dtype: torch.dtype
    chunks: tuple


def flat_boxes(shape: tuple, a: int, b: int) -> list[tuple]:
    """The flat range [a, b) of a row-major tensor of `shape` as boxes ((start, stop) per
    dimension), in order: at most two partial boxes per dimension and one of whole rows."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a, b),)] if shape else [()]
    inner = prod(shape[1:])
    (r0, o0), (r1, o1) = divmod(a, inner), divmod(b, inner)
    if r0 == r1:
        return [((r0, r0 + 1),) + box for box in flat_boxes(shape[1:], o0, o1)]
    out = []
    if o0:
        out += [((r0, r0 + 1),) + box for box in flat_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1),) + tuple((0, n) for n in shape[1:]))
    if o1:
        out += [((r1, r1 + 1),) + box for box in flat_boxes(shape[1:], 0, o1)]
    return out


def is_dist_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA))


class DistCheckpoint:
    """A torch_dist checkpoint directory: its keys, and reads of global regions by chunk."""

    def __init__(self, directory: str, io_: RangeReader | None = None):
        self.directory, self.io = directory, io_ or RangeReader()
        path = os.path.join(directory, METADATA)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {directory} is not a complete torch_dist checkpoint")
        meta = load_pickle(path)
        self.io.opened.add(path)
        self.io.bytes_read += os.path.getsize(path)
        try:
            self.tensors, self.objects = _index(directory, meta)
        except (AttributeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: not a torch.distributed.checkpoint metadata file ({e})") from None
        self._cache_key, self._cache = None, {}

    def keys(self) -> dict[str, tuple[tuple, torch.dtype]]:
        """{global key: (shape, dtype)} of every tensor."""
        return {k: (t.shape, t.dtype) for k, t in self.tensors.items()}

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            raise CheckpointError(f"{self.directory}: no tensor {key!r} in the checkpoint")
        return self.tensors[key]

    def _load_chunk(self, key: str, c: Chunk) -> torch.Tensor:
        if self._cache_key != key:  # chunks of one key are reused across its regions; one key cached
            self._cache_key, self._cache = key, {}
        if (c.path, c.where) not in self._cache:
            if len(self._cache) >= CACHED_CHUNKS:  # bounded: a layer's chunks, not a whole stacked key
                self._cache.pop(next(iter(self._cache)))
            data = self.io.read(c.path, c.where, c.length)
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(c.sizes):
                raise CheckpointError(f"{c.path}: the chunk of {key} at byte {c.where} is not a tensor of shape "
                                      f"{tuple(c.sizes)}: the checkpoint is corrupt")
            self._cache[(c.path, c.where)] = t
        return self._cache[(c.path, c.where)]

    def read(self, key: str, box: tuple | None = None) -> torch.Tensor:
        """The region box = ((start, stop) per dimension; None: all) of global tensor `key`, in its
        saved dtype, from the chunks that overlap it."""
        t = self.info(key)
        box = tuple(box) if box is not None else tuple((0, n) for n in t.shape)
        out = torch.empty([b - a for a, b in box], dtype=t.dtype)
        filled = 0
        for c in t.chunks:
            lo = [max(a, o) for (a, _), o in zip(box, c.offsets)]
            hi = [min(b, o + n) for (_, b), o, n in zip(box, c.offsets, c.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            src = self._load_chunk(key, c)[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, c.offsets))]
            out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))] = src
            filled += src.numel()
        if filled < out.numel():
            raise CheckpointError(f"{self.directory}: the chunks of {key} do not cover {box} (incomplete checkpoint)")
        return out

    def read_flat(self, key: str, a: int, b: int) -> torch.Tensor:
        """Flat elements [a, b) of global tensor `key` (row-major), from the overlapping chunks."""
        boxes = flat_boxes(self.info(key).shape, a, b)
        return torch.cat([self.read(key, box).reshape(-1) for box in boxes]) if boxes else \
            torch.empty(0, dtype=self.info(key).dtype)

    def read_object(self, key: str):
        """A saved object (ShardedObject: its unique key), through the allow-list unpickler."""
        if key not in self.objects:
            raise CheckpointError(f"{self.directory}: no object {key!r} in the checkpoint")
        path, where, length = self.objects[key]
        return torch_load(self.io.read(path, where, length), f"{path} ({key})")

    def common(self) -> dict:
        """common.pt (args, iteration, scheduler, ...), through the allow-list unpickler; {} if absent."""
        path = os.path.join(self.directory, COMMON)
        if not os.path.isfile(path):
            return {}
        self.io.opened.add(path)
        self.io.bytes_read += os.path.getsize(path)
        out = torch_load(path)
        return out if isinstance(out, dict) else {}


def _index(directory: str, meta) -> tuple[dict, dict]:
    """({key: TensorInfo}, {object key: (path, offset, length)}) from a Metadata object."""
    where = {}
    for idx, info in meta.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{directory}: {idx.fqn} is stored with transforms {info.transform_descriptors} "
                                  "(compressed DCP), which megalite does not read")
        offsets = tuple(idx.offset) if idx.offset is not None else None
        where[(idx.fqn, offsets)] = (os.path.join(directory, info.relative_path), int(info.offset), int(info.length))
    tensors, objects = {}, {}
    for key, md in meta.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            objects[key] = where[(key, None)]
            continue
        chunks = []
        for ch in md.chunks:
            path, off, n = where[(key, tuple(ch.offsets))]
            chunks.append(Chunk(tuple(ch.offsets), tuple(ch.sizes), path, off, n))
        tensors[key] = TensorInfo(tuple(md.size), md.properties.dtype, tuple(chunks))
    return tensors, objects


# -- writing --------------------------------------------------------------------------------------
def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def write_rank_file(directory: str, rank: int, tensors: list, objects: dict | None = None) -> list:
    """Write one rank's chunks: tensors [(key, global shape, offsets, tensor)], objects {unique key:
    value}. Returns its records for `write_metadata` (plain tuples, to gather across ranks)."""
    name = data_file(rank)
    records, pos = [], 0
    with open(os.path.join(directory, name), "wb") as f:
        for key, shape, offsets, t in tensors:
            buf = io.BytesIO()
            torch.save(t.detach().cpu().contiguous().clone(), buf)
            f.write(buf.getbuffer())
            records.append(("tensor", key, tuple(shape), str(t.dtype).split(".")[-1], tuple(offsets),
                            tuple(t.shape), name, pos, buf.tell()))
            pos += buf.tell()
        for key, value in (objects or {}).items():
            buf = io.BytesIO()
            torch.save(value, buf)
            f.write(buf.getbuffer())
            records.append(("bytes", key, None, None, None, None, name, pos, buf.tell()))
            pos += buf.tell()
    return records


def write_metadata(directory: str, records: list, common: dict) -> None:
    """`.metadata` from every rank's records, common.pt and metadata.json."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    state, storage = {}, {}
    for kind, key, shape, dtype, offsets, sizes, name, pos, length in records:
        if kind == "bytes":
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(name, pos, length)
            continue
        md = state.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=getattr(torch, dtype)),
                                                         torch.Size(shape), []))
        if tuple(md.size) != tuple(shape):
            raise ValueError(f"{key}: saved with global shapes {tuple(md.size)} and {tuple(shape)}")
        md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(name, pos, length)
    with open(os.path.join(directory, METADATA), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)
    torch.save(common, os.path.join(directory, COMMON))
    with open(os.path.join(directory, BACKEND), "w") as f:
        json.dump(BACKEND_RECORD, f)
