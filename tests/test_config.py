"""The typed configs are the single source of truth for the command line: every flag maps to one
config field and every field to one flag (or is declared derived / internal); the argparse
Namespace does not leave the argument layer; a RunConfig's record round-trips, and a checkpoint's
flat record of config version 1 is read into sections."""
import argparse
import ast
import os
from dataclasses import fields

import pytest

from megalite.arguments import build_parser, parse_args, parse_config, validate_args
from megalite.config import SECTIONS, RunConfig, from_saved
from megalite.config.run import owners

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]


def parser_actions():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_flag_maps_to_one_field_and_back():
    by_dest = {}
    for action in parser_actions():
        section, name = action.dest.split(".")
        assert name in {f.name for f in fields(SECTIONS[section])}, action.option_strings
        # --check-for-nan-in-loss-and-grad / --no-check-...: one BooleanOptionalAction, one field
        assert action.dest not in by_dest, (action.option_strings, by_dest.get(action.dest))
        by_dest[action.dest] = action.option_strings
    flagged = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls) if "flag" in f.metadata}
    assert set(by_dest) == flagged
    # and each field is exactly one kind: a flag's, derived (with a reason) or internal (with a reason)
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            kinds = [k for k in ("flag", "derived", "internal") if k in f.metadata]
            assert len(kinds) == 1, (section, f.name, kinds)
            if "derived" in f.metadata:
                assert f.metadata["derived"], (section, f.name)
                source = f.metadata.get("copy_of")
                if source:
                    owner, name = source.split(".")
                    assert "flag" in {g.name: g for g in fields(SECTIONS[owner])}[name].metadata, source
    # a field name is owned by one section, so a flag's name says where its value lives
    assert len(owners()) == len(flagged)


def test_flag_names_are_unique_and_megatrons():
    names = [o for a in parser_actions() for o in a.option_strings]
    assert len(names) == len(set(names))
    assert {"--tensor-model-parallel-size", "--use-distributed-optimizer", "--data-parallel-sharding-strategy",
            "--disable-bias-linear", "--no-load-optim", "--make-vocab-size-divisible-by"} <= set(names)


def test_help_lists_every_flag_by_section(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for action in parser_actions():
        assert action.option_strings[0] in out
    assert "(default: 40000000)" in out  # --ddp-bucket-size shows the field's default


def test_unset_flags_take_the_field_defaults_and_given_ones_are_recorded():
    c = parse_config(OK, 1)
    assert c.explicit >= {"model.num_layers", "optimizer.lr"} and "ddp.ddp_bucket_size" not in c.explicit
    # the field's default is NCCL's; on gloo (this CPU) validation picks its own where none is given
    assert c.ddp.ddp_bucket_size == 4_000_000 and c.model.add_bias_linear
    c = parse_config(OK + ["--disable-bias-linear", "--no-load-optim", "--load", "x"], 1, check_files=False)
    assert not c.model.add_bias_linear and c.checkpoint.no_load_optim


def test_validation_returns_a_new_config_and_leaves_its_input():
    from megalite.arguments.parser import configs_from_namespace
    raw = configs_from_namespace(parse_args(OK + ["--tensor-model-parallel-size", "2"]))
    done = validate_args(parse_args(OK + ["--tensor-model-parallel-size", "2"]), 4)
    assert raw.parallel.data_parallel_size == 1 and done.parallel.data_parallel_size == 2
    assert done.data.seq_length == done.training.seq_length == done.model.seq_length == 16  # copies filled


def test_record_round_trips_and_reads_version_1():
    c = parse_config(OK + ["--bf16", "--swiglu"], 1)
    record = c.to_dict()
    assert RunConfig.from_dict(record).to_dict() == record
    # version 1 (before sections): the validated flags, flat, under "args"
    flat = {"num_layers": 2, "tokenizer_type": "NullTokenizer", "vocab_size": 100, "optimizer": "sgd",
            "make_vocab_size_divisible_by": 64, "data_parallel_size": 4, "not_a_field_any_more": 1}
    sections = from_saved({"args": flat})
    assert sections["model"] == {"num_layers": 2, "make_vocab_size_divisible_by": 64}
    assert sections["tokenizer"] == {"tokenizer_type": "NullTokenizer", "vocab_size": 100}
    assert sections["optimizer"] == {"optimizer": "sgd"}
    assert from_saved({"config": record}) is record


# -- the Namespace stops at the argument layer --------------------------------------------------------
ARGUMENT_LAYER = ("megalite/arguments/", "megalite/errors.py")  # errors.py: the entry points' ArgumentParser
# Megatron-LM checkpoints hold Megatron-LM's own argparse Namespace (common.pt's / model_optim_rng.pt's
# "args"): these modules read it as file data and write one for megatron-core, never megalite's flags
MEGATRON_FORMAT = ("megalite/checkpoint/megatron/index.py", "megalite/checkpoint/megatron/safe_pickle.py",
                   "megalite/checkpoint/megatron/export.py")


def package_modules():
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def namespace_uses(path: str) -> list[str]:
    """What in a module suggests it takes an argparse Namespace: importing argparse or
    SimpleNamespace, a parameter named `args` (the Namespace's name by convention), vars(...)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"line {node.lineno}: import argparse")
        elif isinstance(node, ast.ImportFrom) and (node.module == "argparse" or (
                node.module == "types" and any(a.name == "SimpleNamespace" for a in node.names))):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"line {node.lineno}: {node.name}({p.arg})" for p in params if p.arg in ("args", "namespace")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            found.append(f"line {node.lineno}: vars(...)")
    return found


def test_no_namespace_past_the_argument_layer():
    offenders = {rel: uses for rel, path in package_modules() if not rel.startswith(ARGUMENT_LAYER + MEGATRON_FORMAT)
                 for uses in [namespace_uses(path)] if uses}
    assert not offenders, offenders


def test_the_namespace_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\nfrom types import MappingProxyType, SimpleNamespace\n\n"
                   "def build(args):\n    return vars(args)\n")
    assert len(namespace_uses(str(bad))) == 4
    assert isinstance(parse_args(OK), argparse.Namespace)  # (the argument layer itself does use one)


def test_pipeline_schedule_flag_defaults_and_refuses_by_the_registry():
    from megalite.arguments import ArgumentError
    pp2 = OK + ["--pipeline-model-parallel-size", "2"]
    assert parse_config(OK, 1).parallel.pipeline_schedule == "no_pipelining"
    assert parse_config(pp2, 2).parallel.pipeline_schedule == "1f1b"
    vpp = pp2 + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]
    assert parse_config(vpp, 2).parallel.pipeline_schedule == "interleaved_1f1b"
    with pytest.raises(ArgumentError, match="--pipeline-schedule 'zigzag' is not a schedule; choose from"):
        parse_config(pp2 + ["--pipeline-schedule", "zigzag"], 2)
    with pytest.raises(ArgumentError, match="--pipeline-schedule interleaved_1f1b needs"):
        parse_config(pp2 + ["--pipeline-schedule", "interleaved_1f1b"], 2)
    with pytest.raises(ArgumentError, match="--pipeline-schedule no_pipelining needs --pipeline-model-parallel-size 1"):
        parse_config(pp2 + ["--pipeline-schedule", "no_pipelining"], 2)
