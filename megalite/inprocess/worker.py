"""A worker of in-process restart: `pretrain` in a loop, one pass per generation.

    generation g:  wait for the launcher's generation -> this slot's rank (none: a spare, wait on)
                   -> wait until every rank of g has arrived (a newer generation first: go to it)
                   -> the default process group through the store prefix gen<g>/pg
                   -> pretrain(cfg, memory): rebuilds groups, model, optimizer and data iterators,
                      and restores the newest in-memory snapshot every rank can get (its own, or
                      the copy a replication peer holds: a replacement's)
    a collective fails (a peer died, or was killed for a stale heartbeat):
                   -> pretrain's own teardown closes what it opened; the default group is
                      destroyed here -> wait for the launcher's next generation (or its abort)

Only failures of communication restart (RuntimeError that is not a UserError: gloo's "connection
reset/closed", a collective timeout); a refused input or a bug ends the worker with its status,
and the launcher ends the job. The HostSnapshots belong to this loop, so they outlive every pass.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist

from .. import comm
from ..checkpoint.native.memory import HostSnapshots
from ..config.resilience import LAUNCHER_ENV, SLOT_ENV
from ..errors import UserError
from ..training import pretrain
from . import membership
from .heartbeat import Heartbeat


def connect(timeout_s: float) -> dist.Store:
    host, port = os.environ[LAUNCHER_ENV].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def log(msg: str) -> None:
    print(f"megalite.inprocess: slot {os.environ[SLOT_ENV]}: {msg}", file=sys.stderr, flush=True)


def join(cfg, store, generation: int, rank: int) -> None:
    """This process as `rank` of generation `generation`'s default group, once every rank of it
    has arrived (membership.arrive: raises Superseded if a newer generation comes first)."""
    membership.arrive(store, generation, int(os.environ["WORLD_SIZE"]), cfg.resilience.inprocess_barrier_timeout)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)  # what initialize and errors.report read
    comm.init_distributed(cfg.parallel.distributed_backend, cfg.parallel.distributed_timeout_minutes,
                          store=dist.PrefixStore(membership.key(f"gen{generation}/pg"), store))


def train_restarting(cfg) -> None:
    """Train under the launcher until the job finishes; restart in process after a peer's failure."""
    r = cfg.resilience
    slot = int(os.environ[SLOT_ENV])
    store = connect(r.inprocess_barrier_timeout)
    beat = Heartbeat(connect(r.inprocess_barrier_timeout), slot, r.inprocess_heartbeat_interval).start()
    memory, generation = HostSnapshots(), -1
    try:
        while True:
            generation = membership.wait_after(store, generation, None)
            rank = membership.rank_of(store, generation, slot)
            if rank is None:
                continue  # a spare in this generation
            if one_generation(cfg, store, generation, rank, memory):
                store.set(membership.key(f"done/{slot}"), "1")
                return
    except membership.Aborted as e:  # the launcher's last word: the job finished, or failed elsewhere
        if str(e) != membership.FINISHED:
            raise SystemExit(f"megalite.inprocess: slot {slot}: the launcher ended the job: {e}") from None
    finally:
        beat.stop()


def one_generation(cfg, store, generation: int, rank: int, memory: HostSnapshots) -> bool:
    """Train as `rank` of `generation`: True when training completed, False when a peer failed
    and the launcher published a newer generation."""
    r = cfg.resilience
    start = time.monotonic()
    try:
        join(cfg, store, generation, rank)
        pretrain(cfg, memory)
        return True
    except UserError:
        raise
    except membership.Superseded:  # a rank died before this generation formed: on to the newer one
        log(f"generation {generation} was superseded before all its ranks arrived")
        return False
    except RuntimeError as e:  # a collective with a dead peer (gloo: connection reset / closed), or its timeout
        cause = " ".join(str(e).split())[:300]
        log(f"rank {rank} of generation {generation} failed after {time.monotonic() - start:.1f} s: {cause}")
        try:  # the launcher has seen the death (or killed a frozen rank) and publishes the next generation
            membership.wait_after(store, generation, r.inprocess_barrier_timeout)
        except TimeoutError:
            raise e from None  # no peer failed: this error is this rank's own
        return False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["train_restarting"]
