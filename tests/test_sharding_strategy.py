"""The sharding-strategy registry: one record per --data-parallel-sharding-strategy value,
what each shards, and that every place naming the strategies takes them from it."""
import pytest

from megalite.arguments import build_parser
from megalite.config import SHARDING_STRATEGIES, DDPConfig
from megalite.config.sharding import NAMES, STRATEGIES, default_strategy_name, get_strategy


def test_names_and_what_each_shards():
    assert NAMES == ("no_shard", "optim", "optim_grads", "optim_grads_params") == SHARDING_STRATEGIES
    sharded = {n: (s.shards_optimizer, s.shards_grads, s.shards_params) for n, s in STRATEGIES.items()}
    assert sharded == {"no_shard": (False, False, False), "optim": (True, False, False),
                       "optim_grads": (True, True, False), "optim_grads_params": (True, True, True)}
    assert [s.describe() for s in STRATEGIES.values()] == [
        "no_shard", "optim (ZeRO-1)", "optim_grads (ZeRO-2)", "optim_grads_params (ZeRO-3)"]


def test_each_shards_what_the_previous_does():
    """Gradients are only sharded with the optimizer state, parameters only with both (the
    buffers in DataParallel assume it)."""
    for s in STRATEGIES.values():
        assert s.shards_optimizer >= s.shards_grads >= s.shards_params


def test_defaults_and_unknown_name():
    assert default_strategy_name(False) == "no_shard" and default_strategy_name(True) == "optim"
    with pytest.raises(ValueError, match=r"must be one of \('no_shard', 'optim', 'optim_grads', "
                                         r"'optim_grads_params'\), got 'zero4'"):
        get_strategy("zero4")
    with pytest.raises(ValueError, match="got 'zero4'"):
        DDPConfig(data_parallel_sharding_strategy="zero4")


def test_flag_choices_are_the_registry():
    action = next(a for a in build_parser()._actions if "--data-parallel-sharding-strategy" in a.option_strings)
    assert tuple(action.choices) == NAMES
