"""The flags Megatron-LM's test configurations brought (docs/megatron.md, "Megatron-LM's functional
tests"), each checked against its meaning there in one process: the routing, attention and MLP
variants against formulas written out, the stage layouts against Megatron-LM's layer counting,
the checkpoint machinery's pieces against the tensors they cut, and the validation rules."""
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import ArgumentError, parse_args, validate_args
from tiny import mock, tiny

BASE = mock(100) + tiny(hidden_size=32, seq_length=16, global_batch_size=None, train_iters=4, eval_iters=0)


def args_of(extra, world=1):
    return validate_args(parse_args(BASE + extra), world)


# -- routing ------------------------------------------------------------------------------------
def megatron_sinkhorn(cost, tol=1e-4):
    """Megatron-LM's moe_utils.sinkhorn, as written there."""
    cost = torch.exp(cost)
    d0, d1 = torch.ones(cost.size(0)), torch.ones(cost.size(1))
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_routing_is_megatrons(k):
    from megalite.model.moe.router import sinkhorn, sinkhorn_routing
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(k)) * 3
    assert torch.allclose(sinkhorn(logits), megatron_sinkhorn(logits))
    balanced = sinkhorn(logits)
    assert torch.allclose(balanced.sum(1), torch.full((64,), 1 / 64), rtol=1e-2)  # each token's mass 1/T
    probs, idx = sinkhorn_routing(logits, k, training=True)
    weights = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, -1)
    assert torch.equal(idx, torch.topk(megatron_sinkhorn(logits), k, dim=1).indices)
    assert torch.equal(probs, weights.gather(1, idx))
    _, eval_idx = sinkhorn_routing(logits, k, training=False)
    assert torch.equal(eval_idx, torch.topk(weights, k, dim=1).indices)
    with pytest.raises(ArgumentError, match="sinkhorn balances by its routing"):
        args_of(["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"])


def test_global_aux_loss_averages_the_loads_over_the_iteration():
    from megalite.model.moe.router import GlobalAuxLoss, load_balancing_loss
    loss = GlobalAuxLoss()
    loss.reset(None)
    g = torch.Generator().manual_seed(0)
    scores = [torch.softmax(torch.randn(12, 4, generator=g), -1) for _ in range(2)]
    onehot = [torch.zeros(12, 4).scatter_(1, torch.topk(s, 2, dim=1).indices, 1.0) for s in scores]
    first = loss(scores[0], onehot[0], None, (6, 2), 2, 0.1)
    second = loss(scores[1], onehot[1], None, (6, 2), 2, 0.1)
    assert torch.allclose(first, load_balancing_loss(scores[0], onehot[0].sum(0), 12, 2, 0.1))
    mean_counts = (onehot[0].sum(0) + onehot[1].sum(0)) / 2  # Megatron-LM's running average (ga_steps)
    assert torch.allclose(second, load_balancing_loss(scores[1], mean_counts, 12, 2, 0.1))


# -- attention and MLP ----------------------------------------------------------------------------
def test_query_key_layer_scaling_computes_the_same_attention():
    from megalite.model.attention import local_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    plain = local_attention(q, k, v)
    assert torch.allclose(local_attention(q, k, v, layer_coeff=7), plain, atol=1e-6)
    q16, k16, v16 = (t.half() * 30 for t in (q, k, v))  # fp16 scores past its range without the guard
    guarded = local_attention(q16, k16, v16, softmax_in_fp32=True, layer_coeff=24)
    assert torch.isfinite(guarded).all()
    c = args_of(["--apply-query-key-layer-scaling", "--attention-backend", "local"])
    assert c.kernels.attention_softmax_in_fp32  # as Megatron-LM's validate_args


def test_squared_relu_mlp():
    from megalite.model.mlp import activation
    from megalite.config.model import GPTConfig
    y = torch.randn(5, 7)
    assert torch.equal(activation(GPTConfig(squared_relu=True))(y), F.relu(y) ** 2)
    with pytest.raises(ArgumentError, match="--squared-relu is the MLP's activation; --swiglu"):
        args_of(["--squared-relu", "--swiglu"])


def roformer_rope(t, pos, base=10000.0):
    """RoFormer's RoPE (Su et al. 2021, Eq. 13): pairs (2i, 2i+1) rotated by pos · base^(-2i/d)."""
    d = t.size(-1)
    freqs = pos[:, None].float() / base ** (torch.arange(0, d, 2).float() / d)  # [s, d/2]
    x1, x2 = t[..., 0::2], t[..., 1::2]
    cos, sin = freqs.cos()[:, None, None, :], freqs.sin()[:, None, None, :]
    out = torch.empty_like(t)
    out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return out


