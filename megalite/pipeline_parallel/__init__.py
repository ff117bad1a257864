"""Pipeline schedules (and, with more than one stage, the point-to-point exchange)."""
from .schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
