"""Mixture-of-Experts layers: the router (router.py), the experts one rank holds (experts.py),
token dispatch across expert-parallel ranks (dispatcher.py) and the layer (layer.py)."""
from .layer import MoELayer

__all__ = ["MoELayer"]
