"""The 2026 attention's kernels against references written from their papers (issue 44): the gated
delta rule chunked = token by token (Yang et al. 2024, Eq. 10), its activation memory linear in the
sequence; DeepSeek Sparse Attention's top-k, sparse softmax and indexer loss against dense
formulas (DeepSeek-V3.2-Exp, Sec. 2.1), chunked = unchunked, memory O(s·k); the gated DeltaNet
and DSA models generate with their caches token for token as without. Cost: ~6 s."""
import math

import pytest
import torch

from megalite.model import dsa
from megalite.model.delta_rule import chunked_delta_rule, l2norm, recurrent_delta_rule
from megalite.recompute import SavedActivations
from tolerances import assert_fp32_near_fp64


def _delta_inputs(b=2, s=45, h=3, dk=8, dv=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(b, s, h, dk, generator=g, dtype=torch.float64)).to(dtype) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64).to(dtype)
    gate = (-torch.rand(b, s, h, generator=g, dtype=torch.float64) * 0.7).to(dtype)  # log decay <= 0
    beta = torch.rand(b, s, h, generator=g, dtype=torch.float64).to(dtype)
    state = torch.randn(b, h, dk, dv, generator=g, dtype=torch.float64).to(dtype) * 0.3
    return q, k, v, gate, beta, state


