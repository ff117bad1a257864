"""Mixture-of-Experts layers (megalite/model/moe/) against plain references written here: loops
over tokens and experts in plain torch/Python, no megalite code. Semantics are Megatron-LM's
(megatron/core/transformer/moe/moe_utils.py and router.py):

  routing   softmax: probs = softmax(top-k logits); pre-softmax: top-k of softmax(logits);
            sigmoid: s = sigmoid(logits), top-k of s + expert_bias, probs = s_topk / sum(s_topk) (k > 1)
  aux loss  coeff * E / (T^2 k) * sum_e P_e f_e, P_e = sum_t scores_te over all experts (softmax, or
            sigmoid normalised per token), f_e = tokens whose top-k of those scores holds e (before
            dropping; the expert bias takes no part, as in Megatron-LM and DeepSeek-V3)
  seq aux   the same per sequence (T = sequence length), averaged over the sequences
  z-loss    coeff * mean_t logsumexp(logits_t)^2
  bias      b_e += rate * sign(mean(load) - load_e)
  capacity  ceil(T k / E * factor) per expert: the highest probs ("probs") or earliest tokens
            ("position"); dropped choices weigh 0 and are not dispatched

fp32, one process, tiny sizes."""
from __future__ import annotations

import math

import pytest
import torch

from megalite.model.config import model_configs
from megalite.model.gpt import GPTModel
from megalite.model.moe import MoELayer, balance
from megalite.model.moe import experts as experts_module
from megalite.model.moe.dispatcher import DISPATCHERS, AllGatherDispatcher, sort_by_expert
from megalite.model.moe.router import LOAD_BALANCING, SCORE_FUNCTIONS, SoftmaxScores, capacity_mask
from tolerances import assert_close_fp32

H, FFN, E, K, S, B = 16, 8, 4, 2, 8, 2  # hidden, expert ffn, experts, top-k, sequence, batch
BASE = dict(num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=S, max_position_embeddings=S,
            vocab_size=64, padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
            swiglu=True, num_experts=E, moe_ffn_hidden_size=FFN, moe_router_topk=K)


def moe_layer(seed: int = 0, std: float = 0.5, **settings) -> MoELayer:
    config, execution = model_configs(**{**BASE, **settings})
    layer = MoELayer(config, execution, None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return layer


def tokens(seed: int = 1, s: int = S, b: int = B) -> torch.Tensor:
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))


# -- plain references -------------------------------------------------------------------------

def ref_sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def ref_route(logits: torch.Tensor, k: int, score_function: str = "softmax", pre_softmax: bool = False,
              bias=None):
    """Per token, one at a time: (probs [T][k], experts [T][k]) as Python lists, best first."""
    probs, experts = [], []
    for row in logits.tolist():
        n = len(row)
        if score_function == "softmax":
            if pre_softmax:
                z = sum(math.exp(v) for v in row)
                sc = [math.exp(v) / z for v in row]
                chosen = sorted(range(n), key=lambda e: -sc[e])[:k]
                p = [sc[e] for e in chosen]
            else:
                chosen = sorted(range(n), key=lambda e: -row[e])[:k]
                z = sum(math.exp(row[e]) for e in chosen)
                p = [math.exp(row[e]) / z for e in chosen]
        else:
            sc = [ref_sigmoid(v) for v in row]
            choice = [sc[e] + (0.0 if bias is None else bias[e]) for e in range(n)]
            chosen = sorted(range(n), key=lambda e: -choice[e])[:k]
            p = [sc[e] for e in chosen]
            if k > 1:
                total = sum(p)
                p = [v / total for v in p]
        probs.append(p)
        experts.append(chosen)
    return probs, experts


def ref_keep(probs, experts, num_experts: int, capacity: int, policy: str):
    """[T][k] bool: expert by expert, the `capacity` choices it keeps."""
    keep = [[False] * len(row) for row in experts]
    for e in range(num_experts):
        choices = [(t, j) for t in range(len(experts)) for j in range(len(experts[t])) if experts[t][j] == e]
        if policy == "probs":
            choices.sort(key=lambda c: -probs[c[0]][c[1]])
        for t, j in choices[:capacity]:
            keep[t][j] = True
    return keep


