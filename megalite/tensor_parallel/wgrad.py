"""A backward split into B (input gradient) and W (weight gradient): --delay-wgrad-compute.

Zero-bubble pipelining (Qi et al. 2024, arXiv 2401.10241, Sec. 2) runs a layer's backward as two
passes: B, the gradient of its input, which the previous pipeline stage waits for, and W, the
gradient of its weights, which nothing needs before the optimizer step, so the schedule places it
where the pipeline would idle. For Y = X·Wᵀ + b ([*, in] -> [*, out]): B is dX = dY·W, W is
dW = dYᵀ·X and db = Σ dY; for the embedding lookup W is the scatter-add of dY into the rows.

The layers whose weight gradient is a GEMM or a scatter (column- and row-parallel linears with
and without sequence parallelism, the output layer, the experts' per-expert loop and grouped GEMM,
the word embedding) take a `wgrad_store` (`attach`, for the zero-bubble schedules). Their backward (the schedule's
B, while the store captures) returns the input gradient and queues (X, dY) with the product that
makes the weight gradient; the schedule's W (`WgradStore.pop`) computes them, sums the ones of one parameter (a
weight used twice, as autograd's input buffer would), and hands them to autograd's own
accumulation of each parameter (`torch.autograd.backward` on the leaf): `.grad`, the gradient
buffers' post-accumulate hooks and the gradient-reduction overlap they start run at W, not B, and
the gradients are those of the plain backward, bit for bit (tests/test_wgrad.py). Outside a
capture the same functions return every gradient at once. Small parameters (norms, biases of
row-parallel linears and of the experts, the router, position embeddings) keep their gradient in
B: their W is cheap next to the queue's bookkeeping.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.nn.functional as F

from . import grad_fusion


class WgradStore:
    """One pipeline rank's deferred weight gradients: one entry per captured B, run in order."""

    def __init__(self):
        self._open: list | None = None
        self._pending: deque = deque()

    @property
    def capturing(self) -> bool:
        return self._open is not None

    @contextlib.contextmanager
    def capture(self):
        """The B pass of one micro-batch on one chunk: the weight gradients it meets are queued."""
        self._open = []
        try:
            yield
        finally:
            self._pending.append(self._open)
            self._open = None

    def defer(self, fn) -> None:
        """fn() -> [(parameter, gradient), ...], computed at W."""
        self._open.append(fn)

    def __len__(self) -> int:
        return len(self._pending)

    def pop(self) -> None:
        """W of the oldest captured B: compute its weight gradients and accumulate them."""
        sums: dict = {}
        for fn in self._pending.popleft():
            for p, g in fn():
                sums[p] = g if p not in sums else sums[p] + g
        if sums:
            torch.autograd.backward(list(sums), list(sums.values()))


def _leaf(t) -> bool:
    """Whether t's gradient can be handed over later: a leaf (a parameter). A computed weight
    (e.g. LayerNorm-1p's 1 + w) has a graph that B frees."""
    return t is not None and t.requires_grad and t.is_leaf


def deferrable(store: WgradStore | None, *params) -> bool:
    """Whether a product with `params` defers their gradient: a store, grad mode, and leaves
    (None for an absent bias). The parameters then enter the autograd Function detached, so
    that B's graph has no edge to them: autograd would otherwise run their post-accumulate hooks
    in B with no gradient; W hands the gradients over (WgradStore.pop)."""
    return (store is not None and torch.is_grad_enabled()
            and all(p is None or _leaf(p) for p in params) and _leaf(params[0]))


def defer_or_fail(store: WgradStore, fn) -> None:
    if not store.capturing:
        raise RuntimeError("a deferred weight gradient met outside a pipeline schedule's B pass "
                           "(--delay-wgrad-compute runs with the zero-bubble schedules only)")
    store.defer(fn)


class _DeferredLinear(torch.autograd.Function):
    """Y = X·Wᵀ + b whose weight (and bias) gradient waits for `store`'s W. dX and dW are the
    products F.linear's backward computes (addmm/mm: dX = dY·W, dW = dYᵀ·X over the flattened
    leading dimensions), so the gradients match it bit for bit. `params`: the (weight, bias)
    parameters, outside autograd's view (a tuple)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, params, anchor):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        wgrad = _linear_wgrad(x, dy, ctx.params[1] is not None)
        params = ctx.params
        defer_or_fail(ctx.store, lambda: [(p, g) for p, g in zip(params, wgrad()) if p is not None])
        return dx, None, None, None, None, None


def _anchor(x: torch.Tensor) -> torch.Tensor:
    """An empty leaf that requires grad: with the parameters detached, an input without a
    gradient (token ids, a frozen input) would leave the product's output outside autograd."""
    return None if x.requires_grad else torch.empty(0, device=x.device, requires_grad=True)


