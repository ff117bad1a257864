"""FP8 training through torchao (--fp8-format; docs/fp8.md). The modules are imported by name
(megalite.fp8.site, ...): torchao itself is imported only when a run asks for FP8
(fp8/backend.py), so that bf16 and fp32 runs need no torchao."""
