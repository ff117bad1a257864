"""The command line, generated from the typed configs: one flag per flagged config field
(config/fields.py), grouped by section, with the field's help, choices and default. Tools that
share a section's flags (the tokenizer's, say) add them with `add_config_args`, so each flag is
declared once for every program that takes it.

Flags left off the command line do not appear in the parsed Namespace (argparse.SUPPRESS), so
`configs_from_namespace` knows which fields were given (`RunConfig.explicit`)."""
from __future__ import annotations

import argparse

from ..config.fields import default_of, flagged_fields
from ..config.run import SECTIONS, RunConfig
from ..errors import ArgumentParser

DESCRIPTION = ("Pretrain a GPT model with tensor, pipeline, context and data parallelism. Flags keep Megatron-LM's "
               "names; bad input is refused with one 'error:' line naming the flag.")


def _help(text: str, default, action) -> str:
    if default is None or action in ("store_true", "store_false", "boolean_optional") or default == []:
        return text
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f"{text} (default: {shown})" if text else f"(default: {shown})"


def add_config_args(parser, cls, section: str, title: str | None = None) -> None:
    """The flags of config class `cls` as an argument group of `parser`; dests are "section.field"."""
    group = parser.add_argument_group(title or (cls.__doc__ or section).split("\n")[0].rstrip("."))
    for f, flag in flagged_fields(cls):
        kwargs = {"dest": f"{section}.{f.name}", "help": _help(flag.help, default_of(f), flag.action),
                  "default": argparse.SUPPRESS}
        if flag.action == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.action:
            kwargs["action"] = flag.action
        else:  # metavar: the field's name, as argparse would show a plain dest (not "SECTION.FIELD")
            metavar = flag.metavar or (None if flag.choices else f.name.upper())
            kwargs.update({k: v for k, v in (("type", flag.type), ("choices", flag.choices), ("nargs", flag.nargs),
                                             ("metavar", metavar)) if v is not None})
        group.add_argument(flag.name, **kwargs)


def build_parser(prog: str = "pretrain_gpt.py") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    for section, cls in SECTIONS.items():
        add_config_args(parser, cls, section)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def given(ns: argparse.Namespace) -> dict[str, dict]:
    """{section: {field: value}} of the flags on the command line."""
    out: dict[str, dict] = {}
    for dest, value in vars(ns).items():
        section, name = dest.split(".", 1)  # (every dest of build_parser's is "section.field")
        out.setdefault(section, {})[name] = value
    return out


def section_values(ns: argparse.Namespace, section: str) -> dict:
    """The given flags of one section added by `add_config_args`, {field: value} (the tools' way)."""
    return {k.split(".", 1)[1]: v for k, v in vars(ns).items() if k.startswith(section + ".")}


def section_from_namespace(ns: argparse.Namespace, cls, section: str):
    """One config of `cls` from the flags `add_config_args` gave a tool's parser."""
    return cls(**section_values(ns, section))


def configs_from_namespace(ns: argparse.Namespace) -> RunConfig:
    """The unvalidated RunConfig of the parsed flags: each section from its own given flags and
    its defaults for the rest. Validation (arguments/validation.py) completes and checks it."""
    values = given(ns)
    explicit = frozenset(f"{s}.{n}" for s, names in values.items() for n in names)
    sections = {s: cls(**values.get(s, {})) for s, cls in SECTIONS.items()}
    return RunConfig(**sections, explicit=explicit)


def flag_names() -> dict[str, str]:
    """"section.field" -> its flag, for messages."""
    return {f"{s}.{f.name}": flag.name for s, cls in SECTIONS.items() for f, flag in flagged_fields(cls)}
