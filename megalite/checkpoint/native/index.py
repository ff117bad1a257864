"""A checkpoint's global index: where every saved piece of every tensor lies, in one file that a
rank reads only the parts of it needs.

    iter_N/index.jsonl     line 1: header {"format", "version", "metadata", "optimizer_step",
                                   "files": [data file names], "sections": {key: [offset, length]}}
                           then one JSON line per section; offsets count from the end of line 1.
    section "param/NAME":  {"layout": {"full_shape", "dim", "stride", "tp_size", "rows"},
                            "pieces": [[kind, tp_rank, lo, hi, file, byte_offset, dtype, tied], ...]}
                           a piece is the flat range [lo, hi) of TP rank tp_rank's local shard of
                           the tensor `kind` (param, master, exp_avg, exp_avg_sq, momentum_buffer),
                           stored at byte_offset of files[file]; `tied`: saved by the last stage
                           for its copy of the tied embedding (same values as the first stage's).
    section "rank/R":      {"file", "rng": JSON-safe RNG values, "tensors": {key: [byte_offset, dtype, shape]}}

Rank 0 writes it at save time from every rank's entries (gathered), so a load opens this file
and the data files it needs: O(1) files of metadata per rank instead of one per saving rank,
and the header plus its own sections in bytes. Nothing in it is pickled.

Format 1 (before the global index: rank_NNNNN.json + rank_NNNNN.pt, torch.save) still loads
through `LegacyIndex`, the slow way: every rank reads every index file.
"""
from __future__ import annotations

import glob
import json
import os

import torch

from ...errors import CheckpointError
from .tensor_file import RangeReader, element_size

INDEX = "index.jsonl"
FORMAT = "megalite-checkpoint-index"


class Piece:
    __slots__ = ("kind", "tp_rank", "lo", "hi", "file", "where", "dtype", "tied")

    def __init__(self, kind, tp_rank, lo, hi, file, where, dtype, tied):
        self.kind, self.tp_rank, self.lo, self.hi = kind, int(tp_rank), int(lo), int(hi)
        self.file, self.where, self.dtype, self.tied = int(file), where, dtype, bool(tied)


def section_layout(layout: dict) -> dict:
    """A saved entry's shard layout (state.shard_layout) as the section records it."""
    shape = list(layout["local_shape"])
    if layout["tp"]:
        shape[layout["dim"]] *= layout["tp_size"]
    return {"full_shape": shape, "dim": layout["dim"] if layout["tp"] else 0,
            "stride": layout["stride"] if layout["tp"] else 1, "tp_size": layout["tp_size"] if layout["tp"] else 1,
            "rows": layout["rows"]}


def build_index(metadata: dict, optimizer_step, ranks: list[dict]) -> bytes:
    """The index file's bytes from every rank's record {"rank", "file", "entries", "rng", "tensors"}
    (entries: {"kind", "name", "lo", "hi", "layout", "offset", "dtype", "tied"})."""
    files = [r["file"] for r in ranks]
    sections: dict[str, dict] = {}
    for fid, r in enumerate(ranks):
        for e in r["entries"]:
            lay = section_layout(e["layout"])
            sec = sections.setdefault(f"param/{e['name']}", {"layout": lay, "pieces": []})
            if sec["layout"] != lay:
                raise ValueError(f"{e['name']}: rank {r['rank']} saved it with layout {lay}, another rank with "
                                 f"{sec['layout']}")
            sec["pieces"].append([e["kind"], e["layout"]["tp_rank"], e["lo"], e["hi"], fid, e["offset"], e["dtype"],
                                  int(e["tied"])])
        sections[f"rank/{r['rank']}"] = {"file": fid, "rng": r["rng"], "tensors": r["tensors"]}
    body, offsets, pos = [], {}, 0
    for key, sec in sections.items():
        line = (json.dumps(sec, separators=(",", ":")) + "\n").encode()
        offsets[key] = [pos, len(line)]
        body.append(line)
        pos += len(line)
    header = {"format": FORMAT, "version": 2, "metadata": metadata, "optimizer_step": optimizer_step,
              "files": files, "sections": offsets}
    return (json.dumps(header, separators=(",", ":")) + "\n").encode() + b"".join(body)


