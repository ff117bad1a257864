"""Run pretrain_gpt.py's main() on N ranks without starting N fresh Python processes each time.

Starting a run under torchrun costs torchrun's own `import torch` plus one per rank (2-4 s each,
which on a 2-core machine serialise): most of what a layout test used to spend. The pool starts
its ranks once per test session (spawned processes with torch and megalite imported) and hands
each run to ranks 0..nproc-1 as in-process gloo ranks: RANK, WORLD_SIZE, MASTER_ADDR and a fresh
MASTER_PORT per run, the env:// rendezvous torch.distributed also uses without torchrun. Every
run is pretrain_gpt.main(argv) exactly as the command line calls it, with its own working
directory, the test process's environment as it is at the call (a test may set WANDB_MODE, say)
and its own stdout/stderr (file descriptors 1 and 2, so C++ output is caught too).

Between runs a rank puts back what a run may leave behind in a process: the working directory,
signal handlers, torch's deterministic-algorithms switch, grad mode, the default dtype, comm's
monitor and the default process group. A run whose ranks do not all finish in time, or that
fails, takes the pool down with it (its ranks may be stuck in a collective); the next run starts
a fresh one. dist_helpers.spawn's functions run on the same ranks (Pool.call), in a gloo group
initialised as spawn does, with the global generator put back to a new process's seed after. Runs that are expected to fail, that test torchrun itself, or that compile
(torch.compile's caches live per process) go through a real subprocess instead
(dist_helpers.run_pretrain decides).
"""
from __future__ import annotations

import atexit
import gc
import itertools
import pickle
import os
import queue as queue_module
import subprocess
import sys
import time
import traceback

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 8  # the largest layout the tests run
FRESH_SEED = 67280421310721  # torch's default seed: torch.initial_seed() in a process that never seeded


