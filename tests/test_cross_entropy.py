"""The vocabulary-parallel cross entropy keeps one logits-sized tensor for backward: the fp32
softmax for fp32 logits, the logits themselves for 16-bit ones (whose softmax is recomputed in
fp32 on slices of rows, so no fp32 copy of the whole logits ever exists); slicing changes
nothing in the result. (Equality with F.cross_entropy over TP 1, 2, 4 and every padding
case: tests/test_tensor_parallel.py.)"""
import pytest
import torch
import torch.nn.functional as F

import megalite.tensor_parallel.cross_entropy as ce
from megalite.tensor_parallel import vocab_parallel_cross_entropy

S, B, V, VOCAB = 7, 3, 64, 50  # 14 padded columns


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, B, V, generator=g) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    weight = torch.rand(S, B, generator=g)
    return logits, target, weight


def _loss_and_grad(dtype, **kw):
    logits, target, weight = _case(dtype)
    loss = vocab_parallel_cross_entropy(logits, target, None, VOCAB)
    (loss * weight).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_of_rows_change_nothing(monkeypatch, dtype):
    whole_loss, whole_grad = _loss_and_grad(dtype)
    monkeypatch.setattr(ce, "chunk_elements", lambda device: 4 * VOCAB + 3)  # 4 rows per slice: 21 rows -> 6
    loss, grad = _loss_and_grad(dtype)
    assert torch.equal(loss, whole_loss) and torch.equal(grad, whole_grad)
    assert grad[..., VOCAB:].abs().max() == 0  # padded columns get no gradient


def test_pointwise_gradient_equals_the_scatter_form():
    """The gradient pass --compile fuses (the one-hot as a comparison, the whole logits at once)
    computes what the eager pass does: the same fp32 values, rounded once to bf16."""
    logits, target, weight = _case(torch.bfloat16)
    whole = ce.LossKernels(ce._sum_exp_pointwise, ce._compiled_grad(ce._softmax_grad_pointwise), whole=True)
    results = []
    for kernels in (ce.EAGER, whole):
        x = logits.detach().clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, None, VOCAB, kernels=kernels)
        (loss * weight).sum().backward()
        results.append((loss.detach(), x.grad))
    # the same fp32 sum (a fused reduction may order it differently: fp32 rounding of |loss| < 20),
    # and the softmax before the one bf16 rounding (at most one bf16 ulp apart)
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(results[1][1].float(), results[0][1].float(), atol=1e-6, rtol=2 ** -7)
    assert results[1][1][..., VOCAB:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_one_logits_sized_tensor(dtype):
    logits, target, _ = _case(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vocab_parallel_cross_entropy(logits, target, None, VOCAB)
    big = [t for t in saved if t.numel() >= S * B * VOCAB]
    assert len(big) == 1 and big[0].dtype == dtype
    if dtype == torch.float32:  # the softmax, in place of the logits (which autograd may free)
        assert big[0].data_ptr() != logits.data_ptr()
    else:  # the 16-bit logits themselves: no fp32 [s, b, v] tensor is kept
        assert big[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved if t is not big[0]) <= 32 * S * B  # row statistics


def test_bf16_matches_fp32_reference():
    logits, target, weight = _case(torch.float32)
    ref = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(S, B)
    (ref * weight).sum().backward()
    loss, grad = _loss_and_grad(torch.bfloat16)
    assert grad.dtype == torch.bfloat16
    # the loss is computed in fp32 from bf16-rounded logits
    bf16_ref = F.cross_entropy(logits.detach().bfloat16().float()[..., :VOCAB].reshape(-1, VOCAB),
                               target.reshape(-1), reduction="none").view(S, B)
    torch.testing.assert_close(loss, bf16_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.float(), logits.grad, atol=2e-3, rtol=2e-2)


def test_overwritten_logits_hold_the_softmax_and_change_nothing():
    """`overwrite_logits` (the model's loss): fp32 logits that are an intermediate become their
    softmax in place, with the same loss and gradients as the softmax in a new tensor; a leaf
    that requires a gradient, or a view, is never overwritten."""
    x, target, weight = _case(torch.float32)
    results = []
    for overwrite in (False, True):
        leaf = x.detach().clone().requires_grad_()
        logits = leaf * 1.0  # an intermediate, as the output layer's product
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = vocab_parallel_cross_entropy(logits, target, None, VOCAB, overwrite_logits=overwrite)
        in_place = any(t.data_ptr() == logits.data_ptr() for t in saved)
        assert in_place == overwrite
        if overwrite:
            torch.testing.assert_close(logits[..., :VOCAB].sum(-1), torch.ones(S, B))
            assert logits[..., VOCAB:].abs().max() == 0
        (loss * weight).sum().backward()
        results.append((loss.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    leaf = x.detach().clone().requires_grad_()
    vocab_parallel_cross_entropy(leaf, target, None, VOCAB, overwrite_logits=True)
    vocab_parallel_cross_entropy(leaf.view(S, B, V), target, None, VOCAB, overwrite_logits=True)
    assert torch.equal(leaf, x.detach())


def test_fused_loss_compiles_its_passes_only_where_inductor_makes_gpu_kernels(monkeypatch):
    """--cross-entropy-loss-fusion without --compile: the passes above compiled (whole logits, one
    kernel each) on CUDA with Triton; eager on the CPU and where Triton is missing."""
    import torch.utils._triton as triton_utils
    assert ce.fused_loss_kernels(torch.device("cpu")) is ce.EAGER
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    assert ce.fused_loss_kernels(torch.device("cuda")) is ce.EAGER
    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    kernels = ce.fused_loss_kernels(torch.device("cuda"))  # compiled lazily: nothing runs here
    assert kernels.whole and kernels.sum_exp is not ce._sum_exp
