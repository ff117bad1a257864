"""A checkpoint's names on disk, which megalite's format shares with Megatron-LM's: the latest
pointer, the iteration directories, the rank files. The ground of checkpoint/: imports no torch
and nothing of the formats, so every family (and the argument checks) reads it."""
from __future__ import annotations

import json
import os

from ..errors import CheckpointError

FORMAT_VERSION = 2  # 2: global index, safetensors-layout data files; 1: per-rank index + torch.save
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def data_file(rank: int) -> str:
    """The name of rank `rank`'s tensor file in an iteration directory."""
    return f"rank_{rank:05d}.safetensors"


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


# -- Megatron-LM's --save-retain-interval and --verify-integrity ------------------------------------
INTEGRITY = "integrity.json"  # megatron-core's manifest: {"algorithm": "sha256", "files": {name: digest}}


def retire_previous(root: str, previous: int | None, iteration: int, interval: int | None) -> int | None:
    """--save-retain-interval, as Megatron-LM's iter_finalize_fn: once iteration `iteration` is
    published, the checkpoint the latest pointer named before (`previous`) is deleted unless it is
    a multiple of `interval` (or a symbolic link, or this one); returns the deleted iteration."""
    if not interval or not previous or previous == iteration or previous % interval == 0:
        return None
    directory = iteration_dir(root, previous)
    if os.path.islink(directory) or not os.path.isdir(directory):
        return None
    import shutil
    shutil.rmtree(directory, ignore_errors=True)
    return previous


def sha256(path: str) -> str:
    """A file's SHA-256 hex digest, read 4 MiB at a time."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_integrity(directory: str) -> None:
    """Hash every file of a finished checkpoint directory into integrity.json (megatron-core's
    save_integrity_manifest)."""
    files = {e.name: sha256(e.path) for e in sorted(os.scandir(directory), key=lambda e: e.name)
             if e.is_file() and e.name != INTEGRITY}
    with open(os.path.join(directory, INTEGRITY), "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=2)