def test_rotary_interleaved_is_roformers_pairing():
    from megalite.model.attention import RotaryEmbedding, apply_rotary, deinterleave
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 1, 2, 8, generator=g), torch.randn(6, 1, 2, 8, generator=g)
    cos, sin = RotaryEmbedding(8)(torch.arange(6)[None])
    ours = torch.einsum("sbnd,tbnd->nst", apply_rotary(deinterleave(q, 8), cos, sin),
                        apply_rotary(deinterleave(k, 8), cos, sin))
    ref = torch.einsum("sbnd,tbnd->nst", roformer_rope(q, torch.arange(6)), roformer_rope(k, torch.arange(6)))
    assert torch.allclose(ours, ref, atol=1e-5)


def test_recompute_modules_keep_the_gradients():
    """Each --recompute-modules part recomputed in backward gives the same loss and gradients,
    dropout included (the RNG tracker's states restored)."""
    from megalite.model import ExecutionConfig, GPTModel
    from megalite.tensor_parallel.random import RNGTracker
    import dataclasses

    def grads(modules):
        extra = ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32", "--attention-dropout", "0.1",
                 "--hidden-dropout", "0.1"]
        if modules:
            extra += ["--recompute-granularity", "selective", "--recompute-modules", *modules]
        c = args_of(extra)
        cfg = dataclasses.replace(c.model, vocab_size=64, padded_vocab_size=64)
        tracker = RNGTracker()
        tracker.add("model-parallel-rng", 1)
        model = GPTModel(cfg, None, tracker, execution=ExecutionConfig.from_configs(c.optimizer, c.parallel,
                                                                                    c.recompute, c.kernels))
        model.initialize(seed=3)
        model.train()
        ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        model(ids[:, :-1], torch.arange(16).expand(2, 16), None, ids[:, 1:]).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(None)
    for modules in (["layernorm", "core_attn"], ["moe"], ["shared_experts", "moe_act"]):
        got = grads(modules)
        assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref), modules
    with pytest.raises(ArgumentError, match="mla_up_proj needs --multi-latent-attention"):
        args_of(["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"])


# -- pipeline stages ------------------------------------------------------------------------------
def megatron_layers(n, pp, v, first=None, last=None, emb=False, loss=False):
    """Layers of each (virtual) stage k = chunk k // pp of rank k % pp, as Megatron-LM's
    get_num_layers_to_build counts them."""
    out = []
    for k in range(pp * v):
        rank, chunk = k % pp, k // pp
        if first is not None or last is not None:
            middle = pp - (first is not None) - (last is not None)
            rest = n - (first or 0) - (last or 0)
            per = rest // middle if middle else 0
            per = first if rank == 0 and first is not None else last if rank == pp - 1 and last is not None else per
        else:
            per = (n + emb + loss) // pp
        build = per // v
        build -= int(emb and rank == 0 and chunk == 0) + int(loss and rank == pp - 1 and chunk == v - 1)
        out.append(build)
    return out


