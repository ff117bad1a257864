#!/usr/bin/env python3
"""Megatron-LM's own pretraining test configurations (its CI's `model_config.yaml` files, gathered in
../shared/megatron-lm-functional-tests) read the way Megatron-LM's CI reads them, and validated by
pretrain_gpt.py's own flag parsing and validation:

    python tools/megatron_configs.py [FOLDER] [--only NAME ...]

prints one line per configuration (accepted, with its notices' count, or the one `error:` line
that refuses it) and the totals.

How the CI turns a file into a command line (tests/functional_tests/shell_test_utils/
_run_training.sh at Megatron-LM d98e8a6): each `MODEL_ARGS` key is a flag; `true` makes it bare; a
value in `[...]` loses its brackets and splits at spaces into several arguments; any other value is
one argument (quoted when it holds spaces, `|` or parentheses). `${VAR}` are the CI machine's paths
(and ${REPEAT}, the repeat's number; the release files' $DATA_BLEND, a dataset blend of NVIDIA's
release environment), replaced here by local ones. `ENV_VARS` are the run's
environment. A file runs on one node of 8 GPUs (`h100/{gpt,moe}.yaml` recipes); a `_1node` file on
one GB200 node of 4; a checkpoint-consistency file runs each `MODEL_ARGS_N` on
`MODEL_ENV_VARS.MODEL_ARGS_N.GPUS_PER_NODE`.

Some configurations need capabilities other work in this project is building; `OTHER_WORK` names
them by flag, so that a refusal naming one of those flags is counted apart."""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FOLDER = os.path.join(os.path.dirname(ROOT), "shared", "megatron-lm-functional-tests")
TEST_TYPES = ("regular", "ckpt-resume", "frozen-resume", "frozen-start", "checkpoint-consistency", "release")

# flags whose capability another open piece of work builds: flag -> that capability, in words (none
# at present: FP8, the resilience machinery and the 2026 attention variants have landed)
OTHER_WORK: dict[str, str] = {}

# capabilities megalite does not build (each refused naming it): flag -> that capability, in words
NOT_BUILT = {
    "--use-mup": "µP (the Maximal Update Parametrization)",
    "--mup-base-hidden-size": "µP (the Maximal Update Parametrization)",
    "--export-te-mcore-model": "knowledge distillation (ModelOpt)",
    "--export-kd-teacher-load": "knowledge distillation (ModelOpt)",
    "--export-kd-cfg": "knowledge distillation (ModelOpt)",
}


@dataclass
class Run:
    """One pretrain_gpt.py launch of a configuration: its arguments (with ${VAR} left in), world
    size and environment."""
    key: str  # MODEL_ARGS, MODEL_ARGS_2, ...
    argv: list
    world_size: int
    env: dict


@dataclass
class Case:
    name: str  # "gpt/NAME" (the file without .yaml)
    test_type: str
    runs: list = field(default_factory=list)


def ci_argv(model_args: dict) -> list[str]:
    """MODEL_ARGS as the CI's command line (see the module's docstring)."""
    out = []
    for key, value in model_args.items():
        if value is True:
            out.append(key)
            continue
        if value is False or value is None:  # (no file has them; the CI would pass "false")
            continue
        text = " ".join(str(value).split())  # the CI trims it with xargs
        if re.fullmatch(r"\[[^\]]+\]", text):
            out += [key, *text[1:-1].split()]
        else:
            out += [key, text]
    return out


def world_size_of(name: str, doc: dict, key: str) -> int:
    per_run = (doc.get("MODEL_ENV_VARS") or {}).get(key) or {}
    if "GPUS_PER_NODE" in per_run:
        return int(per_run["GPUS_PER_NODE"])
    return 4 if name.endswith("_1node") else 8


def load_case(path: str, folder: str = FOLDER) -> Case | None:
    """The configuration in `path`, or None where it has no MODEL_ARGS."""
    import yaml
    with open(path) as f:
        doc = yaml.safe_load(f)
    name = os.path.relpath(path, folder)[:-len(".yaml")]
    keys = sorted((k for k in doc if re.fullmatch(r"MODEL_ARGS(_\d+)?", k)), key=lambda k: (len(k), k))
    if doc.get("TEST_TYPE") != "checkpoint-consistency":
        keys = keys[:1]  # (a second run's MODEL_ARGS_2 is read by ckpt-resume only; none of these files has one)
    env = {k: str(v) for k, v in (doc.get("ENV_VARS") or {}).items()}
    runs = [Run(k, ci_argv(doc[k]), world_size_of(name, doc, k), env) for k in keys if doc.get(k)]
    if not runs:
        return None
    return Case(name, doc.get("TEST_TYPE") or "regular", runs)


