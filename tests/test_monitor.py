"""The pieces behind timeouts and restarts, in one process: the monitor's errors and watchdog,
and the per-attempt rendezvous store that a stale pointer from a previous attempt cannot fool."""
import datetime
import threading
import time

import torch
import torch.distributed as dist

from dist_helpers import free_port
from megalite import rendezvous
from megalite.comm import CollectiveError
from megalite.runtime.monitor import CommMonitor
from megalite.parallel_state import single_process_state


def test_failed_collective_is_named_and_stacks_are_dumped(capfd):
    m = CommMonitor(single_process_state(), torch.device("cpu"), timeout_minutes=0.01)  # 0.6 s
    m.where = "in iteration 12"
    token = m.enter("send/recv with rank(s) [1]", None)
    token = (token[0], token[1], token[2] - 1.0)  # blocked for a second: past the timeout
    err = m.failed(token, RuntimeError("Timed out waiting 600ms for recv operation to complete"))
    assert isinstance(err, CollectiveError)
    assert str(err).startswith("rank 0 (pipeline stage 0 of 1, TP rank 0, DP rank 0) in iteration 12: send/recv with "
                               "rank(s) [1] over the pipeline point-to-point channel timed out after 1.0 s "
                               "(--distributed-timeout-minutes 0.01)")
    err = m.failed(m.enter("all_reduce", None), RuntimeError("Connection closed by peer"))
    assert "failed after 0.0 s: a rank of that group died" in str(err)
    assert "test_failed_collective_is_named_and_stacks_are_dumped" in capfd.readouterr().err  # faulthandler's dump


def test_watchdog_reports_a_stalled_wait_once(capfd):
    m = CommMonitor(single_process_state(), torch.device("cpu"), timeout_minutes=0.01)
    m.where = "in iteration 3"
    m.in_flight = ("barrier", None, time.perf_counter() - 5.0)
    assert m.check(time.perf_counter(), grace_s=1.0).startswith(
        "rank 0 (pipeline stage 0 of 1, TP rank 0, DP rank 0) in iteration 3: barrier over the pipeline "
        "point-to-point channel has blocked for 5 s, longer than --distributed-timeout-minutes 0.01")
    assert m.check(time.perf_counter(), grace_s=1.0) is None  # once per stall
    m.in_flight = ("barrier", None, time.perf_counter())
    assert m.check(time.perf_counter(), grace_s=1.0) is None  # a fresh wait is no stall
    assert "this rank's Python stacks" in capfd.readouterr().err


def test_attempt_store_skips_a_previous_attempts_pointer(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # torchrun's shared store
    dead = free_port()  # where a previous attempt's rank 0 listened: nothing there now
    agent.set(rendezvous.KEY, f"127.0.0.1:{dead}:0123456789abcdef")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(rendezvous, "CONNECT_TIMEOUT_S", 1.0)
    timeout = datetime.timedelta(seconds=60)
    found = {}
    worker = threading.Thread(target=lambda: found.update(store=rendezvous.attempt_store(1, timeout)))
    worker.start()
    time.sleep(1.5)  # rank 1 reads the stale pointer first and must not settle for it
    assert worker.is_alive()
    mine = rendezvous.attempt_store(0, timeout)
    worker.join(timeout=30)
    mine.set("hello", "from rank 0")
    assert found["store"].get("hello") == b"from rank 0"
    assert agent.get(rendezvous.KEY).decode().split(":")[1] == str(mine.port)


def test_free_port_is_below_the_ephemeral_range(monkeypatch):
    """A local launch's MASTER_PORT comes from below the range the OS hands to outgoing
    connections (so no connection takes it before rank 0 listens), binds, and differs between
    calls; where the range leaves no room below it, the OS picks."""
    import socket
    low = rendezvous._ephemeral_low()
    ports = {rendezvous.free_port() for _ in range(5)}
    assert len(ports) > 1 and all(low - 8192 <= p < low for p in ports), (low, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
    monkeypatch.setattr(rendezvous, "_ephemeral_low", lambda: 1024)
    assert rendezvous.free_port() > 0