def ref_losses(x: torch.Tensor, weight: torch.Tensor, balancing: str, aux_coeff: float, z_coeff, score_function: str,
               s: int, b: int, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux or seq-aux loss, z-loss) of tokens x [s*b, h] in [s, b] order, differentiable in x and weight."""
    T, n = x.size(0), weight.size(0)
    logits = [[(x[t] * weight[e]).sum() for e in range(n)] for t in range(T)]
    scores = []
    for t in range(T):
        if score_function == "softmax":
            ex = [torch.exp(v) for v in logits[t]]
        else:
            ex = [1.0 / (1.0 + torch.exp(-v)) for v in logits[t]]
        total = sum(ex)
        scores.append([v / total for v in ex])
    chosen = [sorted(range(n), key=lambda e: -scores[t][e].item())[:k] for t in range(T)]

    def balance_loss(rows, length):
        loss = 0.0
        for e in range(n):
            P = sum(scores[t][e] for t in rows)
            f = sum(1 for t in rows if e in chosen[t])
            loss = loss + P * f
        return loss * (aux_coeff * n / (length * length * k))

    if balancing == "aux_loss":
        aux = balance_loss(range(T), T)
    else:  # sequence j: rows i*b + j
        aux = sum(balance_loss([i * b + j for i in range(s)], s) for j in range(b)) / b
    z = sum(torch.log(sum(torch.exp(v) for v in logits[t])) ** 2 for t in range(T)) / T * (z_coeff or 0.0)
    return aux, z


def ref_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, swiglu, b1=None, b2=None) -> torch.Tensor:
    """swiglu: True (SwiGLU), False (GeLU) or "gpt-oss" (transformers' GptOssExperts: alpha 1.702,
    limit 7, up + 1); b1, b2: fc1's and fc2's biases (none: no bias)."""
    y = w1 @ x + (0 if b1 is None else b1)
    if swiglu == "gpt-oss":
        gate, up = y[:y.numel() // 2].clamp(max=7.0), y[y.numel() // 2:].clamp(-7.0, 7.0)
        a = gate / (1 + torch.exp(-1.702 * gate)) * (up + 1)
    elif swiglu:
        gate, up = y[:y.numel() // 2], y[y.numel() // 2:]
        a = gate / (1 + torch.exp(-gate)) * up
    else:
        a = 0.5 * y * (1 + torch.erf(y / math.sqrt(2.0)))
    return w2 @ a + (0 if b2 is None else b2)


def ref_expert(x: torch.Tensor, mlp, swiglu) -> torch.Tensor:
    """An expert or the shared expert of megalite's layer, by its weights and biases."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    return ref_mlp(x, fc1.weight, fc2.weight, swiglu, getattr(fc1, "bias", None), getattr(fc2, "bias", None))


def ref_layer(layer: MoELayer, x: torch.Tensor, swiglu: bool, score_function="softmax", pre_softmax=False,
              capacity_factor=None, drop_policy="probs") -> torch.Tensor:
    """Token by token: sum over its kept top-k experts of prob * expert(x) [+ gate * shared(x)]."""
    s, b, h = x.shape
    flat = x.reshape(s * b, h)
    logits = flat @ layer.router.weight.t() + (0 if layer.router.bias is None else layer.router.bias)
    bias = None if layer.router.expert_bias is None else layer.router.expert_bias.tolist()
    probs, experts = ref_route(logits, K, score_function, pre_softmax, bias)
    if capacity_factor is not None:
        keep = ref_keep(probs, experts, E, math.ceil(s * b * K / E * capacity_factor), drop_policy)
        probs = [[p if kept else 0.0 for p, kept in zip(pr, kr)] for pr, kr in zip(probs, keep)]
    out = []
    for t in range(s * b):
        y = torch.zeros(h)
        for p, e in zip(probs[t], experts[t]):
            expert = layer.experts.local_experts[str(e)]
            y = y + p * ref_expert(flat[t], expert, swiglu)
        shared = layer.shared_experts
        if shared is not None:
            z = ref_expert(flat[t], shared, swiglu)
            if hasattr(shared, "gate_weight"):
                z = z / (1 + torch.exp(-(shared.gate_weight[0] * flat[t]).sum()))
            y = y + z
        out.append(y)
    return torch.stack(out).view(s, b, h)


