"""The data-parallel side: contiguous gradient (and ZeRO-1 parameter) buffers and their collectives."""
from .data_parallel import DataParallel
from .grad_buffer import GradBuffer

__all__ = ["DataParallel", "GradBuffer"]
