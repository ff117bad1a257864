"""--check-weight-hash-across-dp-replicas-interval (runtime/weight_hash.py).

On 3 gloo ranks (DP 3, so a majority names the odd replica out): a healthy run (ZeRO-1 with
overlapped parameter gathers, as Megatron-LM's configuration that uses the flag) passes every
check and trains as without it; one bit (a high mantissa bit) flipped in one element of one rank's weights after
iteration 3 is named, its rank, parameter and the iteration (4, the next check of interval 2),
and the run stops before that iteration's checkpoint. Cost: ~30 s wall on the shared 2 cores (one pool call).
"""
import os

import pytest
import torch

from dist_helpers import spawn
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.checkpoint.paths import read_tracker
from megalite.runtime.weight_hash import odd_ones_out, param_hash
from tiny import mock, tiny

FLAGS = mock(256) + tiny(log_interval=1, eval_iters=0, global_batch_size=6, train_iters=6) + [
    "--check-weight-hash-across-dp-replicas-interval", "2", "--save-interval", "1"]


def test_a_flipped_bit_changes_the_hash_and_the_odd_one_is_named():
    w = torch.randn(7, 5)
    flipped = w.clone()
    flipped.view(-1).view(torch.int32)[17] ^= 1  # the lowest mantissa bit of one element
    assert param_hash(w) == param_hash(w.clone()) != param_hash(flipped)
    assert odd_ones_out([5, 5, 9]) == [2] and odd_ones_out([5, 9]) == [0, 1] and odd_ones_out([1, 2, 3]) == [0, 1, 2]
    assert odd_ones_out([4, 4, 4, 7]) == [3]


def test_flag_checks():
    with pytest.raises(ArgumentError, match="cannot run with --data-parallel-sharding-strategy optim_grads_params"):
        validate_args(parse_args(FLAGS + ["--data-parallel-sharding-strategy", "optim_grads_params"]), 3)
    with pytest.raises(ArgumentError, match="must be >= 1"):
        validate_args(parse_args(FLAGS[:-4] + ["--check-weight-hash-across-dp-replicas-interval", "0"]), 3)
    c = validate_args(parse_args(FLAGS), 1)
    assert any("no replica to compare" in n for n in c.notices)


def _runs(rank, world, out):
    import megalite.training as training
    from megalite.runtime.weight_hash import WeightHashError
    healthy = validate_args(parse_args(FLAGS + ["--use-distributed-optimizer", "--overlap-param-gather",
                                                "--overlap-grad-reduce", "--save", os.path.join(out, "healthy")]),
                            world)
    state = training.pretrain(healthy)
    step = training.train_step

    def flip_after_iteration_3(run):
        result = step(run)
        if run.state.iteration == 2 and rank == 1:  # the loop counts this iteration (3) after the step
            name, p = run.state.named_params[3]
            with torch.no_grad():
                p.view(-1).view(torch.int32)[1] ^= 1 << 20  # a high mantissa bit: the lowest one
                # may be rounded away by the next update, the replicas then equal again
        return result

    training.train_step = flip_after_iteration_3
    try:
        training.pretrain(validate_args(parse_args(FLAGS + ["--save", os.path.join(out, "flipped")]), world))
        error = None
    except WeightHashError as e:
        error = str(e)
    finally:
        training.train_step = step
    return state.iteration, error, healthy.training.train_iters


def test_flipped_bit_is_named_within_the_interval(tmp_path):
    results = spawn(_runs, 3, str(tmp_path))
    for iteration, error, iters in results:
        assert iteration == iters  # the healthy run passed its checks at 0, 2, 4, 6
        assert error is not None
    messages = [e for _, e, _ in results]
    # every rank of the flipped parameter's group names rank 1 and the iteration of the next check
    assert all(m.startswith("iteration 4: the weights of data-parallel replicas differ") for m in messages)
    assert "on rank(s) [1] (of replicas [0, 1, 2])" in messages[0], messages[0]
    assert read_tracker(str(tmp_path / "flipped")) == 3 and read_tracker(str(tmp_path / "healthy")) == 6
