"""Parsing ``--data-path`` blends and ``--split``: pure functions, no torch, so that
``validate_args`` refuses a malformed value before anything heavy is imported."""
from __future__ import annotations

import math
import re

from megalite.errors import InputError


def parse_and_normalize_split(split: str) -> list[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]`` (also ``/`` separators; missing entries are 0).
    Quotes around the value are dropped: Megatron-LM's own Llama script passes ``'99,1,0'`` with
    the quotes inside the argument (and Megatron-LM reads only the numbers)."""
    try:
        parts = [float(s) for s in re.split(r"[,/]", str(split).strip().strip("'\"")) if s.strip() != ""]
    except ValueError:
        raise InputError(f"--split {split!r}: expected up to three numbers like '969,30,1'") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise InputError(f"--split {split!r}: expected up to three non-negative numbers, not all 0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def parse_blend(paths, flag: str) -> tuple[list[str], list[float] | None]:
    """``["0.3", "A", "0.7", "B"]`` -> (prefixes, weights); ``["A", "B"]`` -> (prefixes, None)."""
    if isinstance(paths, str):
        paths = [paths]
    items = [tok for p in paths for tok in str(p).split()]
    if not items:
        raise InputError(f"{flag} is empty")
    if len(items) % 2 == 0:
        try:
            weights = [float(x) for x in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
                raise InputError(f"{flag}: weights must be non-negative and not all 0, got {weights}")
            return items[1::2], weights
    return items, None