def _serve(rank: int, tasks, results) -> None:
    import multiprocessing
    # A spawned process inherits "spawn" as its default start method (multiprocessing.spawn.prepare
    # sets it); `python pretrain_gpt.py` has the platform's (fork on Linux). Back to that, so that a
    # run's --num-workers data loaders start as on the command line: spawned, each worker imported
    # torch and megalite again, ~4 s of CPU per loader (a train, valid and test loader per run)
    multiprocessing.set_start_method(None, force=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = ROOT
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # spawn's functions live in test modules
    import signal

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import pretrain_gpt
    from megalite import comm
    import megalite.training  # noqa: F401  (the heavy imports, once)

    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    home = os.getcwd()
    while True:
        task = tasks.get()
        if task is None:
            return
        job, nproc, port, kind, payload, env, cwd, out_path, err_path = task
        own_env = dict(os.environ)
        os.environ.clear()  # the test process's environment now, as a subprocess would inherit it
        os.environ.update(env, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        if nproc > 1 or kind == "call":  # one process of main(): no torch.distributed variables, as `python pretrain_gpt.py`
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        out, err = open(out_path, "w"), open(err_path, "w")
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        status, value = "ok", None
        try:
            os.chdir(cwd)
            if kind == "main":
                value = pretrain_gpt.main(list(payload))
            else:  # dist_helpers.spawn's contract: fn(rank, world, *args) in an initialised gloo group
                fn, args = payload
                dist.init_process_group("gloo", rank=rank, world_size=nproc)
                value = pickle.dumps(fn(rank, nproc, *args))  # by value: tensors outlive this call
                dist.barrier()
        except SystemExit as e:
            value = e.code if isinstance(e.code, int) else 1
            if kind == "call":
                status, value = "error", f"SystemExit({e.code!r})"
        except BaseException:  # a traceback, as the command line would print it
            status, value = "error", traceback.format_exc()
            traceback.print_exc()
            if kind == "main":
                status, value = "ok", 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            out.close()
            err.close()
            os.chdir(home)
            os.environ.clear()
            os.environ.update(own_env)
            for s, handler in signals.items():
                signal.signal(s, handler)
            torch.use_deterministic_algorithms(False)
            torch.set_grad_enabled(True)
            torch.set_default_dtype(torch.float32)
            torch.manual_seed(FRESH_SEED)  # the global generator as a new process has it
            monitor = comm.set_monitor(None)
            if monitor is not None:
                monitor.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            # what a task built and dropped (a DataParallel a `call` made, with its groups' gloo
            # threads and sockets) goes now, not whenever the collector next runs
            gc.collect()
        results.put((job, rank, status, value))


class Pool:
    def __init__(self):
        # spawned, not forked from a server that preloaded torch: a forkserver pool started in 7 s
        # instead of 19 but its runs took 1.6x as long (test_zero + CP layouts: 149 s against 119 s)
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.tasks, self.procs = [], []
        self.jobs = itertools.count()

    def grow(self, size: int) -> None:
        """Ranks are started as the first run that needs them comes (most sessions need few)."""
        while len(self.procs) < size:
            r, q = len(self.procs), self.ctx.Queue()
            # not a daemon: a run may start processes of its own (--num-workers data loaders)
            p = self.ctx.Process(target=_serve, args=(r, q, self.results))
            p.start()
            self.tasks.append(q)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()

    def _submit(self, nproc: int, kind: str, payload, cwd: str, name: str, timeout: float) -> tuple[dict, list]:
        from dist_helpers import free_port
        assert 1 <= nproc <= SIZE, nproc
        self.grow(nproc)
        job, port = next(self.jobs), free_port()
        paths = [(os.path.join(cwd, f"{name}.rank{r}.out"), os.path.join(cwd, f"{name}.rank{r}.err"))
                 for r in range(nproc)]
        for r in range(nproc):
            self.tasks[r].put((job, nproc, port, kind, payload, dict(os.environ), cwd, *paths[r]))
        done = {}
        deadline = time.time() + timeout
        try:
            while len(done) < nproc:
                try:
                    j, rank, status, value = self.results.get(timeout=1.0)
                except queue_module.Empty:
                    if not self.alive():
                        raise RuntimeError("a pool rank died")
                    if time.time() > deadline:
                        raise subprocess.TimeoutExpired(f"pool run {name}", timeout)
                    continue
                assert j == job, (j, job)
                done[rank] = (status, value)
                if (status != "ok" or (kind == "main" and value != 0)) and nproc > 1:
                    break  # the other ranks may wait in a collective forever
        except BaseException:
            done = None
            raise
        finally:
            if done is None or len(done) < nproc or any(s != "ok" or (kind == "main" and v != 0)
                                                        for s, v in done.values()):
                _drop()
        return done, paths

    def run(self, nproc: int, argv: list[str], cwd: str, name: str, timeout: float) -> tuple[list[int], str, str]:
        """pretrain_gpt.main(argv) on ranks 0..nproc-1: (each rank's exit status, stdout, stderr:
        the ranks' outputs one after another)."""
        done, paths = self._submit(nproc, "main", list(argv), cwd, name, timeout)
        read = lambda path: open(path).read() if os.path.exists(path) else ""  # noqa: E731
        stdout = "".join(read(o) for o, _ in paths)
        stderr = "".join(read(e) for _, e in paths)
        return [done.get(r, ("ok", -9))[1] for r in range(nproc)], stdout, stderr

    def call(self, fn, nproc: int, args: tuple, timeout: float) -> list:
        """fn(rank, nproc, *args) on ranks 0..nproc-1 in a gloo group: each rank's return value."""
        import tempfile
        with tempfile.TemporaryDirectory(prefix="pool-call-") as cwd:
            done, _ = self._submit(nproc, "call", (fn, args), cwd, "call", timeout)
        for rank, (status, value) in sorted(done.items()):
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
        return [pickle.loads(done[r][1]) for r in range(nproc)]


_pool: Pool | None = None


def get() -> Pool:
    global _pool
    if _pool is None or not _pool.alive():
        _drop()
        _pool = Pool()
    return _pool


def _drop() -> None:
    global _pool
    if _pool is not None:
        _pool.close(kill=True)
        _pool = None


@atexit.register
def shutdown() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None
