"""Tolerances that follow from fp32 arithmetic, not from one machine's kernels.

Two code paths that compute the same function in fp32 (grouped against looped experts, cached
against recomputed attention, CP chunks against the whole sequence, TP shards against the whole
layer) sum the same terms in different orders: the BLAS and oneDNN kernels a CPU picks (AVX2,
AVX-512, AMX) block, vectorise and fuse multiply-adds differently. Neither result is wrong; each
is within rounding of the exact sum, and the bound on that is arithmetic, not a machine's:

  a sum of k terms evaluated in any order, with or without FMA, differs from the exact sum by at
  most γ_k · Σ|terms|, γ_k = k·u / (1 − k·u), u = 2⁻²⁴ for fp32 (Higham, Accuracy and Stability
  of Numerical Algorithms, 2nd ed., Lemma 3.1 and eq. (3.5) for dot products).

So two evaluations differ by at most 2·γ_k·Σ|terms|; a value that went through `chain` such
reductions in a row (a matmul, then a softmax's sum, then another matmul) by about `chain` times
that. The tests take Σ|terms| as the largest magnitude of the compared tensor (`scale`), or pass
a better one; γ_k grows like k, while rounding errors of independent terms grow like √k, which
leaves room for moderate cancellation.

For a deep chain (a whole model's forward: some twenty reductions) the worst case compounds far
beyond what rounding does, and `bound="probable"` takes Higham and Mary's probabilistic bound
instead ("A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5),
2019, for inner products; rounding errors taken as independent): a k-term sum's error stays within
λ·√k·u·Σ|terms| with probability at least 1 − 2k·exp(−λ²(1 − u)²/2); λ = 6 makes that
1 − 8e-6 for k = 256. The chain's sums round independently of each other too, so their errors
add up like chain·k independent terms: λ·√(chain·k)·u relative to the output's scale.

Where the same kernels run on the same shapes (a resume from a checkpoint, a recompute that
replays the forward, a reference that is the same op) the comparison stays exact: no tolerance.

End-to-end training comparisons (a layout against one process over several Adam steps:
dist_helpers' assert_losses_close and assert_params_close, rtol 1e-5 on losses, 1e-4 or 1e-5 on
the clipped gradient norm, atol 1e-5 on parameters) have no closed-form bound: Adam's update
m/(√v + ε) turns rounding noise in a tiny gradient into a step of about lr, and each step's
weights feed the next. They stay as stated, about 100 u relative on quantities that average
thousands of terms (a loss over a batch's tokens, a norm over every gradient), with --adam-eps
keeping the amplification small where a test needs it; a layout bug moves them by 1e-3 or more.
The probable bound of a deep chain (`model_rounding`) is looser than these, and widening them to
it would let through the bugs they exist for.
"""
from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # fp32's unit roundoff: |fl(x) - x| <= u |x| (round to nearest)


def gamma(k: int, u: float = U32) -> float:
    """Higham's γ_k: the relative error bound of a k-term sum or dot product in floating point."""
    if k * u >= 1:
        raise ValueError(f"gamma({k}) is unbounded in this precision")
    return k * u / (1 - k * u)


LAMBDA = 6.0  # the probabilistic bound's λ (module docstring)


def fp32_atol(k: int, scale: float, chain: int = 1, bound: str = "worst") -> float:
    """How far two fp32 evaluations of the same k-term sums (in `chain` reductions one after the
    other) may lie apart, for terms whose absolute values add up to `scale`: 2·chain·γ_k·scale,
    or with bound="probable" 2·λ·√(chain·k)·u·scale."""
    if bound == "probable":
        return 2 * LAMBDA * math.sqrt(chain * k) * U32 * scale
    if bound != "worst":
        raise ValueError(f"bound must be 'worst' or 'probable', got {bound!r}")
    return 2 * chain * gamma(k) * scale


# a transformer layer's reductions one after the other: the pre-norm, QKV, QK^T, the softmax, PV,
# the output projection, the MLP's norm, fc1 and fc2
LAYER_REDUCTIONS = 9


def model_rounding(k: int, layers: int, backward: bool = False) -> dict:
    """fp32_atol / assert_close_fp32 arguments for a whole model's output (`layers` layers, the
    final norm, the output layer and the loss's softmax; `k` its longest reduction), or a gradient
    (its backward runs the chain again): the probable bound of a deep chain."""
    chain = LAYER_REDUCTIONS * layers + 3
    return dict(k=k, chain=2 * chain if backward else chain, bound="probable")


def _check(got: torch.Tensor, want: torch.Tensor, bound, what: str, msg) -> None:
    assert got.shape == want.shape, f"{msg or ''} shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err) if err.ndim else torch.as_tensor(bound)
    bad = ~(err <= bound)  # NaN fails too
    if bool(bad.any()):
        ratio = (err / bound.clamp(min=1e-300)).max()
        i = int(torch.argmax(torch.where(bad, err / bound.clamp(min=1e-300), torch.zeros_like(err))))
        prefix = f"{msg}: " if msg else ""
        raise AssertionError(f"{prefix}{int(bad.sum())} of {err.numel()} elements beyond {what} (worst {float(ratio):.1f}x "
                             f"the bound; element {i}: {float(got.reshape(-1)[i])} vs {float(want.reshape(-1)[i])}, "
                             f"bound {float(bound.reshape(-1)[i]) if bound.ndim else float(bound):.3e})")


def assert_close_fp32(got: torch.Tensor, want: torch.Tensor, *, k: int, chain: int = 1, scale=None,
                      bound: str = "worst", msg=None) -> None:
    """Two fp32 code paths agree within `fp32_atol` per element. `k`: the longest reduction
    behind a value; `scale`: Σ|terms| (default: the largest |want|; a tensor gives one per
    element, e.g. |A|·|B| of a product computed in fp64)."""
    if scale is None:
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
    scale = scale.detach().double() if torch.is_tensor(scale) else scale
    _check(got.detach(), want.detach(), fp32_atol(k, 1.0, chain, bound) * scale,
           f"the {bound} bound of fp32 rounding ({chain} x {k}-term sums)", msg)


def assert_fp32_near_fp64(got: torch.Tensor, exact: torch.Tensor, *, k: int, chain: int = 1, scale=None,
                          msg=None) -> None:
    """An fp32 result against a reference computed in fp64 (exact to fp32's eye): within
    (chain·γ_k + u)·scale, the sums' rounding and the result's own."""
    if scale is None:
        scale = float(exact.detach().abs().max()) if exact.numel() else 0.0
    scale = scale.detach().double() if torch.is_tensor(scale) else scale
    _check(got.detach(), exact.detach(), (chain * gamma(k) + U32) * scale,
           f"(chain {chain}·γ_{k} + u)·scale against fp64", msg)


def logits_atol(reference: torch.Tensor, layers: int = 3, k: int = 300) -> float:
    """How far a whole model's logits may lie from another implementation's (transformers,
    megatron-core) for the same weights: the probable bound of their deep chain (`model_rounding`)
    at the reference's scale (at least 1). The tests' models have at most 3 layers and no
    reduction longer than 300 terms (vocabulary, sequence, MLP)."""
    return fp32_atol(scale=max(1.0, float(reference.detach().abs().max())), **model_rounding(k=k, layers=layers))