# -- 1. top-k routing ---------------------------------------------------------------------------

@pytest.mark.parametrize("score_function,pre_softmax,bias,k", [
    ("softmax", False, False, 2), ("softmax", True, False, 2), ("softmax", False, False, 1),
    ("sigmoid", False, False, 2), ("sigmoid", False, True, 2), ("sigmoid", False, True, 1), ("sigmoid", False, False, 3)])
def test_routing_matches_reference(score_function, pre_softmax, bias, k):
    layer = moe_layer(moe_router_score_function=score_function, moe_router_pre_softmax=pre_softmax,
                      moe_router_enable_expert_bias=bias, moe_router_topk=k)
    if bias:
        layer.router.expert_bias.copy_(torch.tensor([0.4, -0.3, 0.0, 0.25]))
    x = tokens().reshape(S * B, H)
    with torch.no_grad():
        routing = layer.router(x, None, (S, B))
        logits = x @ layer.router.weight.t()
    ref_probs, ref_experts = ref_route(logits, k, score_function, pre_softmax,
                                       layer.router.expert_bias.tolist() if bias else None)
    assert routing.indices.tolist() == ref_experts
    torch.testing.assert_close(routing.probs, torch.tensor(ref_probs), rtol=1e-5, atol=1e-6)
    assert routing.kept is None
    if bias:  # the bias must have changed some choices, or the test proves nothing
        _, unbiased = ref_route(logits, k, score_function)
        assert unbiased != ref_experts
    if score_function == "softmax" and not pre_softmax or score_function == "sigmoid" and k > 1:
        torch.testing.assert_close(routing.probs.sum(-1), torch.ones(S * B))


# -- 2. aux / seq-aux / z losses: values and gradients ------------------------------------------

S_B_TOKENS = 18  # s x b of test_router_losses_and_gradients


@pytest.mark.parametrize("balancing,score_function,bias,capacity_factor", [
    ("aux_loss", "softmax", False, None), ("seq_aux_loss", "softmax", False, None), ("aux_loss", "sigmoid", False, None),
    ("seq_aux_loss", "sigmoid", True, None), ("aux_loss", "softmax", False, 0.5)])
