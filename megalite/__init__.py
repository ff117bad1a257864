"""megalite: Megatron-style GPT pretraining in a codebase you can read in an afternoon.

Tensor, sequence, pipeline (1F1B, interleaved), context and data parallelism with ZeRO-1/2/3,
optimizer offload and activation recompute, on one CPU process, gloo ranks or NCCL GPUs; every
parallel layout computes the same function. Megatron-LM's flags and .bin/.idx datasets;
checkpoints that load on any layout and convert to and from Hugging Face. The code map, one line
per module: docs/architecture.md."""
__version__ = "0.1.0"