def load_cases(folder: str = FOLDER) -> list[Case]:
    """Every configuration with arguments under `folder`, by name."""
    cases = []
    for family in sorted(os.listdir(folder)):
        sub = os.path.join(folder, family)
        if os.path.isdir(sub):
            for file in sorted(os.listdir(sub)):
                if file.endswith(".yaml"):
                    case = load_case(os.path.join(sub, file), folder)
                    if case is not None:
                        cases.append(case)
    return cases


def substitute(argv: list[str], paths: dict[str, str]) -> list[str]:
    """${VAR} and $VAR -> paths[VAR] (a KeyError names a variable with no stand-in)."""
    return [re.sub(r"\$\{(\w+)\}|\$([A-Z_][A-Z0-9_]*)", lambda m: paths[m.group(1) or m.group(2)], a) for a in argv]


def stand_in_paths(base: str, repeat: int = 1) -> dict[str, str]:
    """Local stand-ins for the CI machine's paths, under `base`."""
    names = ("DATA_PATH", "DATA_CACHE_PATH", "CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH",
             "WANDB_SAVE_PATH", "WANDB_EXPERIMENT")
    paths = {n: os.path.join(base, n.lower()) for n in names}
    paths["WANDB_EXPERIMENT"] = "megatron-configs"
    paths["REPEAT"] = str(repeat)
    # the release files' $DATA_BLEND (set by NVIDIA's release environment): the one local dataset
    paths["DATA_BLEND"] = os.path.join(paths["DATA_PATH"], "text", "common_pile", "v01_filtered_data",
                                       "my-gpt3_00_text_document")
    return paths


@contextlib.contextmanager
def environment(env: dict):
    """The run's ENV_VARS set for the duration (validation reads some of them, NCCL_ALGO, ...)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def validate_run(run: Run, paths: dict[str, str]):
    """(the validated RunConfig, None) or (None, the one-line refusal), as pretrain_gpt.py would
    parse and validate the run (no file is read)."""
    from megalite.arguments import parse_args, validate_args
    from megalite.errors import UserError
    argv = substitute(run.argv, paths)
    err = io.StringIO()
    try:
        with environment(run.env), contextlib.redirect_stderr(err):
            return validate_args(parse_args(argv), run.world_size, check_files=False), None
    except UserError as e:
        return None, str(e).splitlines()[0]
    except SystemExit:  # argparse's own exit (its message went to stderr)
        lines = err.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "argument parsing failed"


def other_work(refusal: str, table: dict = OTHER_WORK) -> str | None:
    """The capability another piece of work builds (or, with table=NOT_BUILT, one megalite does not
    build) that a refusal is about, if any: every flag of argparse's "unrecognized arguments" is one
    of the table's, or validation's line starts with one."""
    text = refusal.split(": ", 1)[1] if refusal.startswith("MODEL_ARGS") else refusal
    unknown = re.match(r"unrecognized arguments: (.*?)(;|\(see|$)", text)
    names = [a for a in unknown.group(1).split() if a.startswith("--")] if unknown else \
        re.findall(r"^(--[\w-]+)", text)
    whats = {table.get(n) for n in names}
    return whats.pop() if len(whats) == 1 and None not in whats else (
        sorted(whats)[0] if names and None not in whats else None)


def validate_case(case: Case, paths: dict[str, str]) -> tuple[list, str | None]:
    """(each run's RunConfig, None) when every run is accepted; (.., the first refusal) otherwise."""
    configs = []
    for run in case.runs:
        config, refusal = validate_run(run, paths)
        if refusal:
            return configs, f"{run.key}: {refusal}" if len(case.runs) > 1 else refusal
        configs.append(config)
    return configs, None


def main(argv=None) -> int:
    import argparse
    import tempfile
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default=FOLDER)
    p.add_argument("--only", nargs="+", default=None, help="configuration names (gpt/NAME) to validate")
    p.add_argument("--notices", action="store_true", help="print each accepted configuration's notices")
    a = p.parse_args(argv)
    if not os.path.isdir(a.folder):
        print(f"error: {a.folder} is not a folder of Megatron-LM configurations")
        return 2
    paths = stand_in_paths(tempfile.mkdtemp(prefix="megatron-configs-"))
    accepted = others = refused = 0
    for case in load_cases(a.folder):
        if a.only and case.name not in a.only:
            continue
        configs, refusal = validate_case(case, paths)
        if refusal is None:
            accepted += 1
            notices = sorted({n for c in configs for n in c.notices})
            print(f"ok       {case.name} ({len(notices)} notices)")
            for n in notices if a.notices else ():
                print(f"           > {n}")
        elif other_work(refusal):
            others += 1
            print(f"other    {case.name}: {refusal}")
        else:
            refused += 1
            print(f"REFUSED  {case.name}: {refusal}")
    print(f"{accepted} accepted, {others} refused for capabilities other work builds, {refused} refused")
    return 0 if not refused else 1


if __name__ == "__main__":
    sys.exit(main())
