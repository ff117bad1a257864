"""The store the workers' process groups rendezvous through: a fresh one for every attempt.

Under torchrun every worker is told to use the agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE=
True, MASTER_ADDR:MASTER_PORT). Since torch 2.5 that store lives as long as torchrun and is kept
across `--max-restarts` restarts, and the workers' keys go into it with no per-attempt prefix.
After a restart, gloo's full-mesh connect (and NCCL's unique-id exchange) can read the address a
worker of the *previous* attempt published, connect to a dead port and wait there until the
init timeout: the 4-rank restart that "hung in init_process_group". Whether it hangs is a race
(a worker that starts late finds its peers' stale keys), which is why a tiny script can restart
fine where pretrain_gpt.py, slower to import, does not. TORCHELASTIC_RESTART_COUNT cannot serve
as a prefix: each agent counts its own restarts, so nodes can disagree (pytorch/pytorch#135712).

Instead, global rank 0 starts a TCPStore of its own on a free port for this attempt and
publishes "host:port:token" in the agent's store; every other rank reads that key and connects,
and retries while the key still names a previous attempt's store (nothing listens there any more,
or the store there holds another token). The random token makes a stale pointer detectable
without any counter the nodes would have to agree on.
"""
from __future__ import annotations

import datetime
import os
import random
import socket
import time
import uuid

import torch.distributed as dist

KEY = "megalite/attempt_store"
TOKEN_KEY = "megalite/attempt_token"
CONNECT_TIMEOUT_S = 10.0  # one try at a published address; a stale one is refused at once (_listening)


def free_port(host: str = "127.0.0.1") -> int:
    """A port to host a store on (MASTER_PORT of a local launch) that is free now and stays so.
    A port the OS picks (binding port 0) comes from its ephemeral range, which it also hands out
    as the local end of outgoing connections: between picking it and listening on it, another
    process's connection (a gloo mesh of a test running beside) can take it, and rank 0 then fails
    with EADDRINUSE while the other ranks wait (seen twice in the suite). So: a random port below
    that range that binds now; the OS's pick where the range leaves no room below it."""
    low = _ephemeral_low()
    if low > 10000:
        pick = random.SystemRandom()  # never the seeded module generator: runs seed it alike
        for _ in range(64):
            port = pick.randrange(low - 8192, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                    return port
                except OSError:
                    continue
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the OS's ephemeral range (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class RendezvousError(RuntimeError):
    """The workers could not find this attempt's store before the timeout."""


def uses_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def launcher_store(timeout_s: float) -> dist.Store:
    """A client of the launcher's key-value store (torchrun's agent store at MASTER_ADDR:MASTER_PORT):
    lets ranks exchange a few bytes without a process group, e.g. to report one error once
    (errors.py), or to find this attempt's store."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def attempt_store(rank: int, timeout: datetime.timedelta) -> dist.Store | None:
    """This attempt's store under torchrun's shared agent store; None elsewhere (plain env://
    rendezvous, where rank 0 hosts a new store at MASTER_PORT for every launch)."""
    if not uses_agent_store():
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = launcher_store(timeout.total_seconds())
    if rank == 0:
        # global rank 0 runs on the node that hosts the agent's store, so MASTER_ADDR reaches it
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set(TOKEN_KEY, token)
        agent.set(KEY, f"{host}:{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    stale = None
    while True:
        value = agent.get(KEY).decode()  # waits (up to the timeout) for a first attempt's rank 0
        if value != stale:
            found = _connect(value, min(CONNECT_TIMEOUT_S, max(1.0, deadline - time.monotonic())), timeout)
            if found is not None:
                return found
            stale = value  # a previous attempt's store: wait for this attempt's rank 0 to replace it
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank {rank}: rank 0 of this attempt did not publish its store in {KEY} of torchrun's store at "
                f"{host}:{port} within {timeout.total_seconds():.0f} s (last value {value!r}); is rank 0 running?")
        time.sleep(0.2)


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether anything accepts connections at host:port. A TCPStore client retries a refused
    connection until its timeout (and once more after a pause: ~23 s for a dead previous attempt's
    port at CONNECT_TIMEOUT_S 10, each restart); a plain socket is refused at once."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _connect(value: str, timeout_s: float, timeout: datetime.timedelta) -> dist.Store | None:
    host, port, token = value.rsplit(":", 2)
    if not _listening(host, int(port), timeout_s):
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        if store.get(TOKEN_KEY).decode() == token:
            store.set_timeout(timeout)
            return store
    except (RuntimeError, TimeoutError, ValueError):  # DistStoreError / DistNetworkError are RuntimeErrors
        pass
    return None
