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
    called in-process returns 2 instead of exiting. A flag it does not know is told the nearest
    one it does ("did you mean --X?"), whatever error argparse stopped at (a misspelt required
    flag is reported as missing)."""

    _misspelt: list[tuple[str, str]] = []  # (unknown flag, nearest known) of the parse_args call in progress

    def error(self, message):
        raise UserError(f"{message}{self._did_you_mean(message)} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._misspelt = self.misspelt(args)
        try:
            namespace, unknown = self.parse_known_args(args, namespace)
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            return namespace
        finally:
            self._misspelt = []

    def misspelt(self, args: list[str]) -> list[tuple[str, str]]:
        """(flag, nearest known flag) for each flag among `args` this parser does not know but has one like."""
        import difflib
        known = list(self._option_string_actions)
        pairs = []
        for arg in args:
            name = arg.split("=", 1)[0]
            if arg == "--":
                break
            if not name.startswith("-") or _is_number(name) or name in known or \
                    (self.allow_abbrev and any(k.startswith(name) for k in known)):
                continue
            match = difflib.get_close_matches(name, known, n=1)
            if match:
                pairs.append((name, match[0]))
        return pairs

    def _did_you_mean(self, message: str) -> str:
        pairs = self._misspelt
        if not pairs:
            return ""
        if len(pairs) == 1 and message.startswith("unrecognized arguments") and pairs[0][0] in message:
            return f"; did you mean {pairs[0][1]}?"  # the one unknown flag is named just before
        return "; did you mean " + ", ".join(f"{m} for {n}" for n, m in pairs) + "?"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def report(prog: str, e: BaseException) -> None:
    """Print `prog: error: <message>` once per run.

    One process: print it. Under torchrun every rank usually fails alike (each validates the same
    flags and reads the same files), so rank 0 prints at once and the others print only a message
    that differs from rank 0's (prefixed with their rank), or when rank 0 did not fail at all.
    Each failing rank also leaves its line in torchrun's error file, so that torchrun's report of
    the failed job names it as the root cause instead of "To enable traceback see ...".
    """
    line = f"{prog}: error: {_one_line(e)}"
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        _write_error_file(line)
    if rank == 0:  # first, before the store is reached: it is the first line the user sees
        print(line, file=sys.stderr, flush=True)
    if world > 1:
        rank0_line = _exchange_with_rank0(rank, line)
        if rank != 0 and rank0_line != line:
            print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def _write_error_file(line: str) -> None:
    """torchrun's per-worker error file ($TORCHELASTIC_ERROR_FILE), in the layout its `record`
    decorator writes; torchrun shows its message in the ChildFailedError summary."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:  # a courtesy to torchrun's report: never let it hide the error itself
        pass


def _exchange_with_rank0(rank: int, line: str) -> str | None:
    """Rank 0 posts its line; another rank waits briefly for it. Goes through the launcher's
    key-value store (torchrun's agent store), which exists whether or not this rank got as far
    as initialising a process group; without torchrun, every rank prints its own line."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from .rendezvous import launcher_store
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
