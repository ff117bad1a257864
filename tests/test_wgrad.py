"""--delay-wgrad-compute: a backward split into B (input gradient) and W (weight gradient) gives
the plain backward's gradients bit for bit (torch.equal), on one process:

- B alone leaves the deferred weights' `.grad` empty (they wait for W) and still returns the input
  gradient a previous pipeline stage needs; W fills them; the post-accumulate-grad hooks (which
  the gradient buffers and their reduction overlap hang on) fire at W, once per parameter;
- over a dense model (tied and untied output layer, LayerNorm-1p / RMSNorm, biases, SwiGLU, two
  micro-batches accumulated) and MoE models (loop experts, router, shared expert; grouped GEMM,
  run on the CPU where the module would use it on CUDA).
"""
import pytest
import torch

from megalite.data.batch import build_batch
import megalite.model.moe.experts as experts_module
from megalite.model import GPTModel, model_configs
from megalite.tensor_parallel import wgrad

VARIANTS = {
    "dense-tied": dict(apply_layernorm_1p=True),
    "dense-untied-rms-swiglu": dict(normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True,
                                    add_bias_linear=False, position_embedding_type="rope"),
    "moe": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                untie_embeddings_and_output_weights=True),
    # torch._grouped_mm (a CUDA kernel; on the CPU a loop of GEMMs, which the test runs: see below)
    "moe-grouped": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, untie_embeddings_and_output_weights=True,
                        moe_grouped_gemm=True, swiglu=True),
}


def _batch(seed):
    tokens = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(seed))
    return build_batch(tokens, eod=None)


def _model(variant, pre_process=True):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=90, padded_vocab_size=128,
                seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg, execution = model_configs(**{**base, **VARIANTS[variant]})
    model = GPTModel(cfg, None, None, execution=execution, pre_process=pre_process)
    model.initialize(5)
    return model


def _run(model, store=None, stage_input=None):
    """Two micro-batches' forward and backward (B then W with a store); the input gradient of each."""
    dxs = []
    for seed in (0, 1):
        data = _batch(seed)
        x = None
        if stage_input is not None:  # a later pipeline stage: its input activation needs a gradient
            x = stage_input(seed).requires_grad_()
            model.set_input_tensor(x)
        loss = model(data["input_ids"], data["position_ids"], data["attention_mask"], data["labels"]).sum()
        if store is None:
            loss.backward()
        else:
            with store.capture():
                loss.backward()
            yield "B"
            store.pop()
        dxs.append(None if x is None else x.grad.clone())
    yield dxs


@pytest.mark.parametrize("variant,first_stage", [("dense-tied", True), ("dense-untied-rms-swiglu", False),
                                                 ("moe", True), ("moe-grouped", False)])
def test_split_backward_matches_plain_backward_bit_for_bit(variant, first_stage, monkeypatch):
    if variant == "moe-grouped":  # the grouped path where it would run on CUDA, here on the CPU
        monkeypatch.setattr(experts_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
    stage_input = None if first_stage else (lambda seed: torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(seed)))
    plain = _model(variant, first_stage)
    *_, plain_dx = _run(plain, None, stage_input)
    split = _model(variant, first_stage)
    store = wgrad.WgradStore()
    assert wgrad.attach([split], store) > 0
    arrivals = {}
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: arrivals.__setitem__(n, arrivals.get(n, 0) + 1))
    run = _run(split, store, stage_input)
    assert next(run) == "B"
    deferred = {n for n, p in split.named_parameters() if p.grad is None}
    expected = {"output_layer.weight", "decoder.layers.0.self_attention.linear_qkv.weight"}
    if first_stage:
        expected.add("embedding.word_embeddings.weight")
    if variant.startswith("moe"):
        expected.add("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
        expected.add("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")
    if variant == "dense-tied" and first_stage:  # tied: the word embedding is the output layer
        expected.discard("output_layer.weight")
    assert expected <= deferred, expected - deferred
    assert not any("norm" in n for n in deferred)  # norms keep their gradient in B
    # the hooks the gradient buffers (and their reduction overlap) hang on: not yet for the deferred
    assert all(arrivals.get(n, 0) == (n not in deferred) for n, _ in split.named_parameters())
    *_, split_dx = run
    for n, p in plain.named_parameters():
        q = dict(split.named_parameters())[n]
        assert torch.equal(p.grad, q.grad), n
        assert arrivals[n] == 2, (n, arrivals[n])  # once per micro-batch, at W for the deferred ones
    for a, b in zip(plain_dx, split_dx):
        assert (a is None and b is None) or torch.equal(a, b)
    assert len(store) == 0