class CheckpointIndex:
    """Format 2: the global index, read lazily (header, then the sections asked for)."""

    def __init__(self, directory: str, io: RangeReader | None = None):
        self.directory, self.io = directory, io or RangeReader()
        self.path = os.path.join(directory, INDEX)
        try:
            line = self.io.read_line(self.path)
            self.header = json.loads(line)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read the checkpoint index ({type(e).__name__}: {e})") from None
        if not isinstance(self.header, dict) or self.header.get("format") != FORMAT:
            raise CheckpointError(f"{self.path} is not a megalite checkpoint index")
        self.base = len(line)
        self.metadata = self.header["metadata"]
        self.files = [os.path.join(directory, f) for f in self.header["files"]]
        self._sections: dict[str, dict] = {}

    def prefetch(self, keys) -> None:
        """Read the sections `keys` (those present and not read yet), neighbours in one read."""
        where = self.header["sections"]
        want = sorted((where[k][0], where[k][1], k) for k in set(keys) if k in where and k not in self._sections)
        i = 0
        while i < len(want):
            j, end = i, want[i][0] + want[i][1]
            while j + 1 < len(want) and want[j + 1][0] == end:
                j += 1
                end += want[j][1]
            data = self.io.read(self.path, self.base + want[i][0], end - want[i][0])
            for off, n, key in want[i:j + 1]:
                self._sections[key] = json.loads(data[off - want[i][0]:off - want[i][0] + n])
            i = j + 1

    def section(self, key: str) -> dict | None:
        if key not in self._sections:
            self.prefetch([key])
        return self._sections.get(key)

    def names(self) -> list[str]:
        return sorted(k[len("param/"):] for k in self.header["sections"] if k.startswith("param/"))

    def entry(self, name: str) -> tuple[dict, list[Piece]] | None:
        sec = self.section(f"param/{name}")
        return None if sec is None else (sec["layout"], [Piece(*p) for p in sec["pieces"]])

    def read(self, piece: Piece, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a piece (piece-relative), in the dtype it was saved in."""
        es = element_size(piece.dtype)
        return self._tensor(self.files[piece.file], piece.where + a * es, piece.dtype, b - a)

    def _tensor(self, path: str, offset: int, dtype: str, count: int) -> torch.Tensor:
        try:
            return self.io.tensor(path, offset, dtype, count)
        except (OSError, EOFError) as e:
            raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e}): the checkpoint is incomplete "
                                  "or corrupt") from None

    def rank_state(self, rank: int) -> tuple[dict, dict] | None:
        """(RNG values, {key: tensor}) that `rank` saved, or None."""
        sec = self.section(f"rank/{rank}")
        if sec is None:
            return None
        tensors = {}
        for key, (offset, dtype, shape) in sec["tensors"].items():
            n = 1
            for d in shape:
                n *= d
            tensors[key] = self._tensor(self.files[sec["file"]], offset, dtype, n).view(shape)
        return sec["rng"], tensors

    @property
    def optimizer_step(self):
        return self.header.get("optimizer_step")


class PickledFilesIndex:
    """The index interface over whole torch.save'd files, each memory-mapped when first read:
    `_entries` {name: (layout, [Piece])} built by the subclass, whose `_tensors(fid)` gives the
    {key: tensor} a Piece's `where` names in file `fid` (format 1 here, Megatron-LM's torch format)."""

    def prefetch(self, keys) -> None:
        pass  # a piece's file is opened when first read

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str):
        return self._entries.get(name)

    def read(self, piece: Piece, a: int, b: int) -> torch.Tensor:
        t = self._tensors(piece.file)[piece.where].reshape(-1)[a:b]
        self.io.bytes_read += t.numel() * t.element_size()  # the pages this slice touches, about
        return t


class LegacyIndex(PickledFilesIndex):
    """Format 1: rank_NNNNN.json indexes beside torch.save'd rank_NNNNN.pt files (loaded with
    weights_only=True, memory-mapped). Every index file is read: the slow way."""

    def __init__(self, directory: str, metadata: dict, io: RangeReader | None = None):
        self.directory, self.metadata, self.io = directory, metadata, io or RangeReader()
        paths = sorted(glob.glob(os.path.join(directory, "rank_*.json")))
        if not paths:
            raise CheckpointError(f"{directory} holds neither {INDEX} nor rank files: not a complete checkpoint")
        self.files, self._entries, self._ranks, self._loaded = [], {}, {}, {}
        steps = []
        for fid, path in enumerate(paths):
            text = self.io.read(path, 0, os.path.getsize(path))
            index = json.loads(text)
            self.files.append(path[:-len(".json")] + ".pt")
            for e in index["entries"]:
                lay = section_layout(e["layout"])
                sec = self._entries.setdefault(e["name"], (lay, []))
                sec[1].append(Piece(e["kind"], e["layout"]["tp_rank"], e["lo"], e["hi"], fid, e["key"], None, False))
            self._ranks[index["rank"]] = (fid, index.get("rng"))
            steps.append(index.get("optimizer_step"))
        self.optimizer_step = next((s for s in steps if s is not None), None)

    def _file(self, fid: int) -> dict:
        if fid not in self._loaded:
            path = self.files[fid]
            self.io.opened.add(path)
            self._loaded[fid] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._loaded[fid]

    def _tensors(self, fid: int) -> dict:
        return self._file(fid)

    def rank_state(self, rank: int):
        if rank not in self._ranks or self._ranks[rank][1] is None:
            return None
        fid, rng = self._ranks[rank]
        tensors = {k: v for k, v in self._file(fid).items() if k.startswith("rng/")}
        self.io.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        return rng, tensors


def open_index(directory: str, metadata: dict, io: RangeReader | None = None):
    """The index of a checkpoint directory, whichever format wrote it."""
    if int(metadata.get("format_version", 1)) >= 2:
        return CheckpointIndex(directory, io)
    return LegacyIndex(directory, metadata, io)
