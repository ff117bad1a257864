import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _grad_mode_is_restored():
    """A test that switches autograd off globally would silently break the tests after it."""
    import torch
    yield
    assert torch.is_grad_enabled(), "this test left torch.set_grad_enabled(False) behind"
