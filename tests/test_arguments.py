"""Layouts that cannot run fail at start-up, before any collective, naming the flags."""
import time

import pytest

from dist_helpers import run_pretrain
from megalite.arguments import ArgumentError, parse_args, validate_args

OK = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]


def check(extra, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(OK + extra), world)


def test_valid_layout_fills_derived_values():
    args = validate_args(parse_args(OK + ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"]), 8)
    assert (args.data_parallel_size, args.num_microbatches, args.kv_channels, args.ffn_hidden_size) == (4, 2, 16, 256)


def test_world_not_divisible():
    check(["--tensor-model-parallel-size", "4"], 6, r"world size 6 .*--tensor-model-parallel-size \(4\)")


def test_heads_not_divisible_by_tp():
    check(["--tensor-model-parallel-size", "8", "--hidden-size", "72", "--num-attention-heads", "6"], 8,
          r"--num-attention-heads \(6\) is not divisible by --tensor-model-parallel-size \(8\)")


def test_query_groups_not_divisible_by_tp():
    check(["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "2"], 4,
          r"--num-query-groups \(2\) is not divisible by --tensor-model-parallel-size \(4\)")


def test_global_batch_not_divisible():
    check(["--global-batch-size", "6"], 2, r"--global-batch-size \(6\) is not divisible by --micro-batch-size \(2\)")


def test_data_source_required():
    with pytest.raises(ArgumentError, match="--data-path"):
        validate_args(parse_args(OK[3:]), 1)


def test_torchrun_bad_layout_exits_fast_with_message(tmp_path):
    start = time.time()
    _, proc = run_pretrain(2, OK + ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                                    "--hidden-size", "48"], tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert "--num-attention-heads (3) is not divisible by --tensor-model-parallel-size (2)" in proc.stderr
    assert time.time() - start < 60  # no rank waits in a collective
