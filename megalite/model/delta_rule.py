"""The gated delta rule (Yang et al. 2024, "Gated Delta Networks", Eq. 10), in plain PyTorch.

Per head, with a state S [dk, dv], keys and queries L2-normalised, q scaled by 1/√dk:

    S_t = α_t S_{t-1} + β_t k_t (v_t - α_t S_{t-1}ᵀ k_t)ᵀ        α_t = exp(g_t), g_t <= 0
    o_t = S_tᵀ q_t

`recurrent_delta_rule` runs it token by token (generation, and the reference). `chunked_delta_rule`
computes the same in chunks of C tokens (Yang et al. 2024, Sec. 3.3; the WY representation of the
chunk's product of Householder-like updates, as flash-linear-attention's chunk kernel and
transformers' torch_chunk_gated_delta_rule): within a chunk everything is C x C matrix products
done for every chunk at once; only the state passes from chunk to chunk, one [dk, dv] matrix per
head. What backward keeps is linear in the sequence: the inputs, a C-wide block per token and one
state per chunk (s / C of them), never an [s, s] matrix.

With gamma_i = Σ_{j<=i in chunk} g_j (the chunk's cumulative log decay) and D[i, j] = exp(gamma_i -
gamma_j) for j <= i:

    T  = (I + tril(diag(β) K Kᵀ ⊙ D, -1))⁻¹               (unit lower triangular: one triangular solve)
    U  = T diag(β) V,  W = T diag(β exp(gamma)) K           (the chunk's updates, state-free)
    V' = U - W S                                           (values corrected by the incoming state)
    O  = (Q ⊙ exp(gamma)) S + (Q Kᵀ ⊙ D ⊙ causal) V'
    S  = exp(gamma_C) S + (K ⊙ exp(gamma_C - gamma))ᵀ V'

Packed documents (--reset-attention-mask): `seg` [b, s] names each token's document; the state
starts again at every document's first token, as if α were 0 there. In the chunked form a product
of α over a span is then 0 exactly where the span crosses a document start, so each decay factor
above is multiplied by whether its two ends lie in one document: D[i, j] by seg_i = seg_j, the
incoming state's exp(gamma_i) by seg_i = the document of the token before the chunk, the outgoing
exp(gamma_C - gamma_j) and exp(gamma_C) likewise. Log decays stay finite, so nothing is -inf - -inf.

Everything is computed in fp32, as Megatron-LM's and transformers' reference implementations do.
On a GPU with flash-linear-attention installed, `gated_delta_rule` uses its fused chunk kernel
instead (the same function; Megatron-LM's default there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional accelerator: used on CUDA tensors when importable
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the environment
    fla_chunk_gated_delta_rule = None

CHUNK = 64  # flash-linear-attention's and transformers' chunk size


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σx² + eps) over the last dimension (flash-linear-attention's l2norm, which Megatron-LM
    and transformers apply to the gated delta rule's queries and keys)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None, seg: torch.Tensor | None = None):
    """The recurrence token by token. q, k [b, s, h, dk] (normalised), v [b, s, h, dv], g, beta
    [b, s, h]; state [b, h, dk, dv] or None (zeros); seg [b, s] each token's document or None
    (one): the state is zeroed where the document changes. Returns (o [b, s, h, dv] in v's dtype,
    the final state [b, h, dk, dv] fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * q.size(-1) ** -0.5
    b, s, h, dk = k.shape
    S = q.new_zeros(b, h, dk, v.size(-1)) if state is None else state.float()
    out = []
    for t in range(s):
        S = S * g[:, t].exp()[..., None, None]
        if seg is not None and t > 0:
            S = S * (seg[:, t] == seg[:, t - 1]).float()[:, None, None, None]
        k_t = k[:, t]  # [b, h, dk]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)) * beta[:, t, :, None]
        S = S + k_t[..., None] * delta[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, dim=1).to(dtype), S


def chunked_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None, chunk: int = CHUNK,
                       seg: torch.Tensor | None = None):
    """`recurrent_delta_rule`'s function, chunk by chunk (the module docstring's equations)."""
    dtype = v.dtype
    b, s, h, dk = k.shape
    dv = v.size(-1)
    pad = (-s) % chunk  # zero steps at the end: β = 0 and g = 0 leave the state as it is
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))  # [b, h, s', d]
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2) for t in (g, beta))  # [b, h, s']
    n = (s + pad) // chunk
    q = q * dk ** -0.5
    q, k, v = (t.reshape(b, h, n, chunk, t.size(-1)) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gamma = g.cumsum(-1)  # [b, h, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    keep_in = keep_out = carry = None
    if seg is not None:  # [b, 1, n, C, C] same document; [b, 1, n, C] with the chunk's start / end
        sg = torch.cat([seg, seg[:, -1:].expand(b, pad)], dim=1).reshape(b, 1, n, chunk)  # pads: the last document
        before = torch.cat([sg[:, :, :1, :1], sg[:, :, :-1, -1:]], dim=2)  # the token before each chunk
        lower = lower & (sg[..., :, None] == sg[..., None, :])
        keep_in, keep_out = (sg == before).float(), (sg == sg[..., -1:]).float()
        carry = (sg[..., -1] == before[..., 0]).float()  # [b, 1, n]: no document starts in the chunk
    # D[i, j] = exp(gamma_i - gamma_j) for j <= i (masked before exp: the upper entries could overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~lower.tril(-1), 0.0)
    gate_in = gamma.exp() if keep_in is None else gamma.exp() * keep_in  # the incoming state's decay to i
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    T = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)
    u = T @ (v * beta[..., None])  # [b, h, n, C, dv]
    w = T @ (k_beta * gate_in[..., None])  # [b, h, n, C, dk]
    last = gamma[..., -1:]  # [b, h, n, 1]
    gate_out = (last - gamma).exp() if keep_out is None else (last - gamma).exp() * keep_out
    k_out = k * gate_out[..., None]  # each key's decay to the chunk's end
    last = last.exp() if carry is None else last.exp() * carry[..., None]  # the state's decay through the chunk
    S = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    states, fixed = [], []
    for i in range(n):  # only the state is sequential
        states.append(S)
        v_new = u[:, :, i] - w[:, :, i] @ S
        fixed.append(v_new)
        S = S * last[:, :, i, :, None] + k_out[:, :, i].transpose(-1, -2) @ v_new
    states, v_new = torch.stack(states, dim=2), torch.stack(fixed, dim=2)  # [b, h, n, dk, dv], [b, h, n, C, dv]
    intra = (q @ k.transpose(-1, -2) * decay).masked_fill(~lower, 0.0)
    o = (q * gate_in[..., None]) @ states + intra @ v_new  # [b, h, n, C, dv]
    o = o.reshape(b, h, n * chunk, dv)[:, :, :s].transpose(1, 2)
    return o.to(dtype), S


def gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None, final_state: bool = False,
                     seg: torch.Tensor | None = None):
    """The layer's entry: flash-linear-attention's chunk kernel on CUDA when installed (it
    normalises nothing: q and k come normalised), else `chunked_delta_rule`; packed documents
    (`seg`) take `chunked_delta_rule`. Returns (o, final state or None)."""
    if fla_chunk_gated_delta_rule is not None and q.is_cuda and seg is None:  # pragma: no cover - GPU and fla
        # (one dtype for every input, fp32 as the plain path computes; not run in this project's tests:
        # no GPU with flash-linear-attention installed)
        o, S = fla_chunk_gated_delta_rule(q.float(), k.float(), v.float(), g=g.float(), beta=beta.float(),
                                          initial_state=state, output_final_state=final_state,
                                          use_qk_l2norm_in_kernel=False)
        return o.to(v.dtype), S
    o, S = chunked_delta_rule(q, k, v, g, beta, state, seg=seg)
    return o, (S if final_state else None)
