"""--gradient-accumulation-fusion (tensor_parallel/grad_fusion.py): the linears' weight-gradient GEMMs
write into the gradient buffer (under ZeRO-2/3 its staging buffers), and the buffer then holds what
autograd's `.grad` + the hook's copy and add put there (fp32, within GEMM rounding): over
micro-batches, with the untied output layer used twice per micro-batch (MTP), with
--overlap-grad-reduce counting each weight once per micro-batch, and whatever the buffer held
before (β = 0). The layout tests compare every parallel layout with one process, both fused (the
default), so together they cover the layouts."""
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megalite.arguments import parse_args, validate_args
from megalite.config import DDPConfig
from megalite.distributed import DataParallel
from megalite.distributed.data_parallel import fusable_weights
from megalite.model import ExecutionConfig, GPTConfig, GPTModel
from megalite.parallel_state import single_process_state
from megalite.tensor_parallel import grad_fusion
from tiny import mock, tiny

CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                   seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                   untie_embeddings_and_output_weights=True, mtp_num_layers=1, add_bias_linear=True)
# the same with MoE MLPs (4 experts top-2, the per-expert loop): the experts' weights fuse too
MOE = dataclasses.replace(CONFIG, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
TOKENS = torch.arange(17).repeat(4, 1) * 7 % 64  # [b, s + 1]
POSITIONS = torch.arange(16).expand(4, 16)


def buffer_grads(fusion: bool, micro_batches: int = 3, device: str = "cpu", dtype=torch.float32, strategy="no_shard",
                 config: GPTConfig = CONFIG):
    """Each parameter's gradient after two steps of `micro_batches` each (the full buffer filled
    with NaN before the second: every view must be overwritten, never added to), and the ops of
    the second step's backward. (tests/test_gpu.py runs it in bf16 on CUDA.)"""
    model = GPTModel(config, device=device, execution=ExecutionConfig(params_dtype=dtype))
    model.initialize(seed=3)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], single_process_state(),
                      DDPConfig(gradient_accumulation_fusion=fusion, overlap_grad_reduce=True,
                                data_parallel_sharding_strategy=strategy,
                                # the larger weights a bucket each (ZeRO-2/3: written, not added)
                                ddp_bucket_size=2000),
                      micro_batches)
    sharded = dp.strategy.shards_grads
    ops = None
    for step in range(2):
        dp.zero_grad()
        if step and not sharded:
            dp.grads.data.fill_(float("nan"))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for m in range(micro_batches):
                tokens = TOKENS.roll(m + step, dims=1).to(device)
                loss = model(tokens[:, :-1], POSITIONS.to(device), labels=tokens[:, 1:]).float().mean()
                loss = loss + sum(s / n for s, n, _ in model.mtp_results)
                loss.backward()
        ops = [e.name for e in prof.events()]
        dp.finish_grad_sync()
    # one rank: the shard is the whole of each bucket
    views = {n: (dp.grads.shard[slice(*dp.layout.param_index[p])].view(p.shape) if sharded else dp.main_grad(p)).clone()
             for n, p in named}
    fused = [n for n, p in named if any(p is q for q in dp.fused_wgrad)]
    dp.close()
    assert all(p.grad is None for _, p in named)
    assert not any(hasattr(p, grad_fusion._SINK) for _, p in named)  # close() took the sinks off
    return views, fused, ops


@pytest.mark.parametrize("strategy,config", [("no_shard", CONFIG), ("optim_grads", CONFIG),
                                             ("optim_grads_params", CONFIG), ("no_shard", MOE)],
                         ids=["no_shard", "zero2", "zero3", "moe"])
def test_fused_buffer_equals_autograds_copy_and_add(strategy, config):
    fused, fused_names, fused_ops = buffer_grads(True, strategy=strategy, config=config)
    plain, plain_names, plain_ops = buffer_grads(False, strategy=strategy, config=config)
    assert plain_names == []
    # every linear weight (two layers, MTP's layer and its eh_proj, the output layer; with MoE each
    # layer's 4 experts' two instead of the MLP's two); no embedding, norm, bias or router
    assert "output_layer.weight" in fused_names and "embedding.word_embeddings.weight" not in fused_names
    assert len(fused_names) == (3 * (2 + 4 * 2) + 2 if config.num_experts else 3 * 4 + 2)
    assert all(n.endswith(".weight") and "norm" not in n and "router" not in n for n in fused_names)
    for n in fused:
        assert torch.isfinite(fused[n]).all(), n
        torch.testing.assert_close(fused[n], plain[n], rtol=1e-6, atol=1e-7, msg=n)
    # the fused step adds into the weights' views in the GEMM: fewer adds and copies than
    # the hook's one per weight and micro-batch
    # (ZeRO-2/3 stage a weight that fills its bucket alone without a pass either way: autograd's
    # .grad becomes the staging buffer)
    adds = lambda ops: sum(ops.count(f"aten::{op}") for op in ("add", "add_", "copy_"))  # noqa: E731
    if strategy == "no_shard":
        assert adds(fused_ops) <= adds(plain_ops) - 3 * len(fused_names)
    assert fused_ops.count("aten::addmm_") >= 3 * len(fused_names)


def test_fusion_is_off_where_the_buffer_cannot_take_the_gemm():
    cpu = torch.device("cpu")
    assert grad_fusion.gemm_for(torch.float32, torch.float32, cpu) is grad_fusion._gemm_same_dtype
    assert grad_fusion.gemm_for(torch.bfloat16, torch.bfloat16, cpu) is grad_fusion._gemm_same_dtype
    # addmm and mm have no out_dtype on the CPU: 16-bit weights into an fp32 buffer take the hook
    assert grad_fusion.gemm_for(torch.bfloat16, torch.float32, cpu) is None
    # the CUDA forms' shapes and dtypes, on meta
    for gemm in (grad_fusion._gemm_out_dtype, grad_fusion._gemm_out_dtype_mm):
        for overwrite in (True, False):
            gemm(torch.empty(8, 6, device="meta"), torch.empty(8, 5, dtype=torch.bfloat16, device="meta"),
                 torch.empty(5, 6, dtype=torch.bfloat16, device="meta"), overwrite=overwrite)
    # FP8's GEMMs are torchao's
    model = GPTModel(CONFIG)
    model.decoder.layers[0].mlp.linear_fc1.fp8 = object()  # any FP8 site
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    assert not any(w is fc1 for w in fusable_weights([model], torch.device("cpu")))


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-gradient-accumulation-fusion"], False)])
def test_megatron_flag(flag, expected):
    cfg = validate_args(parse_args(mock() + tiny(train_iters=1) + flag))
    assert cfg.ddp.gradient_accumulation_fusion is expected and not cfg.notices
