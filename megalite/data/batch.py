"""From a micro-batch of token sequences to model inputs, labels and masks."""
from __future__ import annotations

import numpy as np
import torch


def collate(samples: list[dict]) -> torch.Tensor:
    """Stack the samples' `text` ([s + 1] each) into [b, s + 1] int64."""
    return torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))


def build_batch(tokens: torch.Tensor, eod: int | None = None, reset_position_ids: bool = False,
                reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict:
    """tokens [b, s + 1] -> dict of input_ids, labels, loss_mask, position_ids ([b, s]) and
    attention_mask ([b, 1, s, s] bool, True = may attend; None = plain causal).

    A document ends at its end-of-document token; the next token starts a new document, whose
    positions restart at 0 (--reset-position-ids) and which cannot see earlier documents
    (--reset-attention-mask), as Megatron-LM's get_ltor_masks_and_position_ids.
    """
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    b, s = input_ids.shape
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=tokens.device)
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s).contiguous()
    attention_mask = None
    if eod is not None and (eod_mask_loss or reset_position_ids or reset_attention_mask):
        is_eod = input_ids == eod
        if eod_mask_loss:
            loss_mask[is_eod] = 0.0
        # the token after an end-of-document starts a new document
        starts = torch.zeros_like(is_eod)
        starts[:, 1:] = is_eod[:, :-1]
        doc_id = starts.long().cumsum(dim=1)  # [b, s]
        if reset_position_ids:
            start_pos = torch.where(starts, position_ids, torch.zeros_like(position_ids)).cummax(dim=1).values
            position_ids = position_ids - start_pos
        if reset_attention_mask:
            causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
            attention_mask = (causal & (doc_id.unsqueeze(2) == doc_id.unsqueeze(1))).unsqueeze(1)
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": attention_mask}
