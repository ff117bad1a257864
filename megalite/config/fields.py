"""How a config field declares its command-line flag: the one place a flag is written down.

A field of a config dataclass is one of three kinds, told apart by its metadata:

- `flag(...)`: set by a Megatron-LM-named command-line flag. The declaration carries the flag's
  name, help, choices, argparse action and its own range check; `arguments/parser.py` generates
  the parser from these, and `arguments/validation.py` checks each range with the flag's name.
- `derived(...)`: no flag; filled by validation from other fields (the data-parallel size from
  the world and the grid, a copy of a value another config owns, ...). `copy_of` names the owner
  of a plain copy, so the copying is generic.
- `internal(...)`: no flag and not derived: a setting for code and tests (a measured design
  alternative, say), documented where it is declared.

Only the standard library is imported here, so building the parser costs no torch import.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str  # "--num-layers"
    help: str = ""
    action: str | None = None  # None (takes a value), store_true, store_false, boolean_optional
    type: Callable | None = None
    choices: tuple | None = None
    nargs: Any = None
    metavar: Any = None
    check: tuple[Callable[[Any], bool], str] | None = None  # (test, the allowed values in words)
    required: bool = False  # checked by validation with the flag's name, not by argparse


def flag(name: str, default: Any = None, help: str = "", *, action: str | None = None, type: Callable | None = None,
         choices=None, nargs=None, metavar=None, check=None, required: bool = False, default_factory=MISSING):
    """A config field set by the flag `name`. `type` defaults to the type of `default`."""
    if type is None and action is None and default is not None and default_factory is MISSING:
        type = builtin_type(default)
    meta = {"flag": Flag(name, help, action, type, tuple(choices) if choices else None, nargs, metavar, check,
                         required)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def derived(default: Any = None, why: str = "", *, copy_of: str | None = None, default_factory=MISSING):
    """A field validation fills: `copy_of` "section.field" for a plain copy of another config's value."""
    meta = {"derived": why or f"copy of {copy_of}", "copy_of": copy_of}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(default: Any = None, why: str = ""):
    """A field with no flag that code and tests may set (`why` says what it is for)."""
    return dataclasses.field(default=default, metadata={"internal": why})


def int_words(text: str) -> list[int]:
    """An argparse type for a list flag (nargs "+") whose values may also come as one quoted
    argument, "2 2": the integers in it (a list; `flat_ints` joins the arguments' lists)."""
    return [int(word) for word in text.split()]


def flat_ints(values) -> list[int] | None:
    """A list flag parsed with `int_words`: its arguments' integers in order (None stays None)."""
    if values is None:
        return None
    return [x for v in values for x in (v if isinstance(v, list) else [v])]


def builtin_type(default):
    return {bool: None, int: int, float: float, str: str}.get(type(default))


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get("flag")


def flagged_fields(cls) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def default_of(f: dataclasses.Field):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


# Range checks, each with the words the error message uses ("--lr must be a number > 0, got -1").
def _finite(v) -> bool:
    return isinstance(v, int) or math.isfinite(v)


AT_LEAST_1 = (lambda v: v >= 1, "an integer >= 1")
AT_LEAST_0 = (lambda v: v >= 0, "an integer >= 0")
POSITIVE = (lambda v: _finite(v) and v > 0, "a number > 0")
NON_NEGATIVE = (lambda v: _finite(v) and v >= 0, "a number >= 0")
PROBABILITY = (lambda v: 0 <= v < 1, "a probability in [0, 1)")
IN_0_1 = (lambda v: 0 <= v < 1, "in [0, 1)")


def at_least_0(meaning: str):
    return (lambda v: v >= 0, f"an integer >= 0 ({meaning})")
