"""`make gpu-check` (benchmarks/gpu_check.py): without CUDA it says so and exits 0 without writing
anything; with --tiny every one of its steps runs at toy sizes on the CPU and fills its results
file, so the code a GPU lease runs cannot rot between leases (the GPU numbers themselves:
benchmarks/RESULTS_gpu.md)."""
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the real check where CUDA is")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "RESULTS_gpu.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--out", str(out)],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-check: skipped: no CUDA device" in proc.stdout
    assert not out.exists()
    assert "gpu-check:" in open(os.path.join(ROOT, "Makefile")).read()


@pytest.mark.launches
def test_every_step_runs_at_tiny_sizes_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "RESULTS_gpu.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--tiny", "--steps", "1",
                           "--out", str(out)], env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "failed" not in text and "timed out" not in text
    for row in ("| tiny | 1 x 2 | megalite |", "| tiny | 2 x 2 | transformers GPT2LMHeadModel |",
                "| tiny | 2 x 2 | nanoGPT-style |", "kernel launches", "| dense, ZeRO-3 (optim_grads_params) |",
                "| MoE (tiny) |"):
        assert row in text, row


def test_a_spent_budget_cuts_steps_short_then_skips_them(monkeypatch):
    """The check fits its lease whatever hangs: a step runs at most as long as the budget has
    left, and once under Commands.MIN_STEP_S is left the rest are skipped, each logged as failed."""
    import importlib.util
    import time
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_check.Commands, "MIN_STEP_S", 0.5)
    commands = gpu_check.Commands(budget_s=2.0)
    start = time.time()
    hung = commands.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=100)
    assert hung.returncode == 124 and time.time() - start < 10, (hung.returncode, time.time() - start)
    skipped = commands.run([sys.executable, "-c", "print('never')"], timeout=100)
    assert skipped.returncode == 125 and "skipped" in skipped.stderr
    assert [r["status"] for r in commands.log] == [124, 125]