def _linear_wgrad(x, dy, want_b: bool):
    """A closure over (X [*, in], dY [*, out]) making (dW [out, in], db [out])."""
    def make():
        dy_2d = dy.reshape(-1, dy.size(-1))
        return dy_2d.t().mm(x.reshape(-1, x.size(-1))), (dy_2d.sum(0) if want_b else None)
    return make


def linear(x, weight, bias=None, store: WgradStore | None = None):
    """F.linear, with the weight gradient deferred to `store`'s W, or else fused into its
    gradient buffer (grad_fusion.py) where the weight has one."""
    if not deferrable(store, weight, bias):
        fused = grad_fusion.linear(x, weight, bias)
        return F.linear(x, weight, bias) if fused is None else fused
    return _DeferredLinear.apply(x, weight.detach(), None if bias is None else bias.detach(), store, (weight, bias),
                                 _anchor(x))


class _DeferredEmbedding(torch.autograd.Function):
    """F.embedding(ids, W): no input gradient; W's is the dense embedding backward (the
    scatter-add F.embedding's backward calls), at `store`'s W."""

    @staticmethod
    def forward(ctx, ids, weight, store, param, anchor):
        ctx.save_for_backward(ids)
        ctx.store, ctx.param, ctx.num_rows = store, param, weight.size(0)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        num_rows, (param,) = ctx.num_rows, ctx.param
        defer_or_fail(ctx.store, lambda: [(param, torch.ops.aten.embedding_dense_backward(dy, ids, num_rows, -1, False))])
        return None, None, None, None, None


def embedding(ids, weight, store: WgradStore | None = None):
    """F.embedding, with the weight gradient deferred to `store`'s W."""
    if not deferrable(store, weight):
        return F.embedding(ids, weight)
    return _DeferredEmbedding.apply(ids, weight.detach(), store, (weight,), _anchor(ids))


class _DeferredGroupedMM(torch.autograd.Function):
    """Y = torch._grouped_mm(X, W, offs) (rows of X grouped by expert, W [E, in, out] the stacked
    transposes of `params`, each [out, in]) with the weights' gradient at `store`'s W: dX =
    grouped_mm(dY, Wᵀ) and dW_e = (X_eᵀ·dY_e)ᵀ, one grouped product over the groups' rows, the
    products the kernel's own backward computes (bit for bit, tests/test_wgrad.py)."""

    @staticmethod
    def forward(ctx, x, w, offs, store, params):
        ctx.save_for_backward(x, w, offs)
        ctx.store, ctx.params = store, params
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()  # the kernel refuses a broadcast (stride-0) gradient
        dx = torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
        params = ctx.params
        defer_or_fail(ctx.store, lambda: [(p, g.t()) for p, g in
                                          zip(params, torch._grouped_mm(x.t(), dy, offs=offs).unbind(0))])
        return dx, None, None, None, None


def grouped_mm(x, weights: list, offs, store: WgradStore | None):
    """torch._grouped_mm(x, stack(wᵀ for w in weights), offs) with the weights' gradient deferred to
    `store`'s W; None when it cannot defer (the caller runs the plain product)."""
    if not deferrable(store, *weights):
        return None
    w = torch.stack([p.detach().t() for p in weights])
    return _DeferredGroupedMM.apply(x, w, offs, store, tuple(weights))


def attach(chunks, store: WgradStore | None) -> int:
    """Give every module of `chunks` that can defer its weight gradient (a class attribute
    `wgrad_store`) the store; returns how many. A chunk whose tied output layer ZeRO-3 gathers for
    itself (TiedOutputGather, which hands its gradient over in B) keeps its word embedding's in B
    too: one parameter's gradient arrives once per micro-batch."""
    n = 0
    for chunk in chunks:
        keep = set()
        if getattr(chunk, "output_weight_gather", None) is not None and chunk.embedding is not None:
            keep.add(id(chunk.embedding.word_embeddings))
        for module in chunk.modules():
            if hasattr(type(module), "wgrad_store") and id(module) not in keep:
                module.wgrad_store = store
                n += 1
    return n
