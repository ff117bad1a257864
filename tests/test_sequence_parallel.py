"""Sequence parallelism (--sequence-parallel) computes the same function as plain tensor parallelism.

- dropout masks on sequence-sharded activations (embedding output, hidden dropout) differ per TP
  rank, masks on replicated activations agree (2 gloo ranks);
- TP=2 gradients with SP, after the TP all-reduce of `sequence_parallel` parameters, equal those
  without SP; with dropout > 0 every recompute mode under TP=2 (with and without SP) gives
  bit-identical gradients;
- model options (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output) under SP are covered by
  the gradient test.
That pretrain_gpt.py trains the same model as one process with SP (TP=2, and TP=2 x PP=2 x DP=2
with ZeRO-1 and full recompute) is in test_layouts.py.
"""
import pytest
import torch

from dist_helpers import spawn
from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.data.batch import build_batch
from megalite.model import GPTModel, model_configs
from megalite.tensor_parallel import seed_everything
from tolerances import fp32_atol, model_rounding

RECOMPUTE = {"none": {}, "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                                                 recompute_num_layers=1),
             "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
             "selective": dict(recompute_granularity="selective")}


def config(**kw):
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=90, padded_vocab_size=128,
                seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    return model_configs(**{**base, **kw})  # (GPTConfig, ExecutionConfig)


def run_model(cfg, group, rank, data, rng_seed=11, reduce_sp=False):
    """Loss and parameter gradients (by global name) of one forward/backward on this TP rank."""
    from megalite import comm
    from megalite.tensor_parallel.param_info import param_info
    model = GPTModel(cfg[0], group, seed_everything(rng_seed, rank, 0, torch.device("cpu")), execution=cfg[1])
    model.initialize(5)
    model.train()
    tracker = seed_everything(rng_seed, rank, 0, torch.device("cpu"))  # fresh RNG state after init
    for mod in model.modules():
        if hasattr(mod, "rng_tracker"):
            mod.rng_tracker = tracker
    loss = model(data["input_ids"], data["position_ids"], data["attention_mask"], data["labels"]).sum()
    loss.backward()
    out = {}
    for name, p in model.global_named_parameters():
        g = p.grad.clone()
        if reduce_sp and param_info(p).sequence_parallel:
            comm.all_reduce(g, group)  # what finalize_model_grads does
        out[name] = g
    return loss.detach(), out


