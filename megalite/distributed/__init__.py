"""Data-parallel gradient reduction over a contiguous gradient buffer."""
from .grad_buffer import GradBuffer

__all__ = ["GradBuffer"]
