"""The command line: flags generated from the typed configs (parser.py), checked and completed by
validation (validation.py and the rule modules beside it). The argparse Namespace lives only in
this package and the entry points; `parse_config` hands the rest of megalite a RunConfig."""
from __future__ import annotations

import argparse

from ..config.run import RunConfig
from .errors import ArgumentError
from .parser import build_parser, configs_from_namespace, parse_args
from .validation import validate


def validate_args(args: argparse.Namespace, world_size: int | None = None, check_files: bool = True) -> RunConfig:
    """The validated RunConfig of parsed flags."""
    return validate(configs_from_namespace(args), world_size, check_files)


def parse_config(argv=None, world_size: int | None = None, check_files: bool = True) -> RunConfig:
    """Flags (default: sys.argv) -> the validated RunConfig."""
    return validate_args(parse_args(argv), world_size, check_files)


__all__ = ["ArgumentError", "build_parser", "parse_args", "parse_config", "validate", "validate_args"]
