"""The flat-index arithmetic of checkpoint loads against model.init.shard: every element a rank
needs is found in the right saved shard at the right place, for any pair of TP layouts."""
import numpy as np
import pytest
import torch

from megalite.model.init import shard
from megalite.checkpoint.native.reshard import ShardLayout, coalesce, locate, runs, split_at
from megalite.tensor_parallel.param_info import ParamInfo


@pytest.mark.parametrize("shape,dim,stride", [((24, 6), 0, 1), ((6, 24), 1, 1), ((24, 6), 0, 2), ((3, 24, 2), 1, 2)])
@pytest.mark.parametrize("t_old,t_new", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 1)])
def test_runs_and_locate_match_shard(shape, dim, stride, t_old, t_new):
    full = torch.arange(int(np.prod(shape)), dtype=torch.float64).view(shape)
    info = ParamInfo(tensor_parallel=True, partition_dim=dim, partition_stride=stride)
    old = ShardLayout(shape, dim, stride, t_old)
    new = ShardLayout(shape, dim, stride, t_new)
    olds = [shard(full, info, r, t_old).reshape(-1) for r in range(t_old)]
    rng = np.random.default_rng(0)
    for r in range(t_new):
        mine = shard(full, info, r, t_new).reshape(-1)
        for lo, hi in [(0, mine.numel()), *sorted(map(tuple, np.sort(rng.integers(0, mine.numel(), (5, 2)))))]:
            fs, n = runs(new, r, int(lo), int(hi))
            assert n.sum() == hi - lo
            dest = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
            got = torch.full((hi - lo,), -1.0, dtype=torch.float64)
            for rr, ls, ln, d in zip(*locate(old, fs, n, dest)):
                got[d:d + ln] = olds[rr][ls:ls + ln]
            assert torch.equal(got, mine[lo:hi]), (lo, hi)


def test_split_at_and_coalesce():
    cuts = np.array([0, 4, 10, 12])
    i, s, n, d = split_at(cuts, np.array([2, 9]), np.array([5, 2]), np.array([0, 5]))
    assert i.tolist() == [0, 1, 1, 2] and s.tolist() == [2, 4, 9, 10] and n.tolist() == [2, 3, 1, 1]
    assert d.tolist() == [0, 2, 5, 6]
    groups = coalesce(np.array([10, 0, 3, 40]), np.array([2, 3, 2, 1]), gap=5)
    assert [(a, b, sorted(ix.tolist())) for a, b, ix in groups] == [(0, 12, [0, 1, 2]), (40, 41, [3])]