def delta_rule_fp64(q, k, v, g, beta, state):
    """Eq. 10 token by token in fp64: S_t = α_t S + β_t k_t (v_t - α_t Sᵀ k_t)ᵀ, o_t = S_tᵀ q_t / √dk."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.size(1)):
        a = g[:, t].exp()[..., None, None]
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, a * S)
        S = a * S + kt[..., None] * (beta[:, t, :, None] * (v[:, t] - pred))[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] / math.sqrt(q.size(-1)), S))
    return torch.stack(out, dim=1), S


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_delta_rule_equals_the_recurrence(chunk):
    q, k, v, g, beta, state = _delta_inputs()
    want_o, want_s = delta_rule_fp64(q, k, v, g, beta, state)
    o, s = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    ro, rs = recurrent_delta_rule(q, k, v, g, beta, state)
    # the chunked form's chain runs through the s / C state updates (plus the chunk's own solve and
    # output), each a sum of dk + C terms; the recurrence's through every token, dk terms each
    chain = -(-q.size(1) // chunk) + 2
    assert_fp32_near_fp64(o, want_o, k=q.size(-1) + chunk, chain=chain)
    assert_fp32_near_fp64(s, want_s, k=q.size(-1) + chunk, chain=chain)
    assert_fp32_near_fp64(ro, want_o, k=q.size(-1), chain=q.size(1))
    assert_fp32_near_fp64(rs, want_s, k=q.size(-1), chain=q.size(1))
    # a 1e-3 change of one gate moves the result past the bound (the test can fail)
    g2 = g.clone()
    g2[0, 3, 1] += 1e-3
    with pytest.raises(AssertionError):
        assert_fp32_near_fp64(chunked_delta_rule(q, k, v, g2, beta, state, chunk=chunk)[0], want_o,
                              k=q.size(-1) + chunk, chain=chain)


def test_chunked_delta_rule_gradients_equal_the_recurrence():
    inputs = [t.double().requires_grad_() for t in _delta_inputs(s=21)]
    want = torch.autograd.grad(delta_rule_fp64(*inputs)[0].square().sum(), inputs)
    got_inputs = [t.detach().float().requires_grad_() for t in inputs]
    o, _ = chunked_delta_rule(*got_inputs, chunk=8)
    got = torch.autograd.grad(o.square().sum(), got_inputs)
    for a, b, name in zip(got, want, ("q", "k", "v", "g", "beta", "state")):
        assert_fp32_near_fp64(a, b, k=64, chain=21, msg=name)


# packed documents: sample 0's start at 0, 7 (inside the first chunk), 16 (a chunk start of C = 8
# and 16) and 30; sample 1's at 0, 1 (a one-token document) and 24
STARTS = [[0, 7, 16, 30], [0, 1, 24]]


def _doc_ids(starts, s):
    seg = torch.zeros(len(starts), s, dtype=torch.long)
    for i, first in enumerate(starts):
        for t in first[1:]:
            seg[i, t:] += 1
    return seg


@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_delta_rule_starts_again_at_each_document(chunk):
    """--reset-attention-mask: with each token's document given, every document's output (and its
    gradients) is the recurrence run on that document alone, from a zero state; the first document
    takes the initial state. Without the documents the outputs differ (the test can fail)."""
    inputs = [t.double().requires_grad_() for t in _delta_inputs(s=45)]
    q, k, v, g, beta, state = inputs
    seg = _doc_ids(STARTS, 45)
    got_inputs = [t.detach().float().requires_grad_() for t in inputs]
    o, _ = chunked_delta_rule(*got_inputs, chunk=chunk, seg=seg)
    want = torch.zeros_like(o, dtype=torch.float64)
    for i, first in enumerate(STARTS):
        for n, (lo, hi) in enumerate(zip(first, first[1:] + [45])):
            alone = (t[i:i + 1, lo:hi] for t in (q, k, v, g, beta))
            s0 = state[i:i + 1] if n == 0 else torch.zeros_like(state[i:i + 1])
            want[i, lo:hi] = delta_rule_fp64(*alone, s0)[0][0]
    chain = -(-45 // chunk) + 2
    assert_fp32_near_fp64(o, want, k=q.size(-1) + chunk, chain=chain)
    assert_fp32_near_fp64(recurrent_delta_rule(*got_inputs, seg=seg)[0], want, k=q.size(-1), chain=45)
    grads = torch.autograd.grad(o.square().sum(), got_inputs)
    for a, b, name in zip(grads, torch.autograd.grad(want.square().sum(), inputs), ("q", "k", "v", "g", "beta", "state")):
        assert_fp32_near_fp64(a, b, k=64, chain=45, msg=name)
    with pytest.raises(AssertionError):
        assert_fp32_near_fp64(chunked_delta_rule(*got_inputs, chunk=chunk)[0], want, k=q.size(-1) + chunk, chain=chain)


def test_deltanet_model_computes_each_packed_document_alone():
    """A Qwen3-Next-shaped hybrid (DeltaNet and gated softmax layers) given packed documents
    (Documents, positions restarting per document) gives each document's tokens the logits the
    document alone gets: the convolution and the state stop at document starts."""
    from megalite.context_parallel.documents import Documents
    from megalite.model import GPTConfig, GPTModel
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=2, kv_channels=8, vocab_size=64, padded_vocab_size=64, seq_length=45,
                       max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                       ffn_hidden_size=40, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
                       linear_attention_freq="2", linear_conv_kernel_dim=4, linear_key_head_dim=6,
                       linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4)
    model = GPTModel(config)
    model.initialize(5)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(4))
    seg = _doc_ids(STARTS, 45)
    pos = torch.stack([torch.cat([torch.arange(hi - lo) for lo, hi in zip(f, f[1:] + [45])]) for f in STARTS])
    index = torch.arange(45)
    with torch.no_grad():
        packed = model(ids, pos, Documents(seg, index, index))  # [s, b, v]
        plain = model(ids, pos, Documents(torch.zeros_like(seg), index, index))
        for i, first in enumerate(STARTS):
            for lo, hi in zip(first, first[1:] + [45]):
                alone = model(ids[i:i + 1, lo:hi], pos[i:i + 1, lo:hi])[:, 0]
                torch.testing.assert_close(packed[lo:hi, i], alone, rtol=1e-5, atol=1e-5)
    assert (packed - plain).abs().max() > 1e-3  # one document for all: the later documents see the earlier


def _saved_bytes(fn, *shape_args):
    with SavedActivations() as saved:
        fn(*shape_args)
    return saved.nbytes()


def test_delta_rule_activation_memory_is_linear_in_the_sequence():
    """What backward keeps for s = 256, 512, 1024 grows by equal steps per token (an [s, s] term
    would quadruple its share); benchmarks/bench_attention_2026_memory.py measures to 16k."""
    def run(s):
        q, k, v, g, beta, _ = (t.requires_grad_() for t in _delta_inputs(b=1, s=s, h=2, dk=16, dv=16))
        chunked_delta_rule(q, k, v, g, beta)
    sizes = [_saved_bytes(run, s) for s in (256, 512, 1024)]
    # affine in s: each doubling adds twice what the previous one added (the constant: the chunk's masks)
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0]) and sizes[0] < 2 * (sizes[1] - sizes[0]), sizes


# -- DSA ---------------------------------------------------------------------------------------------
def _dsa_inputs(s=20, b=2, n=3, d=6, dv=4, H=2, D=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return dict(q=r(s, b, n, d), k=r(s, b, n, d), v=r(s, b, n, dv), iq=r(s, b, H, D), ik=r(s, b, D),
                iw=r(s, b, H).abs())


def _dense_index_scores(iq, ik, iw):
    """I[b, t, s] = Σ_h w[t, h] ReLU(q_I[t, h] · k_I[s]), causal (-inf past t), in fp64."""
    relu = torch.einsum("tbhd,sbd->bths", iq.double(), ik.double()).relu()
    scores = torch.einsum("bths,tbh->bts", relu, iw.double())
    s = iq.size(0)
    return scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))


def test_select_topk_picks_the_highest_index_scores():
    x = _dsa_inputs()
    pos = torch.arange(20)
    idx = dsa.select_topk(x["iq"], x["ik"], x["iw"], pos, pos, 5)
    scores = _dense_index_scores(x["iq"], x["ik"], x["iw"])
    want = scores.topk(5, dim=-1).values
    got = scores.gather(-1, idx)
    assert torch.equal(got.isinf(), want.isinf())  # early queries: their few keys and -inf fill
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], rtol=1e-6)


def test_sparse_attention_over_every_key_is_dense_causal_attention():
    x = _dsa_inputs()
    s, b, n = 20, 2, 3
    pos = torch.arange(s)
    idx = torch.arange(s).expand(b, s, s)  # every key (those past each query are masked)
    got = dsa.sparse_attention(x["q"], x["k"], x["v"], idx, pos, 0.4)
    scores = torch.einsum("tbnd,sbnd->bnts", x["q"].double(), x["k"].double()) * 0.4
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bnts,sbnd->tbnd", scores.softmax(-1), x["v"].double()).reshape(s, b, -1)
    assert_fp32_near_fp64(got, want, k=s, chain=2)


def _indexer_loss_fp64(x, idx, scale, coeff, sparse):
    """coeff · mean over queries of KL(p || softmax(I)), p the dense attention summed over heads."""
    s = x["q"].size(0)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    dense = torch.einsum("tbnd,sbnd->bnts", x["q"].double(), x["k"].double()) * scale
    dense = dense.masked_fill(causal, float("-inf"))
    index = _dense_index_scores(x["iq"], x["ik"], x["iw"])
    if sparse:
        keep = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, idx, True)
        dense, index = dense.masked_fill(~keep[:, None], float("-inf")), index.masked_fill(~keep, float("-inf"))
    p = dense.softmax(-1).sum(1)
    p = p / p.sum(-1, keepdim=True)
    log_q = index.log_softmax(-1)
    kl = torch.where(p > 0, p * (p.log() - log_q), torch.zeros_like(p)).sum()
    return kl * coeff / (x["q"].size(1) * s)


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_and_its_gradient(sparse, monkeypatch):
    x = _dsa_inputs()
    pos = torch.arange(20)
    idx = dsa.select_topk(x["iq"], x["ik"], x["iw"], pos, pos, 7)
    leaves = {n: x[n].double().requires_grad_() for n in ("iq", "ik", "iw")}
    want = _indexer_loss_fp64({**x, **leaves}, idx, 0.4, 0.3, sparse)
    want_grads = torch.autograd.grad(want, list(leaves.values()))
    for budget in (dsa.CHUNK_ELEMENTS, 64):  # one chunk; and a few query rows per chunk
        monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", budget)
        got_leaves = [x[n].clone().requires_grad_() for n in ("iq", "ik", "iw")]
        loss = dsa.indexer_loss(*got_leaves, x["q"], x["k"], idx, pos, pos, 0.4, 0.3, sparse, None)
        # the 1e-10 inside each log (Megatron-LM's) and the sums over s keys and heads
        value, ref_value = float(loss.detach()), float(want.detach())
        assert abs(value - ref_value) < 1e-6 * max(1.0, ref_value), (value, ref_value)
        for got, ref in zip(torch.autograd.grad(loss, got_leaves), want_grads):
            assert torch.allclose(got.double(), ref, atol=1e-6, rtol=1e-4)


def test_sparse_attention_memory_grows_with_s_times_k():
    """Saved for backward at a fixed top-k: doubling s doubles it (no [s, s] tensor kept)."""
    def run(s):
        x = _dsa_inputs(s=s, b=1, n=2, d=16, dv=16)
        q, k, v = (x[n].requires_grad_() for n in ("q", "k", "v"))
        pos = torch.arange(s)
        idx = dsa.select_topk(x["iq"], x["ik"], x["iw"], pos, pos, 16)
        dsa.sparse_attention(q, k, v, idx, pos, 0.25)
    sizes = [_saved_bytes(run, s) for s in (256, 512, 1024)]
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 2 * sizes[1], sizes


# -- generation --------------------------------------------------------------------------------------
def test_dsa_model_generates_the_same_with_its_cache():
    """The cache keeps the latent, the rotated key and the indexer's keys: cached greedy decoding
    equals recomputing the whole sequence each step (top-k smaller than the sequence)."""
    from megalite.generation import generate, next_token_logits
    from megalite.model import GPTConfig, GPTModel
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                       seq_length=48, max_position_embeddings=48, hidden_dropout=0.0, attention_dropout=0.0,
                       init_method_std=0.2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       add_bias_linear=False, ffn_hidden_size=48, multi_latent_attention=True, q_lora_rank=24,
                       kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                       experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=12,
                       dsa_indexer_topk=5)
    model = GPTModel(config)
    model.initialize(3)
    model.eval()
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    cached = generate(model, prompt, 16, greedy=True)
    assert cached == generate(model, prompt, 16, greedy=True, use_cache=False)
    # the sparse choice matters: all keys (top-k = s) give other logits
    ids = torch.tensor([prompt + cached])
    sparse = next_token_logits(model, ids)
    for m in model.modules():
        if isinstance(m, dsa.DSAttention):
            m.topk = 10 ** 6
    assert (next_token_logits(model, ids) - sparse).abs().max() > 1e-3
