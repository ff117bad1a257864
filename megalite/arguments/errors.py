"""The argument layer's error and the flag names its messages use."""
from __future__ import annotations

import functools

from ..errors import InputError


class ArgumentError(InputError):
    """A flag, or a combination of flags, that cannot run."""


def fail(msg: str):
    raise ArgumentError(msg)


@functools.cache
def _names() -> dict[str, str]:
    from .parser import flag_names
    return {key.split(".", 1)[1]: name for key, name in flag_names().items()}


def flag(field: str) -> str:
    """The flag of a config field, by field name ("add_bias_linear" -> "--disable-bias-linear")."""
    return _names().get(field, "--" + field.replace("_", "-"))
