"""Helpers for multi-process tests on CPU with gloo.

`spawn(fn, world_size, *args)` runs fn(rank, world_size, *args) in world_size processes with
torch.distributed initialised (gloo) and returns each rank's return value.
`run_pretrain(nproc, flags, tmp)` runs pretrain_gpt.py under torchrun and returns its JSONL.
`run_reference` and `assert_layout_matches`: a parallel layout trained against one process.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    from megalite.rendezvous import free_port as below_ephemeral
    return below_ephemeral()


def _worker(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle: tensors travel by value, not as file descriptors that die with this process
        queue.put((rank, "ok", pickle.dumps(result)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # report to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def spawn(fn, world_size: int, *args, timeout: float = 120.0, fresh: bool = False) -> list:
    """fn(rank, world_size, *args) on world_size gloo ranks: on the session's pool of ready ranks
    (launch_pool), or in new processes with `fresh` (for a fn that changes its process for good,
    e.g. monkeypatches torch.distributed)."""
    if not fresh:
        import launch_pool
        return launch_pool.get().call(fn, world_size, args, timeout)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


# flags whose runs keep a real process: torch.compile's caches (and recompile limits) live per process
_OWN_PROCESS_FLAGS = {"--compile"}


def run_pretrain(nproc: int, flags: list[str], tmp_path, name: str = "run", check: bool = True,
                 timeout: float = 300.0, fresh: bool = False):
    """Run pretrain_gpt.py on `nproc` ranks; return (records, completed process).

    A run that must succeed (check=True) goes to the session's pool of ready ranks (launch_pool:
    in-process gloo ranks, pretrain_gpt.main(argv), the same code as the command line) unless
    `fresh` asks for a new process; a failing one raises either way. A run whose failure is the
    point (check=False), or with a flag in _OWN_PROCESS_FLAGS, starts `python pretrain_gpt.py`
    (torchrun when nproc > 1), so its exit status and output are the command line's own."""
    jsonl = os.path.join(str(tmp_path), f"{name}.jsonl")
    argv = [*flags, "--log-jsonl", jsonl]
    if check and not fresh and not _OWN_PROCESS_FLAGS.intersection(flags):
        import launch_pool
        codes, stdout, stderr = launch_pool.get().run(nproc, argv, str(tmp_path), name, timeout)
        cmd = [f"pool[{nproc}]", "pretrain_gpt.py", *argv]
        proc = subprocess.CompletedProcess(cmd, max(codes, key=abs), stdout, stderr)
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        else:
            cmd = [sys.executable]
        cmd += [os.path.join(ROOT, "pretrain_gpt.py"), *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    records = []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            records = [json.loads(line) for line in f]
    return records, proc


def train_losses(records) -> list[float]:
    return per_iteration(records, "lm_loss")


def grad_norms(records) -> list[float]:
    return per_iteration(records, "grad_norm")


def assert_losses_close(ref: list[float], got: list[float], rtol: float = 1e-5):
    assert len(ref) == len(got) and len(ref) > 0, (len(ref), len(got))
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst <= rtol, f"relative loss difference {worst:.3e} > {rtol:.0e}\nref={ref}\ngot={got}"


def eval_losses(records) -> list[float]:
    return [r["lm_loss"] for r in records if "split" in r]


def assert_loss_falls(losses: list[float], by: float):
    """Equality with a reference proves little if the model does not learn: on mock tokens both
    sides sit at ln V whatever their gradients are."""
    assert losses[-1] < losses[0] - by, f"the loss did not fall by {by}: {losses}"


def load_params(root: str) -> dict:
    """{global name: whole fp32 tensor} of the latest checkpoint under root, whatever the layout."""
    from megalite.checkpoint.offline import load_full_state_dict
    return load_full_state_dict(root)[1]


def assert_params_close(ref: dict, got: dict, atol: float = 1e-5):
    """Every parameter of `got` equals `ref` within atol x max(1, its scale). Absolute rather than
    relative per element: Adam scales each element's step to about lr whatever its gradient, so
    float rounding in a gradient that is zero in exact arithmetic (e.g. the key bias, which the
    softmax ignores) moves the element by a random amount; callers keep that small (--adam-eps)."""
    assert sorted(got) == sorted(ref), (sorted(set(ref) ^ set(got)))
    worst = []
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape, (name, tuple(g.shape), tuple(r.shape))
        diff = float((g - r).abs().max()) / max(1.0, float(r.abs().max()))
        worst.append((diff, name))
    bad = sorted((w for w in worst if w[0] > atol), reverse=True)
    assert not bad, f"{len(bad)} of {len(ref)} parameters differ by more than {atol:.0e}: {bad[:5]}"


# -- a parallel layout against one process ---------------------------------------------------------
def per_iteration(records, key: str) -> list:
    """`key` of every training iteration's record (the train log records carry consumed_samples)."""
    return [r[key] for r in records if "consumed_samples" in r]


@dataclass
class Reference:
    """One process's run of a model: what every layout of it is held to."""
    flags: list  # the model's flags, the data's included
    records: list  # its JSONL records
    stdout: str
    params: dict | None  # every parameter after the last step, by global name (when saved)


def run_reference(flags: list, tmp_path, save: bool = False) -> Reference:
    """Train `flags` on one process (saving the last step's weights with `save`)."""
    ckpt = ["--save", os.path.join(str(tmp_path), "reference-ckpt")] if save else []
    records, proc = run_pretrain(1, flags + ckpt, tmp_path, "reference")
    return Reference(flags, records, proc.stdout, load_params(ckpt[1]) if save else None)


def assert_layout_matches(ref: Reference, nproc: int, layout: list, tmp_path, rtol: dict, exact: tuple = (),
                          params_atol: float | None = None) -> list:
    """Train the reference's model on `nproc` ranks with the `layout` flags and hold it to the one
    process: per iteration, each record key of `rtol` within its relative tolerance and each of
    `exact` equal; with `params_atol` (the reference saved), every parameter after the last step.
    Returns the layout's records."""
    ckpt = ["--save", os.path.join(str(tmp_path), "ckpt")] if params_atol is not None else []
    records, _ = run_pretrain(nproc, ref.flags + layout + ckpt, tmp_path)
    for key, tol in rtol.items():
        try:
            assert_losses_close(per_iteration(ref.records, key), per_iteration(records, key), rtol=tol)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None
    for key in exact:
        assert per_iteration(ref.records, key) == per_iteration(records, key), key
    if params_atol is not None:
        assert_params_close(ref.params, load_params(ckpt[1]), atol=params_atol)
    return records
