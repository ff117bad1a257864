"""Sparse upcycling (--moe-use-upcycling): plan.py, which dense weight each MoE weight starts from
and the scale (torch-free, so validation reads it before torch is imported); load.py, a dense
checkpoint read into the MoE run. No face here: importing one would make the plan import torch."""
