"""The tiny GPT the tests train and validate: one definition of its flags.

`tiny(**overrides)` is pretrain_gpt.py's model and batch flags for it; a keyword names a flag
with '_' for '-' (tiny(num_layers=4, seq_length=256)), None drops a default, True adds a switch
(tiny(sequence_parallel=True)). `mock(vocab)` adds random tokens. conftest's `tiny_flags`
fixture hands out the same function to tests that prefer a fixture."""
from __future__ import annotations

DEFAULTS = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 10, "lr": 1e-3,
}


def flags(**values) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def tiny(**overrides) -> list[str]:
    return flags(**{**DEFAULTS, **overrides})


def mock(vocab: int = 1000) -> list[str]:
    return ["--mock-data", "--vocab-size", str(vocab)]