def test_router_losses_and_gradients(balancing, score_function, bias, capacity_factor):
    """With a capacity the loss still counts every choice, dropped or not."""
    aux_coeff, z_coeff, scale = 0.3, 0.02, 0.37
    s, b = 6, 3
    common = dict(moe_router_load_balancing_type=balancing, moe_router_score_function=score_function,
                  moe_router_enable_expert_bias=bias, moe_expert_capacity_factor=capacity_factor)
    with_loss = moe_layer(moe_aux_loss_coeff=aux_coeff, moe_z_loss_coeff=z_coeff, **common)
    without = moe_layer(moe_aux_loss_coeff=0.0, **common)
    if bias:
        for layer in (with_loss, without):
            layer.router.expert_bias.copy_(torch.tensor([0.5, -0.4, 0.0, 0.3]))
    with_loss.aux_loss_scale = scale
    x = tokens(s=s, b=b)
    # small: the main path's gradient, the same in both runs, is subtracted out; fp32 rounding of a
    # large one would hide the losses' part
    grad_out = torch.randn(s, b, H, generator=torch.Generator().manual_seed(5)) * 1e-2
    grads = []
    for layer in (with_loss, without):
        xi = x.clone().requires_grad_()
        (layer(xi) * grad_out).sum().backward()
        grads.append((layer.router.weight.grad, xi.grad))
    assert without.router.aux_loss_sum is None and without.router.z_loss_sum is None

    w = without.router.weight.detach().clone().requires_grad_()
    xr = x.reshape(s * b, H).clone().requires_grad_()
    aux, z = ref_losses(xr, w, balancing, aux_coeff, z_coeff, score_function, s, b)
    torch.testing.assert_close(with_loss.router.aux_loss_sum, aux.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(with_loss.router.z_loss_sum, z.detach(), rtol=1e-5, atol=1e-7)
    ref_w, ref_x = torch.autograd.grad((aux + z) * scale, [w, xr])
    (w_with, x_with), (w_without, x_without) = grads
    # the losses' part is a difference of two whole gradients: their rounding (tolerances.py) sets
    # the bound, 18 tokens through the logits (16 terms), the softmax and the layer's backward
    assert_close_fp32(w_with - w_without, ref_w, k=S_B_TOKENS, chain=4, scale=w_with.abs().max())
    assert_close_fp32((x_with - x_without).reshape(s * b, H), ref_x, k=S_B_TOKENS, chain=4, scale=x_with.abs().max())
    assert ref_w.abs().max() > 1e-4  # the losses do move the router


def test_no_router_loss_in_eval():
    layer = moe_layer(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1).eval()
    assert layer.router(tokens().reshape(S * B, H), None, (S, B)).loss is None


# -- 3. expert-bias update ----------------------------------------------------------------------

def test_expert_bias_update():
    rate = 0.01
    config, execution = model_configs(**{**BASE, "num_layers": 2, "moe_router_score_function": "sigmoid",
                                         "moe_router_enable_expert_bias": True})
    torch.manual_seed(0)
    model = GPTModel(config, execution=execution)
    model.initialize(3)
    routers = [layer.router for _, layer in model.moe_layers()]
    assert len(routers) == 2
    start_bias = [torch.tensor([0.05, -0.02, 0.0, 0.01]), torch.tensor([0.0, 0.03, -0.01, 0.02])]
    for r, bias in zip(routers, start_bias):
        r.expert_bias.copy_(bias)
    inputs = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach())) for r in routers]
    balance.start_iteration([model], 1.0)
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
    model(ids, torch.arange(S).expand(B, S), None, ids).mean().backward()
    for h in hooks:
        h.remove()

    expected = []
    for r, x, bias in zip(routers, inputs, start_bias):
        _, experts = ref_route(x @ r.weight.detach().t(), K, "sigmoid", bias=bias.tolist())
        load = [sum(row.count(e) for row in experts) for e in range(E)]
        assert r.tokens_per_expert.tolist() == load
        mean = sum(load) / E
        expected.append([bias[e].item() + rate * ((mean > load[e]) - (mean < load[e])) for e in range(E)])
    balance.update_expert_bias([model], None, rate)
    for r, want in zip(routers, expected):
        torch.testing.assert_close(r.expert_bias, torch.tensor(want))

    # a load with ties to the mean: those experts' biases stay put
    routers[0].tokens_per_expert.copy_(torch.tensor([3.0, 5.0, 4.0, 4.0]))
    before = routers[0].expert_bias.clone()
    balance.update_expert_bias([model], None, rate)
    torch.testing.assert_close(routers[0].expert_bias - before, torch.tensor([rate, -rate, 0.0, 0.0]))
    balance.start_iteration([model], 0.5)
    assert all(r.tokens_per_expert.sum() == 0 for r in routers)
    assert all(layer.aux_loss_scale == 0.5 for _, layer in model.moe_layers())


def test_router_statistics_count_each_forward_once():
    """Under full activation recompute the MoE layers' forward runs again in backward: the tokens per
    expert and the logged losses still count it once; an evaluation forward (no_grad) adds nothing."""
    results = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        config, execution = model_configs(**{**BASE, "num_layers": 2, "moe_aux_loss_coeff": 0.1,
                                             "moe_z_loss_coeff": 0.01}, **recompute)
        torch.manual_seed(0)
        model = GPTModel(config, execution=execution)
        model.initialize(1)
        ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(S).expand(B, S)
        balance.start_iteration([model], 1.0)
        model(ids, pos, None, ids).mean().backward()
        model.eval()
        with torch.no_grad():
            model(ids, pos, None, ids)
        routers = [layer.router for _, layer in model.moe_layers()]
        for r in routers:
            assert r.tokens_per_expert.sum() == S * B * K
        results.append([(r.tokens_per_expert.clone(), r.aux_loss_sum, r.z_loss_sum, r.weight.grad) for r in routers])
    for plain, recomputed in zip(*results):
        for a, b in zip(plain, recomputed):
            torch.testing.assert_close(a, b)


