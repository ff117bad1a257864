"""Layouts that cannot run fail at start-up, before any collective, naming the flags."""
import math
import os

import pytest

from dist_helpers import run_pretrain
from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny

OK = mock(100) + tiny(seq_length=16, global_batch_size=None, train_iters=1)


def check(extra, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(OK + extra), world)


def test_valid_layout_fills_derived_values():
    args = validate_args(parse_args(OK + ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"]), 8)
    assert (args.parallel.data_parallel_size, args.training.num_microbatches, args.model.kv_channels, args.model.ffn_hidden_size) == (4, 2, 16, 256)


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


@pytest.mark.parametrize("extra,pattern", [
    (["--train-iters", "0"], r"--train-iters must be an integer >= 1, got 0"),
    (["--micro-batch-size", "0"], r"--micro-batch-size must be an integer >= 1, got 0"),
    (["--lr", "-1"], r"--lr must be a number > 0, got -1\.0"),
    (["--min-lr=-1e-4"], r"--min-lr must be a number >= 0"),
    (["--global-batch-size", "0"], r"--global-batch-size must be an integer >= 1"),
    (["--lr-warmup-fraction", "1.5"], r"--lr-warmup-fraction must be in \[0, 1\]"),
])
def test_value_out_of_range_names_the_flag(extra, pattern):
    check(extra, 1, pattern)


@pytest.mark.parametrize("extra,message", [
    (["--micro-batchsize", "4"], "unrecognized arguments: --micro-batchsize 4; did you mean --micro-batch-size?"),
    (["--num-layer=3"], "unrecognized arguments: --num-layer=3; did you mean --num-layers?"),
    (["--lrr", "1", "--no-such-thing", "--hiden-size", "8"],
     "unrecognized arguments: --lrr 1 --no-such-thing --hiden-size 8; did you mean --lr for --lrr, "
     "--hidden-size for --hiden-size?"),
    (["--no-such-thing"], "unrecognized arguments: --no-such-thing (see"),
])
def test_unknown_flag_is_told_the_nearest_known_one(extra, message):
    from megalite.errors import UserError
    with pytest.raises(UserError) as e:
        parse_args(OK + extra)
    assert str(e.value).startswith(message)


def test_misspelt_required_flag_is_told_the_nearest_known_one():
    """A tool's parser (abbreviations allowed): the misspelt flag is reported missing, with its near miss."""
    from megalite.errors import ArgumentParser, UserError
    p = ArgumentParser(prog="tool.py")
    p.add_argument("--load", required=True)
    p.add_argument("--prompt")
    assert p.parse_args(["--lo", "x"]).load == "x"  # an abbreviation is no misspelling
    with pytest.raises(UserError) as e:
        p.parse_args(["--laod", "x", "--prompt", "1"])
    assert str(e.value) == ("the following arguments are required: --load; did you mean --load for --laod? "
                            "(see tool.py --help)")


def test_null_tokenizer_mock_data_trains(tmp_path):
    """Megatron-LM's own launch line: --mock-data --tokenizer-type NullTokenizer --vocab-size N. The
    tokenizer has N ids plus its end-of-document id, so the model's vocabulary is N + 1 (padded to
    a multiple of 128: 1024)."""
    records, proc = run_pretrain(1, ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
                                 + tiny(seq_length=16, global_batch_size=None, train_iters=2, log_interval=1,
                                        eval_iters=0) + ["--log-timers-to-tensorboard"], tmp_path)
    train = [r for r in records if "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    # --log-timers-to-tensorboard at the default --timing-log-level 0: the iteration time only, as
    # Megatron-LM; no per-phase timer, no block under the log line (test_tracking.py: level 2)
    assert [r for r in records if r.get("event") == "timers"] == [
        {"event": "timers", "iteration": r["iteration"], "iteration-time": r["elapsed_ms"]} for r in train]
    assert "time across ranks" not in proc.stdout
    assert all(math.isfinite(r["lm_loss"]) for r in train)
    assert abs(train[0]["lm_loss"] - math.log(1001)) < 0.5  # about uniform over the 1001 real ids at the start
    assert "vocab 1001 (padded 1024)" in proc.stdout
    # the embedding holds the padded vocabulary: 1024 x 64 of the model's parameters
    h, s, L = 64, 16, 2
    layer = 12 * h * h + 13 * h  # QKV, proj, fc1, fc2 (+ biases) and two LayerNorms
    assert records[0]["ranks"][0]["num_params"] == 1024 * h + s * h + L * layer + 2 * h


def test_torchrun_bad_layout_stops_every_rank_before_the_process_group(tmp_path):
    _, proc = run_pretrain(2, OK + ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                                    "--hidden-size", "48"], tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    # (torchrun's ChildFailedError report repeats it indented, as its root cause: "traceback : ...")
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert ours == ["pretrain_gpt.py: error: --num-attention-heads (3) is not divisible by "
                    "--tensor-model-parallel-size (2)"]  # once, from rank 0: both ranks fail alike
    assert "> megalite:" not in proc.stdout  # no rank got as far as the model
    assert not os.path.exists(tmp_path / "run.jsonl")
