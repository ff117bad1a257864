"""Packed documents (--reset-attention-mask) as per-token facts instead of an [s, s] mask.

The data builds a `Documents` (data/batch.py), context parallelism slices it with the sequence
(sharding.py) and attends with it (attention.py, ring.py), and the model's attention reads it
(model/varlen_attention.py's tiled kernel, model/max_logit.py). It lives here, on the floor
below both the data and the model, so that every one of them imports it downward.
"""
from __future__ import annotations

import torch


class Documents:
    """Which keys each query may see, as per-token facts instead of a mask: `doc_ids` [b, s] the
    document of every token of the whole micro-batch sequence (natural order), `q_index` [s_q]
    and `k_index` [s_k] the sequence indices of the queries and keys this rank holds (in the
    order it holds them), `window` the sliding window (None: none). It travels through the model
    where an attention mask would (model/attention.py gives it to `document_attention`)."""

    def __init__(self, doc_ids: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                 window: int | None = None):
        self.doc_ids, self.q_index, self.k_index, self.window = doc_ids, q_index, k_index, window

    def with_queries(self, q_index: torch.Tensor) -> "Documents":
        """The same documents for some of the queries (QK-clip's logit tracker, chunk by chunk)."""
        return Documents(self.doc_ids, q_index, self.k_index, self.window)

    def with_window(self, window: int | None) -> "Documents":
        return Documents(self.doc_ids, self.q_index, self.k_index, window)

    def dense(self) -> torch.Tensor:
        """[b, 1, s_q, s_k] bool (True: may attend): the mask this stands for (tests only: quadratic)."""
        return may_attend(self.doc_ids[:, self.q_index], self.doc_ids[:, self.k_index], self.q_index,
                          self.k_index, self.window).unsqueeze(1)


def may_attend(q_doc, k_doc, q_pos, k_pos, window):
    """[b, sq, sk] bool: same document, causal in sequence index, within the window."""
    distance = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # [sq, sk]
    ok = distance >= 0
    if window is not None:
        ok = ok & (distance <= window)
    return ok.unsqueeze(0) & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1))
