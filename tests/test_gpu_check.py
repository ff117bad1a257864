"""`make gpu-check` exists and, without CUDA, says so and exits 0 without writing anything (on a
CUDA machine it runs the GPU tests and benchmarks: benchmarks/gpu_check.py)."""
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
