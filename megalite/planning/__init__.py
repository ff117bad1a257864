"""Planning a layout before renting the GPUs: memory per GPU, pipeline bubble, FLOPs, from the
same typed configs pretrain_gpt.py validates (tools/plan.py is its command line)."""
