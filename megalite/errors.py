"""User errors: input the user can fix, reported as one line; anything else is a bug.

Bad flags, missing or corrupt files, a checkpoint of another model: the code that finds them raises
a `UserError` (or a subclass: `InputError`, `InputNotFound`, `ArgumentError`, `CheckpointError`,
`ConversionError`) whose message names the flag or file and what was expected. Every entry point
(pretrain_gpt.py, tools/*.py) wraps its `main` with `cli`, which turns a `UserError` into

    pretrain_gpt.py: error: --micro-batch-size must be >= 1, got 0

on stderr and exit status 2, like argparse. Any other exception is a bug and keeps its traceback.

This module imports nothing heavy: a bad flag is refused before torch is imported.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

EXIT_USER_ERROR = 2  # argparse's status for bad usage


class UserError(Exception):
    """Input the user can fix. The message names the flag or file and what was expected."""


class InputError(UserError, ValueError):
    """A flag value, or a file's content, that cannot work (a ValueError, for callers that catch those)."""


class InputNotFound(UserError, FileNotFoundError):
    """A file or directory a flag names does not exist."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete, or does not fit this run."""


class MissingPackage(UserError, ImportError):
    """An optional package a flag needs is not installed (the message says what to pip install)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a `UserError`: one line (no usage block), and a `main`
    called in-process returns 2 instead of exiting."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def report(prog: str, e: BaseException) -> None:
    """Print `prog: error: <message>` once per run.

    One process: print it. Under torchrun every rank usually fails alike (each validates the same
    flags and reads the same files), so rank 0 prints and the others print only a message that
    differs from rank 0's (prefixed with their rank), or when rank 0 did not fail at all.
    """
    line = f"{prog}: error: {_one_line(e)}"
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        rank0_line = _exchange_with_rank0(rank, line)
        if rank != 0:
            if rank0_line == line:
                return
            line = f"[rank {rank}] {line}"
    print(line, file=sys.stderr, flush=True)


def _exchange_with_rank0(rank: int, line: str) -> str | None:
    """Rank 0 posts its line; another rank waits briefly for it. Goes through the launcher's
    key-value store (torchrun's agent store), which exists whether or not this rank got as far
    as initialising a process group; without torchrun, every rank prints its own line."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from .comm import launcher_store
        store = launcher_store(timeout_s=20.0)
        key = "megalite/user_error/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if rank == 0:
            store.set(key, line)
            return line
        store.wait([key])  # raises after the timeout: rank 0 did not fail (or failed elsewhere)
        return store.get(key).decode()
    except Exception:  # the store is only a courtesy: never let it hide the error itself
        return None


def cli(prog: str):
    """Decorator for an entry point's `main(argv=None) -> int`: a `UserError` prints one line
    (see `report`) and returns 2; other exceptions propagate with their traceback."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except UserError as e:
                report(prog, e)
                return EXIT_USER_ERROR
        return run

    return wrap
