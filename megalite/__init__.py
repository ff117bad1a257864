"""megalite: Megatron-style GPT pretraining in a codebase you can read in an afternoon."""
__version__ = "0.1.0"
