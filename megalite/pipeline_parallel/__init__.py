"""Pipeline parallelism: the no-pipelining, 1F1B and interleaved 1F1B schedules, and (with more
than one stage) the point-to-point exchange of activations and gradients."""
from .schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
