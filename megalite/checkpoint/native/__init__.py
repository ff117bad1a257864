"""megalite's own checkpoint format (the package docstring describes it): what a rank saves and
how it was cut, the global index, atomic and async saves, safetensors-layout files, and the one
reader of saved pieces (region.py), which every format's load index goes through."""
from .save import CheckpointSaver
from .state import TrainState, local_shard, rng_state, set_rng_state

__all__ = ["CheckpointSaver", "TrainState", "local_shard", "rng_state", "set_rng_state"]