def _worker(rank, world):
    import torch.distributed as dist
    group = dist.group.WORLD
    s, b = 16, 2
    result = {}

    # (a) dropout masks. Tokens of the second half repeat the first and RoPE adds no position
    # embedding, so both TP ranks' sequence shards hold identical values before dropout: only the
    # generator decides whether their masks differ.
    ids = torch.randint(1, 90, (b, s // 2), generator=torch.Generator().manual_seed(3)).repeat(1, 2)
    for sp in (False, True):
        cfg = config(hidden_dropout=0.5, position_embedding_type="rope", sequence_parallel=sp)
        model = GPTModel(cfg[0], group, seed_everything(7, rank, 0, torch.device("cpu")), execution=cfg[1])
        model.initialize(5)
        model.train()
        emb = model.embedding(ids, None)  # [s/tp, b, h] with SP, [s, b, h] without
        hidden = model.decoder.layers[0]._dropout(torch.ones_like(emb))
        result[f"embedding_mask_sp{sp}"] = emb == 0
        result[f"hidden_mask_sp{sp}"] = hidden == 0
        result[f"embedding_shape_sp{sp}"] = tuple(emb.shape)

    # the embedding's sequence shard owns its storage: a view would keep the whole [s, b, h] alive
    # for as long as the first layer norm keeps its input (dropout 0: no copy hides it)
    arch, execution = config(sequence_parallel=True, position_embedding_type="rope")
    emb = GPTModel(arch, group, execution=execution).embedding(ids, None)
    result["embedding_storage_elements"] = (emb.untyped_storage().nbytes() // emb.element_size(), emb.numel())

    # (b) SP with dropout 0: the same loss and (after the TP all-reduce) the same gradients
    data = build_batch(torch.randint(0, 90, (b, s + 1), generator=torch.Generator().manual_seed(0)))
    for variant, kw in (("base", {}), ("options", dict(position_embedding_type="rope", normalization="RMSNorm",
                                                       swiglu=True, num_query_groups=2, add_bias_linear=False,
                                                       untie_embeddings_and_output_weights=True))):
        loss_tp, g_tp = run_model(config(**kw), group, rank, data)
        loss_sp, g_sp = run_model(config(sequence_parallel=True, **kw), group, rank, data, reduce_sp=True)
        result[f"sp_loss_rel_{variant}"] = abs(float(loss_sp - loss_tp)) / abs(float(loss_tp))
        result[f"sp_grad_rel_{variant}"] = {n: float((g_sp[n] - g_tp[n]).abs().max() / g_tp[n].abs().max().clamp_min(1e-12))
                                            for n in g_tp}

    # (c) dropout > 0: every recompute mode, with and without SP, bit-identical to no recompute
    mismatches = []
    for sp in (False, True):
        ref_loss, ref = run_model(config(hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=sp),
                                  group, rank, data)
        for mode, rc in RECOMPUTE.items():
            loss, got = run_model(config(hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=sp, **rc),
                                  group, rank, data)
            if not torch.equal(loss, ref_loss):
                mismatches.append((sp, mode, "loss"))
            mismatches += [(sp, mode, n) for n in ref if not torch.equal(got[n], ref[n])]
    result["recompute_mismatches"] = mismatches
    return result


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, 2)


def test_dropout_masks_differ_per_tp_rank_only_on_sequence_shards(ranks):
    r0, r1 = ranks
    assert r0["embedding_shape_spTrue"] == (8, 2, 32) and r0["embedding_shape_spFalse"] == (16, 2, 32)
    for r in ranks:
        storage, numel = r["embedding_storage_elements"]
        assert storage == numel == 8 * 2 * 32
    for what in ("embedding", "hidden"):
        for r in ranks:  # dropout p = 0.5 really acts
            assert 0.3 < r[f"{what}_mask_spTrue"].float().mean() < 0.7
        # replicated activations: one mask on every TP rank, or the replicas drift apart
        assert torch.equal(r0[f"{what}_mask_spFalse"], r1[f"{what}_mask_spFalse"]), what
        # different tokens on each rank: each draws its own mask (the tracker's fork)
        assert not torch.equal(r0[f"{what}_mask_spTrue"], r1[f"{what}_mask_spTrue"]), what


@pytest.mark.parametrize("variant", ["base", "options"])
def test_sp_gradients_match_tp(ranks, variant):
    # sequence-sharded GEMMs and reduce-scatters sum in other orders than TP's (tests/tolerances.py):
    # 3 layers, reductions up to 128 terms (the padded vocabulary, the MLP), relative to the scale
    for r in ranks:
        assert r[f"sp_loss_rel_{variant}"] < fp32_atol(scale=1.0, **model_rounding(k=128, layers=3))
        worst = max(r[f"sp_grad_rel_{variant}"].items(), key=lambda kv: kv[1])
        assert worst[1] < fp32_atol(scale=1.0, **model_rounding(k=128, layers=3, backward=True)), worst


def test_recompute_bit_identical_under_tp2_with_and_without_sp(ranks):
    for r in ranks:
        assert r["recompute_mismatches"] == []


def test_sequence_parallel_flags():
    ok = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
    # TP = 1: switched off with a notice, as Megatron-LM does (its Llama-3 script passes it at TP = 1)
    args = validate_args(parse_args(ok + ["--seq-length", "16", "--sequence-parallel"]), 1)
    assert not args.parallel.sequence_parallel and any("--sequence-parallel switched off" in n for n in args.notices)
    with pytest.raises(ArgumentError, match=r"--seq-length \(15\) divisible by --tensor-model-parallel-size \(2\)"):
        validate_args(parse_args(ok + ["--seq-length", "15", "--max-position-embeddings", "16",
                                       "--sequence-parallel", "--tensor-model-parallel-size", "2"]), 2)
    assert validate_args(parse_args(ok + ["--seq-length", "16", "--sequence-parallel",
                                          "--tensor-model-parallel-size", "2"]), 4).parallel.sequence_parallel
