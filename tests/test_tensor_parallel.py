"""Every tensor-parallel layer against the single-device PyTorch computation: outputs, input
gradients and weight gradients, on 2 (and 4) gloo ranks."""
import pytest
import torch
import torch.nn.functional as F

from dist_helpers import spawn
from megalite.model.init import shard
from megalite.tensor_parallel.param_info import param_info
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      vocab_parallel_cross_entropy)

ATOL = 1e-5


def _inputs(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_column(rank, world, gather_output, stride):
    import torch.distributed as dist
    group = dist.group.WORLD
    s, b, h_in, h_out = 5, 3, 8, 16
    W, bias, X, R = _inputs(0, h_out, h_in), _inputs(1, h_out), _inputs(2, s, b, h_in), _inputs(3, s, b, h_out)
    # reference
    Xr = X.clone().requires_grad_()
    Wr, br = W.clone().requires_grad_(), bias.clone().requires_grad_()
    (F.linear(Xr, Wr, br) * R).sum().backward()
    # tensor parallel
    layer = ColumnParallelLinear(h_in, h_out, tp_group=group, gather_output=gather_output, stride=stride)
    with torch.no_grad():
        layer.weight.copy_(shard(W, param_info(layer.weight), rank, world))
        layer.bias.copy_(shard(bias, param_info(layer.bias), rank, world))
    Xt = X.clone().requires_grad_()
    Y = layer(Xt)
    Rt = R if gather_output else shard(R.movedim(-1, 0), param_info(layer.weight), rank, world).movedim(0, -1)
    ref_out = F.linear(X, W, bias)
    expect = ref_out if gather_output else shard(ref_out.movedim(-1, 0), param_info(layer.weight), rank, world).movedim(0, -1)
    torch.testing.assert_close(Y, expect, atol=ATOL, rtol=0)
    (Y * Rt).sum().backward()
    torch.testing.assert_close(Xt.grad, Xr.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world), atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.bias.grad, shard(br.grad, param_info(layer.bias), rank, world), atol=ATOL, rtol=0)


def _check_row(rank, world, input_is_parallel):
    import torch.distributed as dist
    group = dist.group.WORLD
    s, b, h_in, h_out = 5, 3, 12, 8
    W, bias, X, R = _inputs(0, h_out, h_in), _inputs(1, h_out), _inputs(2, s, b, h_in), _inputs(3, s, b, h_out)
    Xr, Wr, br = X.clone().requires_grad_(), W.clone().requires_grad_(), bias.clone().requires_grad_()
    ref = F.linear(Xr, Wr, br)
    (ref * R).sum().backward()
    layer = RowParallelLinear(h_in, h_out, tp_group=group, input_is_parallel=input_is_parallel)
    with torch.no_grad():
        layer.weight.copy_(shard(W, param_info(layer.weight), rank, world))
        layer.bias.copy_(bias)
    Xin = X.chunk(world, dim=-1)[rank].clone() if input_is_parallel else X.clone()
    Xt = Xin.requires_grad_()
    Y = layer(Xt)
    torch.testing.assert_close(Y, ref.detach(), atol=ATOL, rtol=0)
    (Y * R).sum().backward()
    expect_xgrad = Xr.grad.chunk(world, dim=-1)[rank] if input_is_parallel else Xr.grad
    torch.testing.assert_close(Xt.grad, expect_xgrad, atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world), atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.bias.grad, br.grad, atol=ATOL, rtol=0)


def _check_embedding(rank, world):
    import torch.distributed as dist
    V, h = 16, 6
    W = _inputs(0, V, h)
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(1))
    R = _inputs(2, 3, 7, h)
    Wr = W.clone().requires_grad_()
    (F.embedding(ids, Wr) * R).sum().backward()
    layer = VocabParallelEmbedding(V, h, tp_group=dist.group.WORLD)
    with torch.no_grad():
        layer.weight.copy_(shard(W, param_info(layer.weight), rank, world))
    out = layer(ids)
    torch.testing.assert_close(out, F.embedding(ids, W), atol=ATOL, rtol=0)
    (out * R).sum().backward()
    torch.testing.assert_close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world), atol=ATOL, rtol=0)


def _check_cross_entropy(rank, world, vocab_size):
    import torch.distributed as dist
    s, b, V = 6, 3, 16  # V padded; only the first vocab_size columns are real
    logits = _inputs(0, s, b, V) * 3
    target = torch.randint(0, vocab_size, (s, b), generator=torch.Generator().manual_seed(1))
    R = _inputs(2, s, b)
    Lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(Lr[..., :vocab_size].reshape(-1, vocab_size), target.reshape(-1), reduction="none").view(s, b)
    (ref * R).sum().backward()
    Lt = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(Lt, target, dist.group.WORLD, vocab_size)
    torch.testing.assert_close(loss, ref.detach(), atol=ATOL, rtol=0)
    (loss * R).sum().backward()
    torch.testing.assert_close(Lt.grad, Lr.grad.chunk(world, dim=-1)[rank], atol=ATOL, rtol=0)


def _all_checks(rank, world):
    for gather in (True, False):
        _check_column(rank, world, gather, stride=1)
    _check_column(rank, world, False, stride=2)
    for parallel in (True, False):
        _check_row(rank, world, parallel)
    _check_embedding(rank, world)
    for vocab in (16, 11, 5):  # no padding; padding inside the last shard; whole shards of padding
        _check_cross_entropy(rank, world, vocab)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_layers_match_single_device(world):
    if world == 1:
        # the same checks with no process group (groups of size one skip every collective)
        import torch.distributed as dist
        assert not dist.is_initialized()
        orig = dist.group.WORLD
        try:
            dist.group.WORLD = None
            assert _all_checks(0, 1)
        finally:
            dist.group.WORLD = orig
        return
    assert all(spawn(_all_checks, world))


def _check_rng_tracker(rank, world):
    from megalite.tensor_parallel import seed_everything
    tracker = seed_everything(1234, tp_rank=rank, pp_rank=0, device=torch.device("cpu"))
    x = torch.ones(1000)
    outside = F.dropout(x, 0.5)
    with tracker.fork():
        inside = F.dropout(x, 0.5)
    return outside, inside


def test_rng_tracker_differs_inside_tp_region_only():
    (out0, in0), (out1, in1) = spawn(_check_rng_tracker, 2)
    assert torch.equal(out0, out1)  # replicated activations: same mask on every TP rank
    assert not torch.equal(in0, in1)  # sharded activations: independent masks