# -- 4. capacity dropping -----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [1, 3, 5, 40])
def test_capacity_mask(policy, capacity):
    gen = torch.Generator().manual_seed(capacity)
    T = 20
    probs, experts = ref_route(torch.randn(T, E, generator=gen) * 2, K)
    got = capacity_mask(torch.tensor(probs), torch.tensor(experts), E, capacity, policy)
    assert got.tolist() == ref_keep(probs, experts, E, capacity, policy)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_router_drops_over_capacity(policy, factor):
    layer = moe_layer(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy)
    x = tokens().reshape(S * B, H)
    routing = layer.router(x, None, (S, B))  # with grad: a training forward counts its tokens
    with torch.no_grad():
        probs, experts = ref_route(x @ layer.router.weight.t(), K)
    capacity = math.ceil(S * B * K / E * factor)
    keep = ref_keep(probs, experts, E, capacity, policy)
    assert any(not kept for row in keep for kept in row)  # something is dropped
    assert routing.kept.tolist() == keep
    want = [[p if kept else 0.0 for p, kept in zip(pr, kr)] for pr, kr in zip(probs, keep)]
    torch.testing.assert_close(routing.probs.detach(), torch.tensor(want), rtol=1e-5, atol=1e-6)
    per_expert = [sum(1 for t in range(S * B) for j in range(K) if experts[t][j] == e and keep[t][j])
                  for e in range(E)]
    assert max(per_expert) <= capacity
    assert layer.router.tokens_per_expert.tolist() == per_expert
    # the dispatcher sends exactly the kept choices
    order, counts, _ = sort_by_expert(routing.indices, routing.kept, 0, E, E)
    assert counts.tolist() == per_expert
    assert sorted((int(c) // K, experts[int(c) // K][int(c) % K]) for c in order) == sorted(
        (t, experts[t][j]) for t in range(S * B) for j in range(K) if keep[t][j])


# -- 5. the whole layer vs a token-by-token loop ------------------------------------------------

@pytest.mark.parametrize("settings", [
    dict(swiglu=True),
    dict(swiglu=False, moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=12),
    dict(swiglu=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
         moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
    dict(swiglu=False, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs"),
    dict(swiglu=True, moe_expert_capacity_factor=0.75, moe_token_drop_policy="position",
         moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True, moe_aux_loss_coeff=0.1),
    # gpt-oss's experts: the dense MLP's quick-GeGLU with its offset and clamp (std 3: some clamped)
    dict(swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0, std=3.0),
    # Megatron-LM's default (no --disable-bias-linear): biased experts, router and shared expert
    dict(swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0, std=2.0,
         add_bias_linear=True, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
    # each expert's input padded to its capacity: the same function
    dict(swiglu=True, add_bias_linear=True, moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True),
], ids=["swiglu", "gelu-presoftmax-shared", "sigmoid-bias-gated-shared", "gelu-drop-probs", "swiglu-drop-position",
        "gpt-oss-glu", "gpt-oss-biases", "padded-to-capacity"])
def test_layer_matches_loop(settings):
    settings = dict(settings)
    layer = moe_layer(std=settings.pop("std", 0.5), **settings)
    if settings.get("quick_geglu"):
        settings["swiglu"] = "gpt-oss"
    if settings.get("moe_router_enable_expert_bias"):
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    x = tokens()
    with torch.no_grad():
        got = layer(x)
        want = ref_layer(layer, x, settings["swiglu"], settings.get("moe_router_score_function", "softmax"),
                         settings.get("moe_router_pre_softmax", False), settings.get("moe_expert_capacity_factor"),
                         settings.get("moe_token_drop_policy", "probs"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))
    assert want.abs().max() > 0.1


# -- 6. grouped GEMM == loop, an expert without tokens included ---------------------------------

@pytest.mark.parametrize("swiglu,bias", [(True, False), (False, False), (True, True)])
def test_grouped_gemm_matches_loop(swiglu, bias, monkeypatch):
    # torch._grouped_mm itself, on the CPU too (where --moe-grouped-gemm otherwise runs the loop)
    monkeypatch.setattr(experts_module, "GROUPED_MM_DEVICES", frozenset({"cpu", "cuda"}))
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw))
    layers = [moe_layer(swiglu=swiglu, moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.01, add_bias_linear=bias)
              for grouped in (False, True)]
    assert [layer.experts.grouped for layer in layers] == [False, True]
    # inputs all positive and expert 3's router row all negative: expert 3 gets no token
    x = tokens().abs()
    for layer in layers:
        with torch.no_grad():
            layer.router.weight[3] = -1.0
            if bias:
                layer.router.bias[3] = -100.0
    grad_out = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    outs, x_grads = [], []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * grad_out).sum().backward()
        outs.append(y.detach())
        x_grads.append(xi.grad)
    assert layers[1].router.tokens_per_expert.tolist()[3] == 0
    assert min(layers[1].router.tokens_per_expert.tolist()[:3]) > 0
    # the grouped GEMM sums in its own order (tolerances.py): forward fc1 and fc2 over 16 and 8
    # terms; backward, a weight's gradient over an expert's rows (at most S x B x K = 32)
    assert_close_fp32(outs[1], outs[0], k=H, chain=2)
    assert_close_fp32(x_grads[1], x_grads[0], k=S * B * K, chain=3)
    looped, grouped = (dict(layer.named_parameters()) for layer in layers)
    assert looped.keys() == grouped.keys()
    for name in looped:
        assert grouped[name].grad is not None, name
        assert_close_fp32(grouped[name].grad, looped[name].grad, k=S * B * K, chain=3, msg=name)
    for name, p in grouped.items():
        if ".local_experts.3." in name:
            assert p.grad.abs().max() == 0, name
        elif ".local_experts." in name:
            assert p.grad.abs().max() > 0, name
    assert len(calls) == 2  # one per projection


def test_grouped_gemm_on_cpu_runs_the_loop(monkeypatch):
    """On the CPU --moe-grouped-gemm computes with the loop (faster there): no torch._grouped_mm,
    bitwise the loop's output."""
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: pytest.fail("torch._grouped_mm on the CPU"))
    looped, grouped = (moe_layer(moe_grouped_gemm=g) for g in (False, True))
    assert grouped.experts.grouped
    x = tokens()
    assert torch.equal(looped(x), grouped(x))