@pytest.mark.parametrize("flags,expected", [
    (["--num-layers", "12", "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "1",
      "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     megatron_layers(12, 4, 1, first=2, last=2)),
    (["--num-layers", "14", "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
     megatron_layers(14, 4, 2, emb=True, loss=True)),
])
def test_uneven_stages_are_megatrons(flags, expected):
    from megalite.config.pipeline_layout import layout_of
    c = args_of(flags + ["--global-batch-size", "8", "--micro-batch-size", "1"], world=4)
    layout = layout_of(c.parallel.pipeline_model_parallel_layout, 4)
    assert [st.count("t") for st in layout.stages] == expected
    assert c.parallel.virtual_pipeline_model_parallel_size == len(expected) // 4


def test_schedule_table_is_megatrons():
    from megalite.pipeline_parallel.schedules import schedule_table
    # Megatron-LM's docstring example: PP2 N3 M5 VP2
    assert [mb for mb, _ in schedule_table(5, 2, 3)] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in schedule_table(5, 2, 3)] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


# -- data-parallel instances ----------------------------------------------------------------------
def test_distributed_optimizer_instances_are_consecutive_ranks():
    from megalite.parallel_state import across_instances, split_instances
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert split_instances(groups, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert across_instances(groups, 2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ArgumentError, match="needs a sharded strategy"):
        args_of(["--num-distributed-optimizer-instances", "2"], world=4)
    c = args_of(["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--bf16"], world=4)
    assert c.ddp.data_parallel_sharding_strategy == "optim_grads_params" and c.ddp.grad_reduce_in_bf16


# -- checkpoint machinery -------------------------------------------------------------------------
def test_piece_boxes_cut_the_global_tensor():
    """A flat range of a TP shard (SwiGLU's strided fc1 included) as boxes of the whole tensor:
    every element lands where the whole tensor has it."""
    from megalite.checkpoint.megatron.saver import piece_boxes
    from megalite.model.init import shard
    from megalite.tensor_parallel.param_info import param_info
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    for dim, stride in ((0, 2), (1, 1), (0, 1)):
        p = torch.nn.Parameter(torch.empty(8 // (2 if dim == 0 else 1), 6 // (2 if dim == 1 else 1)))
        info = param_info(p)
        info.tensor_parallel, info.partition_dim, info.partition_stride = True, dim, stride
        for rank in range(2):
            local = shard(full, info, rank, 2).reshape(-1)
            for lo, hi in ((0, local.numel()), (5, 19)):
                for offsets, sizes, start in piece_boxes(p, lo, hi, rank, 2):
                    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                    assert torch.equal(block.reshape(-1), local[lo + start:lo + start + block.numel()])


def test_retain_interval_and_integrity(tmp_path):
    from megalite.checkpoint.files import verify_integrity
    from megalite.checkpoint.paths import iteration_dir, retire_previous, write_integrity
    from megalite.errors import CheckpointError
    root = str(tmp_path)
    for it in (2, 4, 6):
        os.makedirs(iteration_dir(root, it))
    assert retire_previous(root, 2, 4, 4) == 2 and not os.path.exists(iteration_dir(root, 2))
    assert retire_previous(root, 4, 6, 4) is None and os.path.exists(iteration_dir(root, 4))  # a multiple: kept
    d = iteration_dir(root, 6)
    for name in ("a.distcp", "common.pt"):
        open(os.path.join(d, name), "wb").write(os.urandom(64))
    write_integrity(d)
    assert json.load(open(os.path.join(d, "integrity.json")))["algorithm"] == "sha256"
    assert verify_integrity(d) == 2
    open(os.path.join(d, "a.distcp"), "ab").write(b"!")
    with pytest.raises(CheckpointError, match="a.distcp differs from its hash"):
        verify_integrity(d)


@pytest.mark.parametrize("mode,raises,kept", [("assume_ok_unexpected", "has no param", None),
                                              ("raise_all", "holds tensors this model does not have", None),
                                              ("log_all", None, {"b"}), ("ignore_all", None, {"b"})])
def test_dist_ckpt_strictness(mode, raises, kept, capsys):
    from megalite.checkpoint.load import mismatches
    from megalite.errors import CheckpointError
    index = SimpleNamespace(entry=lambda n: {"a": 1}.get(n), names=lambda: ["a", "extra"])
    state = SimpleNamespace(named_params=[("a", None), ("b", None)], named_buffers=[], log=print)
    if raises:
        with pytest.raises(CheckpointError, match=raises):
            mismatches(state, index, mode, "ck")
        return
    assert mismatches(state, index, mode, "ck") == kept
    out = capsys.readouterr().out
    assert ("lacks 1 parameters" in out and "extra" in out) if mode == "log_all" else out == ""


# -- data and training ----------------------------------------------------------------------------
def test_fim_permutes_documents_and_keeps_the_length():
    from megalite.config.data import DataConfig, TokenizerConfig
    from megalite.data.fim import FIMDataset

    class Chars:
        eod = 0

        def tokenize(self, text):
            return [ord(ch) for ch in text]

        def detokenize(self, ids):
            return "".join(chr(i) for i in ids)

    text = np.array([ord(c) for c in "hello world"] + [0] + [ord(c) for c in "abcdefgh"], dtype=np.int64)
    ds = FIMDataset(type("B", (), {"__len__": lambda s: 10, "__getitem__": lambda s, i: {"text": text}})(),
                    DataConfig(fim_data=True, fim_rate=1.0, fim_spm_rate=0.5), TokenizerConfig(), 0)
    ds._tokenizer = Chars()
    ds.prefix, ds.middle, ds.suffix, ds.pad, ds.eod, ds.split_id = 1, 2, 3, 4, 0, None
    for i in range(4):
        out = ds[i]["text"]
        assert len(out) == len(text) and out[0] == 1 and (out == ds[i]["text"]).all()  # the same each read
        doc = out[:list(out).index(0)]  # the first document, reordered with sentinels
        assert set(doc.tolist()) - {1, 2, 3} <= set(text[:11].tolist())


def test_lenient_flags_and_defaults_as_megatron():
    c = args_of(["--recompute-num-layers", "1", "--eval-global-batch-size", "4", "--logging-level", "30"])
    assert c.recompute.recompute_num_layers is None and c.training.eval_num_microbatches == 2
    assert any("--recompute-method / --recompute-num-layers have no effect" in n for n in c.notices)
    c = validate_args(parse_args(tiny(train_iters=2) + ["--data-path", "x", "--vocab-file", "v", "--merge-file", "m"]),
                      1, check_files=False)
    assert c.tokenizer.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt.py's default
    c = args_of(["--tp-comm-overlap", "--cuda-graph-impl", "local", "--use-persistent-ckpt-worker"])
    assert sum("a Megatron-LM GPU overlap, graph or worker choice" in n for n in c.notices) == 3
    with pytest.raises(ArgumentError, match="--experimental-attention-variant is not supported: the 2026 attention"):
        args_of(["--experimental-attention-variant", "dsa"])
    with pytest.raises(ArgumentError, match="--use-mup is not supported: the Maximal Update"):
        args_of(["--use-mup"])
