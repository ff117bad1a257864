"""The files and directories the flags name: inputs must exist, outputs must not clobber
anything. Stats and small reads only; every rank sees the same answer on a shared file system.
Skipped by tools/plan.py, which plans for another machine."""
from __future__ import annotations

import os

from ..config.resilience import REPLACEMENT_ENV
from ..config.run import RunConfig
from ..data.data_paths import parse_blend
from ..data.reader import open_dataset
from ..data.tokenizers import TOKENIZER_FILE_FLAGS
from ..errors import UserError
from .data import DATA_PATHS
from .errors import fail, flag


def check_paths(c: RunConfig) -> None:
    from ..checkpoint.files import inspect_checkpoint
    from ..checkpoint.paths import TRACKER
    _check_datasets(c)
    tok = c.tokenizer
    for dest in TOKENIZER_FILE_FLAGS.get(tok.tokenizer_type, ()):
        path = getattr(tok, dest)
        want_dir = dest == "tokenizer_model" and tok.tokenizer_type == "HuggingFaceTokenizer"
        if not (os.path.isdir(path) if want_dir else os.path.isfile(path)):
            fail(f"{flag(dest)} {path}: {'directory' if want_dir else 'file'} not found "
                 f"(--tokenizer-type {tok.tokenizer_type})")
    ck, tr, t = c.checkpoint, c.tracking, c.training
    outputs = {"save": ck.save, "load": ck.load, "data_cache_path": c.data.data_cache_path,
               "tensorboard_dir": tr.tensorboard_dir, "wandb_save_dir": tr.wandb_save_dir}
    # outputs that must be directories, or files, and that this process can create
    for dest, path in outputs.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            fail(f"{flag(dest)} {path} exists and is not a directory")
    if t.log_jsonl and os.path.isdir(t.log_jsonl):
        fail(f"--log-jsonl {t.log_jsonl} is a directory; give a file to append to")
    for dest, path in dict(outputs, log_jsonl=t.log_jsonl).items():
        if path and dest != "load":
            _check_creatable(path, flag(dest))
    if t.profile_dir:
        _check_creatable(t.profile_dir, "--profile (its trace directory)")
    # the checkpoint to resume from: readable before any process group exists
    if ck.load and os.path.isfile(os.path.join(ck.load, TRACKER)):
        inspect_checkpoint(ck.load, "--load")
    # a run writes iter_N directories and moves the latest pointer: into a directory that holds
    # another run's checkpoints it would replace them, so that needs --load of the same directory
    if ck.save and os.path.isfile(os.path.join(ck.save, TRACKER)):
        same = ck.load and os.path.realpath(ck.load) == os.path.realpath(ck.save)
        if not same and not os.environ.get(REPLACEMENT_ENV):  # (a replacement's are its own job's checkpoints)
            fail(f"--save {ck.save} already holds checkpoints; saving into it without resuming from it would "
                 f"overwrite them: add --load {ck.save} to resume, or choose a new --save directory")
        if ck.finetune:
            fail(f"--finetune restarts at iteration 0, so saving into --save {ck.save} would overwrite its "
                 f"checkpoints; choose a new --save directory")


def _check_datasets(c: RunConfig) -> None:
    for dest in DATA_PATHS:
        if getattr(c.data, dest):
            prefixes, _ = parse_blend(getattr(c.data, dest), flag(dest))
            for prefix in prefixes:
                try:  # files, header, sizes and dtype (memory-mapped: the same cost for any corpus size)
                    open_dataset(prefix, flag(dest))
                except UserError as e:
                    fail(str(e))


def _check_creatable(path: str, flag_name: str) -> None:
    """The nearest existing ancestor of `path` must be a writable directory (found at start-up,
    not at the first save)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"{flag_name} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{flag_name} {path}: {parent} is not writable")
