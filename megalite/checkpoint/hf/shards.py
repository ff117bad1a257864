"""Hugging Face's sharded safetensors layout, written one tensor at a time.

    model-00001-of-00003.safetensors ...   each: [8-byte header length][JSON header][tensor bytes]
    model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    (one shard only: model.safetensors and no index, as transformers' save_pretrained writes it)

A safetensors header lists every tensor of its file before the data, so a writer that holds only
one tensor at a time cannot write the header first: each shard's tensor bytes go to a body file
as they arrive (the tensor is freed at once), and closing the shard writes the header and copies
the body after it in fixed-size blocks. Memory stays at one tensor plus one block whatever the
model's size; the disk sees each byte twice.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..native.tensor_file import DTYPES

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
COPY_BLOCK = 16 << 20


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes (transformers' max_shard_size spelling)."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = str(text).strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"not a size: {text!r} (for example 5GB, 500MB or a number of bytes)")


class ShardedSafetensorsWriter:
    """add(name, tensor) in any order; close() names the shards and writes the index. A shard
    closes before the tensor that would take it past `max_shard_bytes` (a tensor larger than
    that gets a shard of its own)."""

    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.shards: list[tuple[str, list[str]]] = []  # (closed shard's temporary file, its tensor names)
        self.total = 0
        self._body, self._header, self._size = None, {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        if self._body is not None and self._size and self._size + nbytes > self.max_shard_bytes:
            self._close_shard()
        if self._body is None:
            self._body = open(os.path.join(self.out_dir, f".shard-{len(self.shards)}.body"), "wb")
            self._header, self._size = {}, 0
        self._header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._size, self._size + nbytes]}
        if nbytes:  # the tensor's own bytes, no copy (any dtype seen as bytes)
            self._body.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._size += nbytes
        self.total += nbytes

    def _close_shard(self) -> None:
        body_path = self._body.name
        self._body.close()
        header = dict(self._header, __metadata__={"format": "pt"})
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # data 8-byte aligned, as safetensors pads it
        path = body_path[:-len(".body")] + ".safetensors"
        with open(path, "wb") as out, open(body_path, "rb") as body:
            out.write(len(text).to_bytes(8, "little") + text)
            shutil.copyfileobj(body, out, COPY_BLOCK)
        os.remove(body_path)
        self.shards.append((path, list(self._header)))
        self._body = None

    def close(self) -> list[str]:
        """Finish: the shard files' final names (and the index with more than one)."""
        if self._body is not None:
            self._close_shard()
        n = len(self.shards)
        if n == 1:
            os.replace(self.shards[0][0], os.path.join(self.out_dir, SINGLE))
            return [SINGLE]
        names, weight_map = [], {}
        for i, (path, tensors) in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.out_dir, name))
            names.append(name)
            weight_map.update({t: name for t in tensors})
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return names
