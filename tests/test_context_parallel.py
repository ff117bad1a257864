"""Context parallelism (context_parallel/) computes full attention exactly.

- the load-balanced chunk order: rank r holds chunks r and 2c-1-r of 2c, and the ranks' chunks
  tile the sequence;
- CP attention (K/V all-gathered over 2 or 4 gloo ranks, mask in global positions) equals full
  attention in output and in the gradients of q, k and v, for a causal mask and for document
  masks (--reset-attention-mask), with GQA, through SDPA and the local backend;
- a whole GPT (RoPE, GQA, reset position ids and attention mask) on CP ranks: the per-token
  losses and, summed over the CP group, the parameter gradients equal one process's.
That pretrain_gpt.py trains the same model as one process under CP (with TP, SP, PP, VPP, ZeRO-1,
recompute) is in test_layouts.py.
"""

import pytest
import torch

from dist_helpers import spawn
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.data.batch import build_batch
from megalite.context_parallel.sharding import chunk_positions, gathered_positions, slice_batch
from tolerances import assert_close_fp32

# fp32 rounding of another summation order (tests/tolerances.py). Attention: QK^T (8 terms), the
# softmax and PV (32 positions); a key's or value's gradient sums 32 queries of each head sharing
# it. The GPT: two such layers with their 32- and 128-term projections, the loss; the gradients
# run that chain back, the weights' summing 64 tokens (the CP group's all-reduce included)
ATTENTION_ROUNDING = dict(k=128, chain=5)
GPT_LOSS_ROUNDING, GPT_GRAD_ROUNDING = dict(k=128, chain=12), dict(k=128, chain=24)


def test_chunk_order_is_load_balanced():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for c in (1, 2, 4):
        assert sorted(gathered_positions(32, c).tolist()) == list(range(32))
        # every rank has the same number of (query, key) pairs under the causal mask
        work = {int((chunk_positions(32, c, r) + 1).sum()) for r in range(c)}
        assert len(work) == 1
    with pytest.raises(ValueError, match="divisible"):
        chunk_positions(12, 4, 0)


def _documents(b, s, seed):
    """tokens [b, s + 1] with end-of-document (id 0) every few tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (b, s + 1), generator=g)


def _attention_worker(rank, world):
    return {(reset, backend): _cp_attention(rank, world, reset, backend)
            for reset in (False, True) for backend in ("auto", "local")}


def _cp_attention(rank, world, reset, backend):
    import torch.distributed as dist

    from megalite.model import ExecutionConfig
    from megalite.model.attention import CoreAttention
    from megalite.context_parallel.attention import gather_kv
    from megalite.context_parallel.sharding import causal_mask
    group = dist.group.WORLD
    s, b, n, g, hn = 32, 2, 4, 2, 8
    torch.manual_seed(0)
    q, w = torch.randn(s, b, n, hn), torch.randn(s, b, n * hn)
    k, v = torch.randn(s, b, g, hn), torch.randn(s, b, g, hn)
    full = build_batch(_documents(b, s, 3), eod=0, reset_attention_mask=reset)
    attention = CoreAttention(0.0, ExecutionConfig(attention_backend=backend), None)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = attention(*ref, full["attention_mask"])
    (out_ref * w).sum().backward()

    idx = chunk_positions(s, world, rank)
    local = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    k_all, v_all = gather_kv(local[1], local[2], group)
    mask = slice_batch(full, world, rank)["attention_mask"]
    if mask is None:
        mask = causal_mask(s // world, world, rank)
    out = attention(local[0], k_all, v_all, mask)
    (out * w[idx]).sum().backward()
    return {"out": (out.detach(), out_ref.detach()[idx]),
            **{name: (loc.grad, r.grad[idx]) for name, loc, r in zip("qkv", local, ref)}}


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_full_attention(world):
    """Causal and document masks, SDPA and the local backend: one spawn per CP size."""
    for rank, results in enumerate(spawn(_attention_worker, world)):
        assert len(results) == 4
        for (reset, backend), result in results.items():
            for what, (got, want) in result.items():
                assert_close_fp32(got, want, **ATTENTION_ROUNDING, msg=f"rank {rank} reset {reset} {backend} {what}")


def _model_worker(rank, world):
    return {reset: _cp_model(rank, world, reset) for reset in (False, True)}


def _cp_model(rank, world, reset):
    import torch.distributed as dist

    from megalite import comm
    from megalite.model import GPTConfig, GPTModel
    group = dist.group.WORLD
    s, b = 32, 2
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=6,
                    padded_vocab_size=8, seq_length=s, max_position_embeddings=s, hidden_dropout=0.0,
                    attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    full = build_batch(_documents(b, s, 4), eod=0, reset_position_ids=reset, reset_attention_mask=reset)
    grads = []
    for cp_group, batch in ((None, full), (group, slice_batch(full, world, rank))):
        model = GPTModel(cfg, cp_group=cp_group)
        model.initialize(5)
        losses = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"])
        losses.sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.global_named_parameters()})
        if cp_group is None:
            ref_losses = losses.detach()
    for g in grads[1].values():
        comm.all_reduce(g, group)
    return losses.detach(), ref_losses[:, chunk_positions(s, world, rank)], grads[1], grads[0]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_gpt_equals_one_process(world):
    """Plain causal, and reset position ids + document masks."""
    for results in spawn(_model_worker, world):
        for reset, (losses, ref_losses, grads, ref_grads) in results.items():
            assert_close_fp32(losses, ref_losses, **GPT_LOSS_ROUNDING)
            assert grads.keys() == ref_grads.keys()
            for name in grads:
                assert_close_fp32(grads[name], ref_grads[name], **GPT_GRAD_ROUNDING, msg=f"reset {reset} {name}")


def test_validate_args_fills_and_refuses_cp():
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64"]
    args = validate_args(parse_args(base + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]), 8)
    assert (args.parallel.data_parallel_size, args.parallel.rank_order) == (2, "tp-cp-dp-pp")
    args = validate_args(parse_args(base + ["--context-parallel-size", "2", "--use-tp-pp-dp-mapping"]), 2)
    assert (args.parallel.data_parallel_size, args.parallel.rank_order) == (1, "tp-cp-pp-dp")
    with pytest.raises(ArgumentError, match="cannot be combined with --use-flash-attn"):
        validate_args(parse_args(base + ["--context-parallel-size", "2", "--use-flash-attn"]), 2)
    with pytest.raises(ArgumentError, match=r"--seq-length \(64\) divisible by 2 x CP = 128"):
        validate_args(parse_args(base + ["--context-parallel-size", "64"]), 64)
