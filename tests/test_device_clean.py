"""Device cleanliness, proven without a GPU on the `meta` device.

A meta tensor, like a CUDA tensor, refuses to meet a CPU tensor in an operation (CPU scalars of
dimension 0 excepted, as on CUDA). So a forward, backward and optimizer step of a model built on
`device="meta"` fails wherever the code creates a tensor on a fixed device (`torch.arange(n)`
without `device=`, a buffer made in __init__ on the CPU, `.to("cpu")`), or copies device data to
the host (`float(t)`, `.item()`, `.tolist()`: "Cannot copy out of meta tensor"), exactly where the
first CUDA step would crash or stall. Some meta kernels do accept a CPU operand that CUDA would
refuse (`masked_fill_` with a CPU mask), so forward and backward also run under `NoCPUTensors`, a
dispatch mode that records every op touching a CPU tensor of one or more dimensions.

Every model variant is covered: learned and rotary positions, LayerNorm and RMSNorm, GeLU and
SwiGLU, grouped-query attention, biases on and off, tied and untied output weights, an explicit
attention mask, every recompute mode, pipeline stages (first / middle / last, with the last
stage's copy of the tied embedding), tensor parallelism with sequence parallelism, context
parallelism (CP 2: K/V all-gather, masks in global positions), and Mixture-of-Experts layers
(routers, losses, capacity, shared expert; with TP 2 and EP 2, both token dispatchers). TP=2 and CP=2 run in this one
process as rank 0 of a `fake` process group (torch's backend that accepts every
collective and moves no data), so the collectives of the TP and SP regions are called with meta
tensors too. Weights are not initialised (`GPTModel.initialize` draws from CPU generators and
copies values, which meta tensors have none of): what matters is that forward, backward and the
step never mix devices.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megalite import comm
from megalite.model import ExecutionConfig, GPTConfig, GPTModel, model_configs
from megalite.tensor_parallel import seed_everything

META = torch.device("meta")
B, S, V = 2, 16, 90

VARIANTS = {
    "gpt2": {},
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                  add_bias_linear=False, untie_embeddings_and_output_weights=True),
    "rope-partial-layernorm-gelu-bias": dict(position_embedding_type="rope", rotary_percent=0.5),
    "rmsnorm-swiglu-bias-tied": dict(normalization="RMSNorm", swiglu=True),
    "gqa-untied": dict(num_query_groups=1, untie_embeddings_and_output_weights=True),
    "no-bias": dict(add_bias_linear=False),
    "recompute-selective": dict(position_embedding_type="rope", recompute_granularity="selective"),
    "recompute-full-uniform": dict(position_embedding_type="rope", recompute_granularity="full",
                                   recompute_method="uniform", recompute_num_layers=2),
    "recompute-full-block": dict(position_embedding_type="rope", recompute_granularity="full",
                                 recompute_method="block", recompute_num_layers=1),
    # Mixture of Experts: Mixtral's layer (SwiGLU experts, RMSNorm, RoPE) with the aux and z losses;
    # a shared gated expert, capacity dropping, per-sequence aux loss on every 2nd layer; sigmoid
    # scores with the aux-loss-free expert bias
    "moe-mixtral": dict(num_experts=4, moe_router_topk=2, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", add_bias_linear=False, moe_aux_loss_coeff=1e-2,
                        moe_z_loss_coeff=1e-3),
    "moe-shared-capacity-seq-aux": dict(num_experts=4, moe_router_topk=2, add_bias_linear=False, moe_layer_freq="2",
                                        moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
                                        moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="seq_aux_loss",
                                        moe_aux_loss_coeff=1e-2),
    "moe-sigmoid-expert-bias": dict(num_experts=4, moe_router_topk=2, add_bias_linear=False,
                                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}


def config(**kw) -> tuple[GPTConfig, ExecutionConfig]:
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=V, padded_vocab_size=128,
                seq_length=S, max_position_embeddings=S, hidden_dropout=0.1, attention_dropout=0.1)
    return model_configs(**{**base, **kw})


class NoCPUTensors(TorchDispatchMode):
    """Records every aten op that takes or returns a CPU tensor with at least one dimension, RNG
    states (uint8 bytes, which live on the host by design: recompute saves the CPU generator's)
    excepted."""

    def __init__(self):
        super().__init__()
        self.cpu = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = list(torch.utils._pytree.tree_leaves((args, kwargs or {}, out)))
        if any(torch.is_tensor(t) and t.device.type == "cpu" and t.dim() > 0 and t.dtype != torch.uint8
               for t in flat):
            self.cpu.append(str(func))
        return out


def train_step_on_meta(cfg: tuple[GPTConfig, ExecutionConfig], tp_group=None, tp_rank: int = 0, pre_process=True,
                       post_process=True,
                       attention_mask: bool = False, position_ids: bool = True, ep_group=None, token_group=None):
    """Build on meta, run forward, backward and a foreach AdamW step; return (model, output, optimizer)."""
    tracker = seed_everything(3, tp_rank, 0, META)
    cfg, execution = cfg
    model = GPTModel(cfg, tp_group, tracker, pre_process=pre_process, post_process=post_process, device=META,
                     execution=execution, ep_group=ep_group, token_group=token_group)
    model.train()
    ids = torch.zeros(B, S, dtype=torch.long, device=META)
    pos = torch.arange(S, device=META).unsqueeze(0).expand(B, S) if position_ids else None
    mask = torch.ones(S, S, dtype=torch.bool, device=META).tril().expand(B, 1, S, S) if attention_mask else None
    if not pre_process:  # a later pipeline stage: the activations arrive from the previous one
        s_local = S // (comm.group_size(tp_group) if execution.sequence_parallel else 1)
        model.set_input_tensor(torch.zeros(s_local, B, cfg.hidden_size, device=META, requires_grad=True))
    with NoCPUTensors() as ops:
        out = model(ids, pos, mask, ids if post_process else None)
        out.float().sum().backward() if post_process else out.backward(torch.ones_like(out))
    assert not ops.cpu, ops.cpu[:5]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    # clip by the global norm without leaving the device (torch's clip_grad_norm_ refuses
    # foreach on meta; megalite's clipping uses the same two foreach kernels)
    grads = [p.grad for p in model.parameters()]
    norm = torch.stack(torch._foreach_norm(grads)).norm()
    torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
    optimizer.step()
    return model, out, optimizer


def assert_all_on_meta(model, out, optimizer):
    assert out.device == META
    if model.rotary is not None:
        assert all(b.device == META for b in model.rotary.buffers())
    for name, p in model.named_parameters():
        assert p.device == META, name
        assert p.grad is not None and p.grad.device == META, name
        state = optimizer.state[p]
        assert state["exp_avg"].device == META and state["exp_avg_sq"].device == META, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_process_variants_on_meta(variant):
    model, out, opt = train_step_on_meta(config(**VARIANTS[variant]))
    assert out.shape == (B, S)  # per-token loss
    assert_all_on_meta(model, out, opt)


def test_attention_mask_and_rope_without_position_ids_on_meta():
    # document masks go to SDPA as a bool [b, 1, s, s]; RoPE makes its own positions when none are given
    model, out, opt = train_step_on_meta(config(**VARIANTS["llama"]), attention_mask=True, position_ids=False)
    assert_all_on_meta(model, out, opt)


@pytest.mark.parametrize("stage", ["first", "middle", "last"])
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_pipeline_stages_on_meta(stage, variant):
    pre, post = {"first": (True, False), "middle": (False, False), "last": (False, True)}[stage]
    model, out, opt = train_step_on_meta(config(**VARIANTS[variant]), pre_process=pre, post_process=post)
    assert_all_on_meta(model, out, opt)
    if stage == "last" and variant == "gpt2":  # the last stage's copy of the tied embedding
        from megalite.tensor_parallel.param_info import param_info
        assert param_info(model.output_layer.weight).tied_copy


@pytest.fixture
def fake_tp2():
    """This process as rank 0 of a 2-rank `fake` process group: collectives are accepted (meta
    tensors included) and move nothing."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["gpt2", "llama", "recompute-selective", "recompute-full-uniform"])
def test_tensor_and_sequence_parallel_on_meta(fake_tp2, variant):
    assert comm.group_size(fake_tp2) == 2
    for sequence_parallel in (False, True):
        cfg = config(**VARIANTS[variant], sequence_parallel=sequence_parallel)
        model, out, opt = train_step_on_meta(cfg, fake_tp2)
        assert_all_on_meta(model, out, opt)
        # this rank's shards: half the heads' QKV rows, half the (padded) vocabulary
        assert model.embedding.word_embeddings.weight.shape[0] == 64
        # a later stage receives [s/tp, b, h] under SP
        model, out, opt = train_step_on_meta(cfg, fake_tp2, pre_process=False)
        assert_all_on_meta(model, out, opt)


@pytest.fixture
def fake_tp2_ep2():
    """This process as rank 0 of a 4-rank `fake` process group, with megalite's groups for TP 2 x
    DP 2 and EP 2 taken from DP."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from megalite import parallel_state
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        yield parallel_state.initialize(tp=2, ep=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("variant", ["moe-mixtral", "moe-shared-capacity-seq-aux"])
def test_expert_parallel_moe_on_meta(fake_tp2_ep2, dispatcher, variant):
    """TP 2 with sequence parallelism and EP 2: tokens all-gathered over TP, routed rows exchanged
    over EP (the meta device has no values, so the dispatcher takes balanced counts there: on a GPU
    the counts are the one device-to-host copy per MoE layer and micro-batch, as in Megatron-LM's
    dropless dispatchers), and the router's load counts summed over TP x CP."""
    ps = fake_tp2_ep2
    assert (ps.tp_size, ps.ep_size, ps.expert_dp_size) == (2, 2, 1)
    cfg = config(**VARIANTS[variant], sequence_parallel=True, moe_token_dispatcher_type=dispatcher)
    groups = dict(ep_group=ps.ep_group, token_group=ps.tp_cp_group)
    model, out, opt = train_step_on_meta(cfg, ps.tp_group, **groups)
    assert_all_on_meta(model, out, opt)
    (_, layer), *_ = model.moe_layers()
    assert list(layer.experts.local_experts) == ["0", "1"]  # 4 experts over EP 2: this rank's first two
    model, out, opt = train_step_on_meta(cfg, ps.tp_group, pre_process=False, **groups)
    assert_all_on_meta(model, out, opt)


def test_meta_catches_a_cpu_tensor():
    """The premise: a tensor created on the CPU cannot meet the model's meta tensors."""
    x = torch.zeros(4, 3, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        x * torch.arange(3.0)
    with pytest.raises(NotImplementedError, match="meta"):
        x.to("cpu")


@pytest.mark.parametrize("variant", ["gpt2", "llama", "recompute-selective"])
@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "document-mask"])
def test_context_parallel_on_meta(fake_tp2, variant, document_mask):
    """CP 2 (the fake group as the CP group): this rank's two chunks (s/2 tokens at their global
    positions), keys/values all-gathered and their gradients reduce-scattered over the group, the
    causal mask built in global positions on the device, or a document mask [b, 1, s/2, s]."""
    from megalite.context_parallel.sharding import chunk_positions
    cp = comm.group_size(fake_tp2)
    cfg, execution = config(**VARIANTS[variant])
    model = GPTModel(cfg, None, seed_everything(3, 0, 0, META), device=META, cp_group=fake_tp2, execution=execution)
    model.train()
    ids = torch.zeros(B, S // cp, dtype=torch.long, device=META)
    pos = chunk_positions(S, cp, 0, META).unsqueeze(0).expand(B, S // cp)
    mask = torch.ones(S // cp, S, dtype=torch.bool, device=META).expand(B, 1, S // cp, S) if document_mask else None
    # meta does not refuse every CPU operand (masked_fill_ takes a CPU mask, CUDA would not):
    # every tensor an op sees or makes must be on meta, bar 0-dim CPU scalars
    with NoCPUTensors() as ops:
        out = model(ids, pos, mask, ids)
        out.float().sum().backward()
    assert out.shape == (B, S // cp)
    assert not ops.cpu, ops.cpu[:5]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    optimizer.step()
    assert_all_on_meta(model, out, optimizer)
