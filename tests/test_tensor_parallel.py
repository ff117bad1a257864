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

from tolerances import assert_close_fp32

# the shards' partial sums meet in an all-reduce, in another order than one device's GEMM
# (tests/tolerances.py): every reduction here has at most 32 terms (hidden 8-16, 15-21 rows, a
# 16-entry vocabulary), at most two in a row


def close(got, want, msg=None):
    assert_close_fp32(got, want, k=32, chain=2, msg=msg)


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
    close(Y, expect)
    (Y * Rt).sum().backward()
    close(Xt.grad, Xr.grad)
    close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world))
    close(layer.bias.grad, shard(br.grad, param_info(layer.bias), rank, world))


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
    close(Y, ref.detach())
    (Y * R).sum().backward()
    expect_xgrad = Xr.grad.chunk(world, dim=-1)[rank] if input_is_parallel else Xr.grad
    close(Xt.grad, expect_xgrad)
    close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world))
    close(layer.bias.grad, br.grad)


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
    assert torch.equal(out, F.embedding(ids, W))  # a lookup plus zeros from the other shards: exact
    (out * R).sum().backward()
    close(layer.weight.grad, shard(Wr.grad, param_info(layer.weight), rank, world))


def _check_cross_entropy(rank, world, vocab_size, dtype=torch.float32):
    """Against F.cross_entropy over the whole vocabulary in fp32. bf16 logits (the softmax recomputed
    in fp32 slices in backward) are compared with the same bf16-rounded logits: the loss within
    fp32 rounding, the gradient within one bf16 rounding."""
    import torch.distributed as dist
    s, b, V = 6, 3, 16  # V padded; only the first vocab_size columns are real
    logits = (_inputs(0, s, b, V) * 3).to(dtype)
    target = torch.randint(0, vocab_size, (s, b), generator=torch.Generator().manual_seed(1))
    R = _inputs(2, s, b)
    Lr = logits.float().clone().requires_grad_()
    ref = F.cross_entropy(Lr[..., :vocab_size].reshape(-1, vocab_size), target.reshape(-1), reduction="none").view(s, b)
    (ref * R).sum().backward()
    Lt = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(Lt, target, dist.group.WORLD, vocab_size)
    fp32 = dtype == torch.float32
    if fp32:
        close(loss, ref.detach())
    else:
        torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    (loss * R).sum().backward()
    if fp32:
        close(Lt.grad, Lr.grad.chunk(world, dim=-1)[rank])
    else:
        torch.testing.assert_close(Lt.grad.float(), Lr.grad.chunk(world, dim=-1)[rank], atol=1e-6, rtol=2 ** -7)
    if not fp32:
        return
    # --cross-entropy-loss-fusion (one all-reduce of both sums): the unfused loss and gradient within
    # 1e-6 in fp32 (the same operations; only the order of the sums' collectives differs)
    from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy
    Lf = Lt.detach().clone().requires_grad_()
    fused = fused_vocab_parallel_cross_entropy(Lf, target, dist.group.WORLD, vocab_size)
    (fused * R).sum().backward()
    torch.testing.assert_close(fused, loss.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(Lf.grad, Lt.grad, atol=1e-6, rtol=1e-6)


def _all_checks(rank, world):
    for gather in (True, False):
        _check_column(rank, world, gather, stride=1)
    _check_column(rank, world, False, stride=2)
    for parallel in (True, False):
        _check_row(rank, world, parallel)
    _check_embedding(rank, world)
    for vocab in (16, 11, 5):  # no padding; padding inside the last shard; whole shards of padding
        _check_cross_entropy(rank, world, vocab)
        _check_cross_entropy(rank, world, vocab, torch.bfloat16)
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


# -- gpt-oss's MLP (--quick-geglu --glu-linear-offset --activation-func-clamp-value) --------------------
def _gpt_oss_mlp_reference(y, offset, limit):
    """transformers' GptOssExperts, written out: gate and up clamped, up + offset times
    gate·sigmoid(1.702·gate)."""
    gate, up = y[..., : y.size(-1) // 2], y[..., y.size(-1) // 2:]
    if limit is not None:
        gate, up = torch.minimum(gate, torch.tensor(limit)), torch.maximum(torch.minimum(up, torch.tensor(limit)),
                                                                          torch.tensor(-limit))
    return (up + offset) * (gate * (1 / (1 + torch.exp(-1.702 * gate))))


@pytest.mark.parametrize("offset,limit", [(1.0, 7.0), (0.0, None), (0.5, 2.0)])
def test_quick_geglu_matches_the_formula_with_gradients(offset, limit):
    from megalite.model.config import GPTConfig
    from megalite.model.mlp import activation
    cfg = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=4, quick_geglu=True,
                    glu_linear_offset=offset, activation_func_clamp_value=limit)
    y = (_inputs(0, 6, 2, 32) * 6).requires_grad_()  # wide: values on both sides of the clamp
    y_ref = y.detach().clone().requires_grad_()
    out, ref = activation(cfg)(y), _gpt_oss_mlp_reference(y_ref, offset, limit)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    weights = _inputs(1, *out.shape)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(y.grad, y_ref.grad, atol=1e-6, rtol=1e-6)
    if limit is not None:  # the clamp acts: no gradient past it
        assert (y.grad[..., :16][y.detach()[..., :16] > limit] == 0).all()
        assert (y.detach()[..., :16] > limit).any()


def _quick_geglu_mlp(rank, world):
    """The MLP with --quick-geglu on `world` TP ranks (fc1 [gate; up] split with stride 2) against
    one process with the whole weights: output and every weight gradient."""
    import torch.distributed as dist
    from megalite.model.config import ExecutionConfig, GPTConfig
    from megalite.model.mlp import MLP
    cfg = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, ffn_hidden_size=16,
                    quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=1.5)
    whole = MLP(cfg, ExecutionConfig(), None)
    tp = MLP(cfg, ExecutionConfig(), dist.group.WORLD)
    with torch.no_grad():
        for (_, w), (_, p) in zip(whole.named_parameters(), tp.named_parameters()):
            w.copy_(_inputs(hash(w.shape) % 1000, *w.shape))
            p.copy_(shard(w, param_info(p), rank, world))
    x = _inputs(5, 3, 2, 8) * 3
    out_whole, out_tp = whole(x), tp(x)
    close(out_tp, out_whole)
    out_whole.square().sum().backward()
    out_tp.square().sum().backward()
    for (_, w), (_, p) in zip(whole.named_parameters(), tp.named_parameters()):
        close(p.grad, shard(w.grad, param_info(p), rank, world))
    return True


