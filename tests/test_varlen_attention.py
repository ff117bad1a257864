"""The packed-document attention kernel (model/varlen_attention.py) against softmax with the dense
document mask written out: outputs, log-sum-exps and gradients (through both), for causal, sliding
window, GQA, keys out of sequence order (a CP layout) and queries that see no key; its dropout
against finite differences."""
import math

import pytest
import torch

from megalite.context_parallel.documents import Documents
from megalite.model.varlen_attention import document_attention
from tolerances import assert_close_fp32, assert_fp32_near_fp64


def dense_reference(q, k, v, mask):
    r = q.size(1) // k.size(1)
    k, v = (t.repeat_interleave(r, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, torch.logsumexp(scores, -1)


def packed_doc_ids(s=100):
    doc = torch.zeros(2, s, dtype=torch.long)
    doc[0, 30:], doc[0, 71:], doc[1, s // 2:] = 1, 2, 1  # documents crossing tile edges
    return doc


@pytest.mark.parametrize("case", ["causal", "window", "cp_layout"])
def test_matches_dense_mask(case):
    torch.manual_seed(0)
    s = 100
    q_index = k_index = torch.arange(s)
    window = 7 if case == "window" else None
    if case == "cp_layout":  # this rank's queries; keys in a scrambled order, some queries see none
        q_index, k_index = torch.arange(20, 80), torch.randperm(s)[:60]
    documents = Documents(packed_doc_ids(), q_index, k_index, window)
    q = torch.randn(2, 4, len(q_index), 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, len(k_index), 16, dtype=torch.float64, requires_grad=True)  # GQA: 2 heads a group
    v = torch.randn(2, 2, len(k_index), 8, dtype=torch.float64, requires_grad=True)  # MLA-like: dv != d
    out, lse = document_attention(q, k, v, documents, block=16)
    ref_out, ref_lse = dense_reference(q, k, v, documents.dense())
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if case == "cp_layout":
        assert not seen.all()  # the empty-row path is exercised
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-12, atol=1e-12)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * w_out).sum() + (lse.masked_fill(~seen, 0) * w_lse).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * w_out).sum() + (ref_lse.masked_fill(~seen, 0) * w_lse).sum(),
                                    (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_float32_and_dropout_gradients():
    torch.manual_seed(1)
    documents = Documents(packed_doc_ids(40), torch.arange(40), torch.arange(40))
    q, k, v = (torch.randn(2, h, 40, 8, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))

    def attend(q, k, v):
        torch.manual_seed(5)  # the same dropout seed at every evaluation
        return document_attention(q, k, v, documents, dropout_p=0.3, block=16)[0]
    assert torch.autograd.gradcheck(attend, (q, k, v), fast_mode=True)
    out = document_attention(*(t.float() for t in (q, k, v)), documents)[0]
    # fp32 against fp64 (tolerances.py): QK^T (8 terms), then the softmax and PV over 40 positions
    assert_fp32_near_fp64(out, dense_reference(q, k, v, documents.dense())[0], k=40, chain=3)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_core_attention_takes_documents(softmax_type):
    """CoreAttention given packed documents equals its local backend given their dense mask (with an
    attention sink merged through the log-sum-exp); [s, b, n, hn] in, [s, b, n·hn] out."""
    from megalite.model import ExecutionConfig
    from megalite.model.attention import CoreAttention
    torch.manual_seed(2)
    attention = CoreAttention(0.0, ExecutionConfig(attention_backend="local"), None, num_heads=4,
                              softmax_type=softmax_type, init_std=1.0)
    if softmax_type == "learnable":
        torch.nn.init.normal_(attention.softmax_offset)
    documents = Documents(packed_doc_ids(), torch.arange(100), torch.arange(100), window=20)
    q = torch.randn(100, 2, 4, 8, requires_grad=True)
    k, v = (torch.randn(100, 2, 2, 8, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, documents)
    ref = attention(q, k, v, documents.dense())
    # tiles against the whole row (tolerances.py): the softmax and PV over 100 positions; a key's or
    # value's gradient sums 100 queries of each of the 2 heads sharing it, a sink's 200 rows
    assert_close_fp32(out, ref, k=100, chain=3)
    w = torch.randn_like(out)
    params = [q, k, v] + list(attention.parameters())
    for got, want in zip(torch.autograd.grad((out * w).sum(), params), torch.autograd.grad((ref * w).sum(), params)):
        assert_close_fp32(got, want, k=200, chain=5)


def test_meta_tensors_give_shapes_for_the_dry_run():
    """megalite.dry_run runs the model on the meta device (the documents' ids stay on the CPU)."""
    documents = Documents(packed_doc_ids(), torch.arange(100), torch.arange(100))
    q = torch.empty(2, 4, 100, 8, device="meta", requires_grad=True)
    k, v = (torch.empty(2, 2, 100, 8, device="meta", requires_grad=True) for _ in range(2))
    out, lse = document_attention(q, k, v, documents, dropout_p=0.1)
    assert (out.shape, lse.shape, out.is_meta) == ((2, 4, 100, 8), (2, 4, 100), True)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
