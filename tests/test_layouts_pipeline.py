"""Pipeline layouts that cannot run stop at start-up with the flags named (the layouts that can
run are compared with one process in test_layouts.py)."""
import pytest

from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny

BASE = mock(1000) + tiny(num_layers=4)


def _check(extra, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(BASE + extra), world)


def test_layers_not_divisible_by_pp():
    _check(["--pipeline-model-parallel-size", "3"], 3,
           r"--num-layers \(4\) is not divisible by --pipeline-model-parallel-size \(3\)")


def test_layers_not_divisible_by_virtual_stages():
    _check(["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
           2, r"--num-layers-per-virtual-pipeline-stage \(2\)")


def test_interleaved_needs_microbatches_multiple_of_pp():
    """Megatron-LM's rule: groups of PP (or --microbatch-group-size-per-virtual-pipeline-stage)
    micro-batches, the last group's remainder 0 or >= PP."""
    _check(["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
            "--global-batch-size", "6"], 4, r"groups of --pipeline-model-parallel-size \(4\).*the 3 micro-batches")
    _check(["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
            "--global-batch-size", "6", "--microbatch-group-size-per-virtual-pipeline-stage", "5"], 4,
           r"groups of --microbatch-group-size-per-virtual-pipeline-stage \(5\)")