def test_quick_geglu_mlp_under_tp2_matches_one_process():
    assert all(spawn(_quick_geglu_mlp, 2))


@pytest.mark.parametrize("extra,message", [
    (["--quick-geglu", "--swiglu"], "--quick-geglu is the MLP's activation; --swiglu is another"),
    (["--glu-linear-offset", "1"], "--glu-linear-offset 1.0 applies to a gated MLP"),
    (["--activation-func-clamp-value", "7"], "--activation-func-clamp-value clamps --quick-geglu's inputs"),
    (["--quick-geglu", "--activation-func-clamp-value", "0"], "--activation-func-clamp-value must be a number > 0"),
])
def test_quick_geglu_refusals(extra, message):
    from megalite.arguments import parse_args, validate_args
    from megalite.errors import UserError
    from tiny import mock, tiny
    with pytest.raises(UserError) as e:
        validate_args(parse_args(tiny() + mock() + extra))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_quick_geglu_flags_reach_the_model():
    from megalite.arguments import parse_args, validate_args
    from megalite.model import GPTModel
    from megalite.model.config import GPTConfig
    from tiny import mock, tiny
    c = validate_args(parse_args(tiny() + mock() + ["--quick-geglu", "--glu-linear-offset", "1",
                                                   "--activation-func-clamp-value", "7"]))
    assert (c.model.quick_geglu, c.model.glu_linear_offset, c.model.activation_func_clamp_value) == (True, 1.0, 7.0)
    assert c.model.ffn_hidden_size == 4 * 64  # Megatron-LM's 8h/3 default is --swiglu's only
    model = GPTModel(GPTConfig(**dict(c.model.to_dict(), vocab_size=64, padded_vocab_size=64)))
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape == (2 * 4 * 64, 64)  # [gate; up]
