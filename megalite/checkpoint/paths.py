"""A checkpoint's names on disk, which megalite's format shares with Megatron-LM's: the latest
pointer, the iteration directories, the rank files. The ground of checkpoint/: imports no torch
and nothing of the formats, so every family (and the argument checks) reads it."""
from __future__ import annotations

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