# -- 7. group-limited routing, the scaling factor, the router's dtype ------------------------------

def ref_group_choice(values: list[float], k: int, groups: int, group_topk: int) -> list[int]:
    """Megatron-LM's group_limited_topk for one token: groups of consecutive experts, each scored by
    the sum of its top k // group_topk values; the top-k among the best group_topk groups' experts."""
    size = len(values) // groups
    members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    score = [sum(sorted((values[e] for e in m), reverse=True)[:k // group_topk]) for m in members]
    kept = sorted(range(groups), key=lambda g: -score[g])[:group_topk]
    return sorted((e for g in kept for e in members[g]), key=lambda e: -values[e])[:k]


def ref_group_probs(logits: torch.Tensor, k: int, groups: int, group_topk: int, score_function: str,
                    pre_softmax: bool, bias, scaling: float):
    """(probs [T, k] differentiable in logits, experts [T][k], plain top-k of the scores [T][k])."""
    probs, experts = [], []
    for row in logits:
        if score_function == "softmax":
            soft = torch.exp(row) / torch.exp(row).sum()
            values = (soft if pre_softmax else row).tolist()
            chosen = ref_group_choice(values, k, groups, group_topk)
            p = soft[chosen] if pre_softmax else torch.exp(row[chosen]) / torch.exp(row[chosen]).sum()
        else:
            sig = 1.0 / (1.0 + torch.exp(-row))
            values = [v + (0.0 if bias is None else b) for v, b in zip(sig.tolist(), bias or [0.0] * len(row))]
            chosen = ref_group_choice(values, k, groups, group_topk)
            p = sig[chosen] / sig[chosen].sum() if k > 1 else sig[chosen]
        probs.append(p * scaling)
        experts.append(chosen)
    return torch.stack(probs), experts


@pytest.mark.parametrize("score_function,pre_softmax,bias,k,groups,group_topk", [
    ("softmax", False, False, 2, 4, 1), ("softmax", True, False, 4, 4, 2), ("sigmoid", False, True, 4, 4, 2),
    ("sigmoid", False, False, 4, 2, 1), ("softmax", False, False, 3, 2, 1)])
def test_group_limited_routing_matches_reference(score_function, pre_softmax, bias, k, groups, group_topk):
    """Probabilities, experts, gradients (through the layer's output) and the aux loss, which
    counts the plain top-k of the scores (Megatron-LM's compute_routing_scores_for_aux_loss)."""
    n, scaling = 8, 2.5
    layer = moe_layer(num_experts=n, moe_router_topk=k, moe_router_num_groups=groups,
                      moe_router_group_topk=group_topk, moe_router_topk_scaling_factor=scaling,
                      moe_router_score_function=score_function, moe_router_pre_softmax=pre_softmax,
                      moe_router_enable_expert_bias=bias, moe_aux_loss_coeff=0.1)
    bias_values = [0.3, -0.2, 0.1, 0.0, -0.4, 0.25, 0.05, -0.1] if bias else None
    if bias:
        layer.router.expert_bias.copy_(torch.tensor(bias_values))
    x = tokens().reshape(S * B, H).requires_grad_()
    routing = layer.route(x, (S, B))
    weight = layer.router.weight.detach().clone().requires_grad_()
    want_probs, want_experts = ref_group_probs(x @ weight.t(), k, groups, group_topk, score_function, pre_softmax,
                                               bias_values, scaling)
    assert routing.indices.tolist() == want_experts
    assert_close_fp32(routing.probs, want_probs, k=n, chain=3)  # the logits' 16 terms, then 8 experts' softmax
    plain = torch.topk(x @ weight.t() if score_function == "softmax" and not pre_softmax else
                       torch.softmax(x @ weight.t(), -1) if score_function == "softmax" else
                       torch.sigmoid(x @ weight.t()) + torch.tensor(bias_values or [0.0] * n), k).indices.tolist()
    assert [set(e) for e in plain] != [set(e) for e in want_experts]  # the groups changed some token's choice
    # gradients of the probabilities and the aux loss, against the reference's
    r = torch.randn(routing.probs.shape, generator=torch.Generator().manual_seed(3))
    (routing.probs * r).sum().add(routing.loss).backward()
    aux, _ = ref_losses(x, weight, "aux_loss", 0.1, None, score_function, S, B, k)
    (want_probs * r).sum().add(aux).backward()
    assert_close_fp32(layer.router.weight.grad, weight.grad, k=S * B, chain=4)  # summed over 32 tokens
    torch.testing.assert_close(routing.loss, aux, rtol=1e-5, atol=1e-7)


def test_scaling_factor_scales_the_routed_output():
    """--moe-router-topk-scaling-factor multiplies the routed experts' weights: their sum scales."""
    x = tokens()
    with torch.no_grad():
        base, scaled = moe_layer()(x), moe_layer(moe_router_topk_scaling_factor=2.5)(x)
    assert_close_fp32(scaled, 2.5 * base, k=K, chain=2)  # the factor's rounding, then the K-term weighted sum


def test_router_dtype_fp64():
    """--moe-router-dtype fp64: logits, probabilities, losses and the weighted sum in fp64; the
    probabilities agree with an fp64 computation to fp64 precision, those of fp32 routing do not."""
    x = tokens().reshape(S * B, H)
    layers = {d: moe_layer(moe_router_dtype=d, moe_aux_loss_coeff=0.1) for d in ("fp32", "fp64")}
    logits = x.double() @ layers["fp64"].router.weight.double().t()
    want = torch.softmax(torch.topk(logits, K).values, -1)
    got = {d: layer.route(x, (S, B)) for d, layer in layers.items()}
    assert got["fp64"].probs.dtype == got["fp64"].loss.dtype == torch.float64
    assert got["fp32"].probs.dtype == torch.float32
    assert (got["fp64"].probs - want).abs().max() < 1e-14 < (got["fp32"].probs.double() - want).abs().max()
    with torch.no_grad():
        out = {d: layer(tokens()) for d, layer in layers.items()}
    assert out["fp64"].dtype == torch.float32  # the activations keep their dtype
    assert_close_fp32(out["fp32"], out["fp64"], k=H, chain=3)  # fp32 routing: logits (16 terms), softmax, sum


# -- 8. the seams: registries keyed by the flags' values ----------------------------------------

def flag_choices(config_class, field_name: str) -> set:
    import dataclasses
    return set(next(f for f in dataclasses.fields(config_class) if f.name == field_name).metadata["flag"].choices)


def test_registries_are_the_flags_choices():
    """The flags' choices (config/, torch-free) name exactly the registered classes."""
    from megalite.config import ParallelConfig
    from megalite.config.model import GPTConfig
    # flex: Megatron-LM's DeepEP / HybridEP kernels, which validation turns into alltoall (a notice)
    assert set(DISPATCHERS) == flag_choices(ParallelConfig, "moe_token_dispatcher_type") - {"flex"}
    assert set(SCORE_FUNCTIONS) == flag_choices(GPTConfig, "moe_router_score_function")
    assert set(LOAD_BALANCING) == flag_choices(GPTConfig, "moe_router_load_balancing_type")


def test_new_dispatcher_and_score_function_are_one_class_and_one_entry(monkeypatch):
    """A registered dispatcher and score function are what the layer runs: here a dispatcher that
    counts its calls and softmax scores at half temperature, against the loop reference."""
    calls = []

    class CountingDispatcher(AllGatherDispatcher):
        def dispatch(self, x, routing):
            calls.append(x.size(0))
            return super().dispatch(x, routing)

    class SharpSoftmax(SoftmaxScores):
        def __call__(self, logits, k, select, pre_softmax, expert_bias):
            return super().__call__(logits * 2, k, select, pre_softmax, expert_bias)

    monkeypatch.setitem(DISPATCHERS, "counting", CountingDispatcher)
    monkeypatch.setitem(SCORE_FUNCTIONS, "sharp", SharpSoftmax)
    layer = moe_layer(moe_token_dispatcher_type="counting", moe_router_score_function="sharp")
    x = tokens()
    with torch.no_grad():
        got = layer(x)
        layer.router.weight.mul_(2)  # the reference at the sharpened logits
        want = ref_layer(layer, x, True)
    assert_close_fp32(got, want, k=H, chain=3)
    assert calls == [S * B]


# -- 9. a small MoE GPT trains ------------------------------------------------------------------

def test_moe_gpt_trains():
    s, b = 16, 4
    config, execution = model_configs(**{**BASE, "num_layers": 2, "seq_length": s, "max_position_embeddings": s,
                                         "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
    torch.manual_seed(0)
    model = GPTModel(config, execution=execution)
    model.initialize(1)
    # a fixed batch of a repeated pattern: every sequence is a shifted copy of one period-5 cycle
    cycle = [7, 23, 41, 3, 58]
    stream = [cycle[i % 5] for i in range(s + b + 1)]
    ids = torch.tensor([stream[j:j + s] for j in range(b)])
    labels = torch.tensor([stream[j + 1:j + s + 1] for j in range(b)])
    pos = torch.arange(s).expand(b, s)
    moe_params = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    assert any(".local_experts." in n for n in moe_params) and any(".router." in n for n in moe_params)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        balance.start_iteration([model], 1.0)
        loss = model(ids, pos, None, labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.5  # about ln(64) at the start
    assert losses[-1] < 0.25 * losses[0], losses
    assert all(b < a for a, b in zip(losses[::5], losses[5::5])), losses  # falling all along
    # the MoE layers themselves learnt: every expert of every layer and the routers moved
    params = dict(model.named_parameters())
    for name, before in moe_params.items():
        assert params[name].grad is not None and params[name].grad.abs().max() > 0, name
        assert (params[name].detach() - before).abs().max() > 1e-3, name


def test_padded_to_capacity_every_expert_gets_its_capacity():
    """--moe-pad-expert-input-to-capacity: each expert's input exactly its capacity of rows, the
    output and the gradients those of the unpadded layer."""
    layers = [moe_layer(add_bias_linear=True, moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=pad)
              for pad in (False, True)]
    x = tokens()
    capacity = math.ceil(S * B * K / E * 0.75)
    counts = [layer.dispatch(x.view(S * B, H), layer.route(x.view(S * B, H), (S, B)))[1] for layer in layers]
    assert counts[1] == [capacity] * E and sum(counts[0]) < E * capacity
    grad_out = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    outs = []
    for layer in layers:
        y = layer(x)
        (y * grad_out).sum().backward()
        outs.append(y.detach())
    # padded rows change the GEMMs' shapes, so their blocking (tolerances.py): an expert's
    # gradient sums its rows, at most its capacity
    assert_close_fp32(outs[1], outs[0], k=H, chain=2)
    for (name, a), b in zip(layers[0].named_parameters(), layers[1].parameters()):
        assert_close_fp32(b.grad, a.grad, k=capacity, chain=3, msg=name)
