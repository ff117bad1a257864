"""What megalite sets itself for lean host memory (the memory wall's settings, docs/zero.md):
4M-element buckets on gloo where --ddp-bucket-size is not given (NCCL's 40M for plans and dry
runs, which stand for the job's machine), and glibc's mmap threshold fixed at 256 KiB on a CPU
run with a sharded strategy unless MALLOC_MMAP_THRESHOLD_ is in the environment (on an unsharded
zero-bubble run instead: freed heap memory kept for reuse); the start-up line says both."""
import ctypes

import pytest
import torch

from megalite.arguments import parse_args, validate_args
from megalite.arguments.validation import GLOO_BUCKET_SIZE
from megalite.runtime import cpu
from tiny import mock, tiny


def _bucket(extra: list[str], world: int = 2) -> int:
    return validate_args(parse_args(mock(100) + tiny() + extra), world, check_files=False).ddp.ddp_bucket_size


def test_bucket_size_on_gloo_unless_given():
    assert GLOO_BUCKET_SIZE == 4_000_000
    assert _bucket([]) == GLOO_BUCKET_SIZE
    assert _bucket(["--distributed-backend", "gloo"]) == GLOO_BUCKET_SIZE
    assert _bucket(["--ddp-bucket-size", "40000000"]) == 40_000_000  # given: kept, even at the old default
    assert _bucket(["--ddp-bucket-size", "123"]) == 123
    assert _bucket(["--dry-run"], world=1) == 40_000_000  # a dry run plans the NCCL machine


def test_plan_keeps_nccl_buckets():
    import sys

    from dist_helpers import ROOT
    sys.path.insert(0, f"{ROOT}/tools")
    import plan
    config, _ = plan.parse(tiny() + ["--vocab-size", "1000", "--world-size", "2"])
    assert config.ddp.ddp_bucket_size == 40_000_000


class _Libc:
    def __init__(self, result: int = 1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.mark.parametrize("device,env,expected", [
    ("cpu", False, [(-3, 256 * 1024)]),  # M_MMAP_THRESHOLD
    ("cpu", True, []),  # the user's MALLOC_MMAP_THRESHOLD_ wins
    ("meta", False, []),  # only a CPU run's memory is the host's
])
def test_lean_malloc(monkeypatch, device, env, expected):
    libc = _Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    if env:
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    else:
        monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    said = cpu.lean_malloc(torch.device(device))
    assert libc.calls == expected
    assert (said is not None) == bool(expected) and (said is None or "256 KiB" in said)


@pytest.mark.parametrize("device,env,expected", [
    ("cpu", None, [(-3, 32 * 2 ** 20), (-1, 2 ** 31 - 1)]),  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD (a C int)
    ("cpu", "MALLOC_TRIM_THRESHOLD_", []),  # the user's settings win
    ("cpu", "MALLOC_MMAP_THRESHOLD_", []),
    ("meta", None, []),
])
def test_steady_malloc_for_the_split_backward(monkeypatch, device, env, expected):
    """zb_h1 / zbv on a CPU without a sharded strategy: freed heap memory is kept, so that the
    bursts the deferred weight gradients free are not mapped again at the next micro-batch."""
    libc = _Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv(env, "1048576")
    said = cpu.steady_malloc(torch.device(device))
    assert libc.calls == expected
    assert (said is not None) == bool(expected) and (said is None or "32 MiB" in said)
    if expected:  # which one a run gets: sharded -> lean, zero-bubble -> steady, else glibc's own
        from megalite.initialize import _host_malloc
        cfg = lambda *extra: validate_args(parse_args(mock(100) + tiny() + list(extra)), 2, check_files=False)
        libc.calls.clear()
        assert _host_malloc(cfg("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb_h1",
                                "--untie-embeddings-and-output-weights"), torch.device("cpu")) == said
        assert _host_malloc(cfg(), torch.device("cpu")) is None
        assert "256 KiB" in _host_malloc(cfg("--use-distributed-optimizer"), torch.device("cpu"))


def test_lean_malloc_without_glibc(monkeypatch):
    def missing(name):
        raise OSError(name)
    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert cpu.lean_malloc(torch.device("cpu")) is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Libc(result=0))  # mallopt refused the value
    assert cpu.lean_malloc(torch.device("cpu")) is None


@pytest.mark.launches
def test_startup_line_says_what_was_set(tmp_path, monkeypatch):
    from dist_helpers import run_pretrain
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    buckets = "--ddp-bucket-size 4000000 on gloo (not given; NCCL's default is 40000000)"
    malloc = "freed tensors over 256 KiB go back to the system at once (glibc mallopt)"
    for name, extra, said in (("plain", [], [buckets]),
                              ("zero1", ["--use-distributed-optimizer"], [malloc, buckets]),
                              ("given", ["--ddp-bucket-size", "100"], [])):
        _, proc = run_pretrain(2, mock(100) + tiny(train_iters=1) + extra, tmp_path, name)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("> host memory:")]
        assert lines == ([f"> host memory: {'; '.join(said)}"] if said else []), (name, proc.stdout)
