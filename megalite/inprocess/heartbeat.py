"""Heartbeats: how the launcher tells a frozen rank from a slow one.

A rank that is stopped (SIGSTOP), swapped out or wedged in the kernel neither dies nor raises; its
peers block in their next collective with it until the collective's timeout. So each worker runs
a thread that bumps a counter in the launcher's store every --inprocess-heartbeat-interval
seconds; it runs while the main thread computes or waits in a collective (both release the GIL),
and stops only when the whole process does. The launcher notes when each counter last changed, on
its own clock (no clocks to agree on), and kills a rank whose counter is older than
--inprocess-heartbeat-timeout (SIGKILL: its peers' collectives then fail at once, as for kill -9).
"""
from __future__ import annotations

import threading
import time

from .membership import key


class Heartbeat:
    """The worker's thread (its own store client: the main thread's may be blocked)."""

    def __init__(self, store, slot: int, interval_s: float):
        self.store, self.key, self.interval_s = store, key(f"hb/{slot}"), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="megalite-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:  # the launcher is gone: nothing to tell
                return
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class HeartbeatWatch:
    """The launcher's view: seconds since each slot's counter last changed (or since it started,
    with `startup_s` more for a new process's imports before its first beat)."""

    def __init__(self, store, startup_s: float):
        self.store, self.startup_s = store, startup_s
        self.seen: dict[int, tuple[int, float]] = {}  # slot -> (counter, when it changed)

    def started(self, slot: int) -> None:
        self.seen[slot] = (0, time.monotonic() + self.startup_s)

    def age(self, slot: int) -> float:
        count = int(self.store.add(key(f"hb/{slot}"), 0))
        last, when = self.seen[slot]
        now = time.monotonic()
        if count != last:
            self.seen[slot] = (count, now)
            return 0.0
        return now - when


__all__ = ["Heartbeat", "HeartbeatWatch"]
