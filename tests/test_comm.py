"""megalite.comm runs on gloo the flat collectives NCCL runs.

- with the pinned torch, gloo has reduce_scatter_tensor / all_gather_into_tensor and comm takes
  that native path: with dist.all_reduce and dist.all_gather (the emulation's building blocks)
  made to fail, every reduce-scatter and all-gather of comm still gives the reference result;
- the emulation kept for a gloo without them gives the same results;
- a native flat reduce-scatter leaves the rest of its input as this rank's unreduced values
  (as NCCL does), which is all the gradient buffer may rely on.
"""
import pytest
import torch
import torch.distributed as dist

from dist_helpers import spawn
from megalite import comm

WORLD = 2


def _input(rank: int, shape=(4, 6)) -> torch.Tensor:
    """Rank-dependent, exactly representable values: sums are exact in any order."""
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) + 100 * rank) * (rank + 1)


def _check_collectives(rank, world, native: bool):
    group = dist.group.WORLD
    if native:
        assert comm.native_tensor_collectives(group)
        # gloo's flat collectives run as all-reduces in training (comm.flat_by_all_reduce); the
        # native path is NCCL's, run here on gloo
        assert comm.flat_by_all_reduce(group)
        comm.flat_by_all_reduce = lambda group: False

        def refuse(*args, **kwargs):
            raise AssertionError("the emulation ran although gloo has the native collective")
        dist.all_reduce = dist.all_gather = refuse  # this spawned process only (spawn(..., fresh=True))
    else:
        comm.native_tensor_collectives = lambda group: False

        def refuse(*args, **kwargs):
            raise AssertionError("a native collective ran in the emulated path")
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single"):
            if hasattr(dist, name):
                setattr(dist, name, refuse)
        comm._reduce_scatter_tensor = comm._all_gather_into_tensor = refuse

    inputs = [_input(r) for r in range(world)]
    total = sum(inputs)
    # reduce-scatter along each dimension (sequence parallelism uses dim 0)
    for dim in (0, 1, -1):
        got = comm.reduce_scatter(_input(rank), group, dim=dim)
        assert torch.equal(got, total.chunk(world, dim=dim)[rank]), dim
    # all-gather along each dimension (dim 0: sequence parallelism, -1: gather_from_tp)
    for dim in (0, 1, -1):
        got = comm.all_gather(_input(rank), group, dim=dim)
        assert torch.equal(got, torch.cat(inputs, dim=dim)), dim
    # flat reduce-scatter in place (the gradient buffer's bucket -> this rank's slice), sync and async
    for async_op in (False, True):
        full = _input(rank).flatten()
        mine = full.view(world, -1)[rank]
        handle = comm.reduce_scatter_flat(full, mine, group, async_op=async_op)
        if async_op:
            handle.wait()
        assert torch.equal(mine, total.flatten().view(world, -1)[rank])
        others = [r for r in range(world) if r != rank]
        rest = full.view(world, -1)[others]
        # what the rest of the buffer holds differs between the two paths: callers may use `out` only
        expect_rest = _input(rank).flatten().view(world, -1)[others] if native else total.flatten().view(world, -1)[others]
        assert torch.equal(rest, expect_rest)
    # flat all-gather in place (the distributed optimizer's parameter buffer), sync and async
    for async_op in (False, True):
        full = torch.zeros(world * 5)
        full.view(world, -1)[rank] = rank + 1.0
        handle = comm.all_gather_flat(full.view(world, -1)[rank], full, group, async_op=async_op)
        if async_op:
            handle.wait()
        assert torch.equal(full, torch.arange(1.0, world + 1).repeat_interleave(5))
    return True


def test_pinned_torch_gloo_has_native_flat_collectives():
    """torch 2.13 (Makefile's TORCH_SPEC) has them; older admitted versions are only reported."""
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        assert comm.gloo_has_tensor_collectives()
    else:  # pragma: no cover - depends on the installed torch
        print(f"torch {torch.__version__}: gloo flat collectives native = {comm.gloo_has_tensor_collectives()}")


@pytest.mark.skipif(not comm.gloo_has_tensor_collectives(), reason="this torch's gloo has no flat collectives")
def test_native_path_is_taken_and_matches_reference():
    assert spawn(_check_collectives, WORLD, True, fresh=True) == [True] * WORLD


def test_emulated_path_matches_reference():
    assert spawn(_check_collectives, WORLD, False, fresh=True) == [True] * WORLD


def test_size_one_groups_need_no_process_group():
    x = _input(0)
    assert comm.reduce_scatter(x, None) is x and comm.all_gather(x, None) is x
    out = torch.empty(24)
    comm.reduce_scatter_flat(x.flatten(), out, None)
    assert torch.equal(out, x.flatten())
