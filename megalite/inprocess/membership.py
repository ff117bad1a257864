"""Generations: which worker process (slot) is which rank, published by the launcher in its store.

Keys (all under `megalite/inprocess/`): `generation` (the newest, a counter), `gen<G>/rank/<slot>`
(that slot's rank in generation G; a spare slot has none), `abort` (the launcher's last word: the
job failed, every worker exits), `done/<slot>` (a worker finished training), `hb/<slot>` (the
heartbeat counter). A generation's process group rendezvous under the prefix `gen<G>/pg`, so no
worker ever reads an address a previous generation's (dead) worker published."""
from __future__ import annotations

import time

PREFIX = "megalite/inprocess/"
FINISHED = "finished"  # the `abort` key's value when every rank completed: workers exit with 0


def key(name: str) -> str:
    return PREFIX + name


def publish(store, generation: int, ranks: dict[int, int]) -> None:
    """Generation `generation`: slot -> rank (every rank once). The counter goes last, so a worker
    that sees it finds every slot's key."""
    for slot, rank in ranks.items():
        store.set(key(f"gen{generation}/rank/{slot}"), str(rank))
    store.set(key("generation"), str(generation))


def current(store) -> int:
    return int(store.get(key("generation"))) if store.check([key("generation")]) else -1


def aborted(store) -> str | None:
    return store.get(key("abort")).decode() if store.check([key("abort")]) else None


def rank_of(store, generation: int, slot: int) -> int | None:
    k = key(f"gen{generation}/rank/{slot}")
    return int(store.get(k)) if store.check([k]) else None


class Aborted(RuntimeError):
    """The launcher ended the job (its reason)."""


def wait_after(store, generation: int, timeout_s: float | None, poll_s: float = 0.02) -> int:
    """The first generation newer than `generation` (waiting for it), or raise Aborted / TimeoutError."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        reason = aborted(store)
        if reason is not None:
            raise Aborted(reason)
        g = current(store)
        if g > generation:
            return g
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no new generation after {generation} within {timeout_s:g} s")
        time.sleep(poll_s)


__all__ = ["Aborted", "FINISHED", "PREFIX", "aborted", "current", "key", "publish", "rank_of", "wait_after"]
