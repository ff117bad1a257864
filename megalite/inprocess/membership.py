"""Generations: which worker process (slot) is which rank, published by the launcher in its store.

Keys (all under `megalite/inprocess/`): `generation` (the newest, a counter), `gen<G>/rank/<slot>`
(that slot's rank in generation G; a spare slot has none), `abort` (the launcher's last word: the
job failed, every worker exits), `done/<slot>` (a worker finished training), `hb/<slot>` (the
heartbeat counter), `gen<G>/arrived` (how many of its ranks have come to join it). A
generation's process group rendezvous under the prefix `gen<G>/pg`, so no worker ever reads an
address a previous generation's (dead) worker published, and only once every rank has arrived."""
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


class Superseded(Exception):
    """A newer generation was published while this one was still gathering its ranks: a worker
    that died meanwhile would never arrive, so joining this one would wait on it."""


def arrive(store, generation: int, world: int, timeout_s: float, poll_s: float = 0.02) -> None:
    """Count this rank in at `generation` and wait until all `world` ranks have, before any of
    them enters the process group's rendezvous (which waits for every rank until its timeout:
    a second fault during a restart left the survivors there for --distributed-timeout-minutes).
    Raises Superseded when the launcher publishes a newer generation first, Aborted when it ends
    the job, and RuntimeError (a failure to restart from) after `timeout_s`."""
    counter = key(f"gen{generation}/arrived")
    store.add(counter, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        reason = aborted(store)
        if reason is not None:
            raise Aborted(reason)
        if current(store) > generation:
            raise Superseded(f"generation {generation + 1} or later was published")
        arrived = store.add(counter, 0)
        if arrived >= world:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"generation {generation}: {arrived} of {world} ranks arrived within {timeout_s:g} s "
                               "(--inprocess-barrier-timeout)")
        time.sleep(poll_s)


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


__all__ = ["Aborted", "FINISHED", "PREFIX", "Superseded", "aborted", "arrive", "current", "key", "publish", "rank_of",
           "wait_after"]
