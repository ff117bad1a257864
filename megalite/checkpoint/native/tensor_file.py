"""Tensor files in the safetensors layout, read by byte range.

    [8 bytes: header length N, little-endian] [N bytes: JSON header, space-padded to 8]
    [data: each tensor's bytes, C order, little-endian, back to back]

The header maps each key to {"dtype", "shape", "data_offsets": [begin, end)} (relative to the
data), so a reader that knows a tensor's absolute offset (checkpoint indexes record it) can
read any range of its elements with one pread, without parsing the header or unpickling
anything. The files are valid safetensors (the `safetensors` package opens them), but megalite
needs no package to write or read them.
"""
from __future__ import annotations

import json
import os
import struct

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
BY_NAME = {v: k for k, v in DTYPES.items()}


def element_size(dtype_name: str) -> int:
    return torch.empty((), dtype=BY_NAME[dtype_name]).element_size()


def plan(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, int]]:
    """(the file's first bytes: length + header, {key: absolute byte offset of its data})."""
    header, begin = {}, 0
    for key, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"{key}: dtype {t.dtype} has no safetensors name")
        end = begin + t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors pads it
    head = struct.pack("<Q", len(text)) + text
    return head, {key: len(head) + h["data_offsets"][0] for key, h in header.items()}


def write(path: str, tensors: dict[str, torch.Tensor], head: bytes | None = None) -> None:
    """Write `tensors` (on the CPU) in `plan`'s layout; fsync before returning."""
    if head is None:
        head, _ = plan(tensors)
    with open(path, "wb") as f:
        f.write(head)
        for t in tensors.values():
            f.write(memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())


def read_header(path: str) -> tuple[dict, int]:
    """(header, bytes read) of a file in this layout."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class RangeReader:
    """Opens files on first use and reads byte ranges, counting what it opened and read."""

    def __init__(self):
        self.files: dict[str, int] = {}  # path -> descriptor, while open
        self.opened: set[str] = set()  # every path ever opened (kept after close, for the counts)
        self.bytes_read = 0

    def _fd(self, path: str) -> int:
        if path not in self.files:
            self.files[path] = os.open(path, os.O_RDONLY)
            self.opened.add(path)
        return self.files[path]

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._fd(path), nbytes, offset)
        if len(data) != nbytes:
            raise EOFError(f"{path}: wanted {nbytes} bytes at offset {offset}, the file ends after {len(data)}")
        self.bytes_read += nbytes
        return data

    def read_line(self, path: str) -> bytes:
        """The first line of a file (an index header), however long."""
        fd, chunks, offset = self._fd(path), [], 0
        while True:
            chunk = os.pread(fd, 1 << 16, offset)
            if not chunk:
                break
            cut = chunk.find(b"\n")
            if cut >= 0:
                chunks.append(chunk[:cut + 1])
                break
            chunks.append(chunk)
            offset += len(chunk)
        line = b"".join(chunks)
        self.bytes_read += len(line)
        return line

    def tensor(self, path: str, offset: int, dtype_name: str, count: int) -> torch.Tensor:
        """`count` elements of `dtype_name` at byte `offset` (a new CPU tensor)."""
        dtype = BY_NAME[dtype_name]
        if count == 0:
            return torch.empty(0, dtype=dtype)
        data = bytearray(self.read(path, offset, count * element_size(dtype_name)))
        return torch.frombuffer(data, dtype=dtype)

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()
