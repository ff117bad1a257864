"""Context-parallel attention of one layer, by --cp-comm-type (context_parallel/__init__.py):
allgather (keys and values of the whole sequence from every rank's chunks), a2a (Ulysses), p2p
(ring) and a2a+p2p (Ulysses within the first hierarchy level, a ring across the second)."""
from __future__ import annotations

import torch

from .. import comm
from .documents import Documents
from .ring import BlockMask, ring_attention
from .sharding import chunk_positions, gathered_positions
from .ulysses import gather_heads, scatter_heads


class _GatherKV(torch.autograd.Function):
    """All-gather [s/c, b, g, hn] along s over the CP group; backward reduce-scatters, since
    every rank's queries contributed to the gradient of every key and value."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad.contiguous(), ctx.group, dim=0), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[s/c, b, ...] -> [s, b, ...] in gathered key order (backward reduce-scatters): MLA's keys and
    values, whose head sizes differ, gathered as one tensor."""
    return _GatherKV.apply(x, group)


def gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence ([s, b, g, hn], gathered key order) from this
    rank's [s/c, b, g, hn]. One collective for both (concatenated on the head dimension)."""
    g = k.size(2)
    kv = _GatherKV.apply(torch.cat([k, v], dim=2), group)
    return kv[:, :, :g], kv[:, :, g:]


def set_hierarchy(model: torch.nn.Module, levels: list) -> None:
    """Give every attention layer of `model` the --hierarchical-context-parallel-sizes groups
    (parallel_state.ParallelState.hcp_groups: this rank's group per level), which a2a+p2p uses."""
    for module in model.modules():
        if hasattr(module, "cp_levels"):
            module.cp_levels = list(levels)


def _as_allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool mask (True: may attend) of a bool or additive one (megalite's are 0 / -inf)."""
    return mask if mask is None or mask.dtype == torch.bool else mask == 0


def _gather_rows(mask: torch.Tensor | None, group) -> torch.Tensor | None:
    """[B, 1, sl, s] (or GPTModel's [sl, s]) -> [B, 1, a·sl, s]: the mask rows of the group's
    queries (rank order)."""
    if mask is not None and mask.dim() == 2:
        mask = mask[None, None]
    if mask is None or comm.group_size(group) == 1:
        return mask
    if mask.dtype == torch.bool:  # gloo has no bool collectives
        return comm.all_gather(mask.to(torch.uint8), group, dim=2).bool()
    return comm.all_gather(mask, group, dim=2)


def level_positions(seq_length: int, cp_size: int, a: int, j: int, device=None) -> torch.Tensor:
    """Global positions of the tokens the a2a group j (CP ranks j·a .. j·a+a-1) holds together,
    in rank order: the queries after its all-to-all, or the keys ring member j sends."""
    return torch.cat([chunk_positions(seq_length, cp_size, j * a + m, device) for m in range(a)])


def ulysses_attention(q, k, v, attention_mask, window, group, attend) -> torch.Tensor:
    """--cp-comm-type a2a: q [sl, b, n, hn], k/v [sl, b, g, hn] -> [sl, b, n·hn]. After the
    all-to-all the whole sequence is put back in order, so `attend(q, k, v, mask)` (the layer's
    core attention) runs exactly as on one process: mask None for causal, the band for a window,
    the document mask's rows gathered from the group and reordered."""
    sl, b, n, hn = q.shape
    c = comm.group_size(group)
    s = sl * c
    gathered = gathered_positions(s, c, q.device)  # position of each row after the all-to-all
    natural = torch.argsort(gathered)
    q, k, v = (t.index_select(0, natural) for t in scatter_heads(q, k, v, group))
    if isinstance(attention_mask, Documents):  # packed documents: the whole sequence, in order
        pos = torch.arange(s, device=q.device)
        out = attend(q, k, v, Documents(attention_mask.doc_ids, pos, pos, window))
        return gather_heads(out.view(s, b, n // c, -1).index_select(0, gathered), group).reshape(sl, b, -1)
    mask = _gather_rows(attention_mask, group)
    if mask is not None:
        mask = mask.index_select(2, natural).index_select(3, natural)
    if window is not None:
        pos = torch.arange(s, device=q.device)
        mask = window_mask(pos, pos, window, mask)
    out = attend(q, k, v, mask)  # [s, b, n/c·hn]
    out = out.view(s, b, n // c, -1).index_select(0, gathered)
    return gather_heads(out, group).reshape(sl, b, -1)


def ring_layer_attention(q, k, v, attention_mask, window, a2a_group, ring_group) -> torch.Tensor:
    """--cp-comm-type p2p (a2a_group None) and a2a+p2p: q [sl, b, n, hn], k/v [sl, b, g, hn] ->
    [sl, b, n·hn]. With an a2a level the a group members first exchange heads (Ulysses), then the
    ring runs over the second level, each member's keys those of its whole a2a group."""
    sl, b, n, hn = q.shape
    a, p = comm.group_size(a2a_group), comm.group_size(ring_group)
    s = sl * a * p
    if a > 1:
        q, k, v = scatter_heads(q, k, v, a2a_group)
    kv_pos = torch.stack([level_positions(s, a * p, a, j, q.device) for j in range(p)])
    if isinstance(attention_mask, Documents):  # packed documents: same-document from their ids
        mask = BlockMask(kv_pos[comm.group_rank(ring_group)], kv_pos, window, doc_ids=attention_mask.doc_ids)
    else:
        dense = _as_allowed(_gather_rows(attention_mask, a2a_group))
        mask = BlockMask(kv_pos[comm.group_rank(ring_group)], kv_pos, window, dense)
    out = ring_attention(q, k, v, mask, ring_group)  # [a·sl, b, n/a·hn]
    if a > 1:
        out = gather_heads(out.view(a * sl, b, n // a, -1), a2a_group)
    return out.reshape(sl, b, -1)


def window_mask(q_pos, k_pos, window: int, attention_mask=None) -> torch.Tensor:
    """`attention_mask` (None: causal) narrowed to the sliding window over global positions q_pos
    [sq] and k_pos [sk]: query i sees key j when 0 <= i - j <= window."""
    distance = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # [sq, sk]
    allowed = (distance >= 0) & (distance <= window)
    if attention_mask is None:
        return allowed
    if attention_mask.dtype == torch.bool:
        return attention_mask & allowed
    return attention_mask.masked_fill(~allowed, float("-inf"))  # additive (0 / -inf)
