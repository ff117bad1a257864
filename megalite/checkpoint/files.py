"""A checkpoint's JSON files read up front, whichever format (megalite's, Megatron-LM's torch_dist
or torch), so that a missing or corrupt one is a one-line error naming the file before any model
is built or process group started (pretrain_gpt.py --load, tools/generate.py,
tools/checkpoint/convert.py). Reads the JSON files only, never the tensors; imports no torch (the
families' modules it needs for another format's files are imported when that format is met)."""
from __future__ import annotations

import glob
import json
import os

from ..errors import CheckpointError
from .paths import FORMAT_VERSION, INTEGRITY, TRACKER, iteration_dir, read_tracker, sha256

_METADATA_KEYS = ("iteration", "model_config", "layout")


def read_metadata(root: str, iteration: int | None = None) -> dict:
    """metadata.json of the latest (or the given) checkpoint under `root`."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"no checkpoint under {root}: {TRACKER} is missing")
    path = os.path.join(iteration_dir(root, iteration), "metadata.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {iteration_dir(root, iteration)} is not a complete checkpoint")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path}: format version {meta.get('format_version')}, expected 1 or {FORMAT_VERSION}")
    meta["dir"] = iteration_dir(root, iteration)
    return meta


def _read_json(path: str, flag: str, root: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{flag} {root}: {path} is corrupt ({type(e).__name__}: {e})") from None


def megatron_format(directory: str) -> str | None:
    """Which of Megatron-LM's checkpoint formats `directory` (an iter_NNNNNNN) holds, if any (it
    shares megalite's tracker file and directory names): `torch`, one model_optim_rng.pt per
    model-parallel rank; `torch_dist` / `zarr`, sharded files with a metadata.json naming the
    backend (--auto-detect-ckpt-format's question, answered whatever the flag)."""
    if glob.glob(os.path.join(directory, "mp_rank_*", "model_optim_rng.pt")):
        return "torch (mp_rank_*/model_optim_rng.pt)"
    try:
        with open(os.path.join(directory, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if backend:
        return f"{backend} (sharded_backend in metadata.json)"
    if glob.glob(os.path.join(directory, "*.distcp")):
        return "torch_dist (*.distcp)"
    return None


def checked_metadata(root: str, flag: str, iteration: int | None = None) -> dict:
    """metadata.json of the latest (or given) checkpoint under `root`, checked to be a megalite
    checkpoint's and to parse; the JSON only, no index or tensor file (what --use-checkpoint-args
    reads before validation). Raises CheckpointError naming `flag` and the file."""
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
    foreign = megatron_format(directory)
    if foreign is not None and foreign.startswith("torch"):  # torch_dist, or torch (mp_rank_*)
        from .megatron.legacy import read_megatron_metadata  # torch, for Megatron-LM checkpoints only
        return read_megatron_metadata(directory, flag, root)
    if foreign is not None:
        raise CheckpointError(f"{flag} {root}: {directory} is a Megatron-LM checkpoint in its {foreign} format, "
                              "which megalite does not read (it reads its own and Megatron-LM's torch_dist and "
                              "torch: docs/checkpoints.md)")
    meta_path = os.path.join(directory, "metadata.json")
    if os.path.isfile(meta_path):
        meta = _read_json(meta_path, flag, root)
        missing = [k for k in _METADATA_KEYS if not isinstance(meta, dict) or k not in meta]
        if isinstance(meta, dict) and "config" not in meta and "args" not in meta:  # "args": before config version 2
            missing.append("config")
        if missing:
            raise CheckpointError(f"{flag} {root}: {meta_path} lacks {', '.join(missing)}: not a megalite checkpoint")
    try:
        return read_metadata(root, iteration)  # missing metadata, format version
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {root}: {e}") from None


def inspect_checkpoint(root: str, flag: str, iteration: int | None = None) -> dict:
    """metadata.json of the latest (or given) checkpoint under `root`, after checking that it and
    the global index parse (format 2), or every rank's index and tensor file (format 1). Raises
    CheckpointError."""
    meta = checked_metadata(root, flag, iteration)
    directory = meta["dir"]
    if meta.get("megatron"):  # a Megatron-LM checkpoint: its .metadata and common.pt parsed
        return meta
    if int(meta["format_version"]) >= 2:
        # one global index: its header must parse (the data files it names are opened, and a
        # missing one reported, by the ranks that need them: no rank stats every rank's file)
        from .native.index import CheckpointIndex
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


def verify_integrity(directory: str) -> int:
    """Check the files of `directory` against its integrity.json; the number of files checked.
    Raises CheckpointError naming each file that is missing or differs."""
    path = os.path.join(directory, INTEGRITY)
    if not os.path.isfile(path):
        raise CheckpointError(f"--verify-integrity: {path} is missing (the checkpoint was saved without "
                              "--verify-integrity)")
    manifest = _read_json(path, "--verify-integrity", directory)
    if manifest.get("algorithm", "sha256") != "sha256":
        raise CheckpointError(f"{path}: hash algorithm {manifest.get('algorithm')!r}, expected 'sha256'")
    bad = []
    for name, digest in manifest.get("files", {}).items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            bad.append(f"{name} is missing")
        elif sha256(file) != digest:
            bad.append(f"{name} differs from its hash")
    if bad:
        raise CheckpointError(f"--verify-integrity: {directory}: {'; '.join(bad)}")
    return len(manifest.get("files", {}))
