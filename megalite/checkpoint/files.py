"""A checkpoint's files read up front, so that a missing or corrupt one is a one-line error
naming the file before any model is built or process group started (pretrain_gpt.py --load,
tools/generate.py, tools/checkpoint/convert.py). Reads the JSON files only, never the tensors."""
from __future__ import annotations

import glob
import json
import os

# = megalite.checkpoint.checkpointing.TRACKER (Megatron-LM's name), here so that checking flags needs no torch
TRACKER = "latest_checkpointed_iteration.txt"
_METADATA_KEYS = ("iteration", "model_config", "layout")


def _read_json(path: str, flag: str, root: str):
    from .checkpointing import CheckpointError
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{flag} {root}: {path} is corrupt ({type(e).__name__}: {e})") from None


def inspect_checkpoint(root: str, flag: str, iteration: int | None = None) -> dict:
    """metadata.json of the latest (or given) checkpoint under `root`, after checking that it and
    the global index parse (format 2), or every rank's index and tensor file (format 1). Raises
    CheckpointError."""
    from .checkpointing import CheckpointError, iteration_dir, read_metadata, read_tracker
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root}: directory not found")
    if iteration is None:
        try:
            iteration = read_tracker(root)
        except CheckpointError as e:
            raise CheckpointError(f"{flag} {root}: {e}") from None
        if iteration is None:
            raise CheckpointError(f"{flag} {root}: no checkpoint there ({TRACKER} is missing)")
    directory = iteration_dir(root, iteration)
    meta_path = os.path.join(directory, "metadata.json")
    if os.path.isfile(meta_path):
        meta = _read_json(meta_path, flag, root)
        missing = [k for k in _METADATA_KEYS if not isinstance(meta, dict) or k not in meta]
        if isinstance(meta, dict) and "config" not in meta and "args" not in meta:  # "args": before config version 2
            missing.append("config")
        if missing:
            raise CheckpointError(f"{flag} {root}: {meta_path} lacks {', '.join(missing)}: not a megalite checkpoint")
    try:
        meta = read_metadata(root, iteration)  # missing metadata, format version
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {root}: {e}") from None
    if int(meta["format_version"]) >= 2:
        # one global index: its header must parse (the data files it names are opened, and a
        # missing one reported, by the ranks that need them: no rank stats every rank's file)
        from .index import CheckpointIndex
        try:
            CheckpointIndex(directory).io.close()
        except CheckpointError as e:
            raise CheckpointError(f"{flag} {root}: {e}") from None
        return meta
    indexes = sorted(glob.glob(os.path.join(directory, "rank_*.json")))
    if not indexes:
        raise CheckpointError(f"{flag} {root}: {directory} holds no rank files: not a complete checkpoint")
    for path in indexes:
        index = _read_json(path, flag, root)
        if not isinstance(index, dict) or not {"rank", "entries"} <= set(index):
            raise CheckpointError(f"{flag} {root}: {path} is not a rank index (no 'rank' / 'entries')")
        data = path[:-len(".json")] + ".pt"
        if not os.path.isfile(data):
            raise CheckpointError(f"{flag} {root}: {data} is missing (its index {path} exists)")
    return meta
