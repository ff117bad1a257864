"""From a dataset to the micro-batches each model chunk consumes: inputs, labels and masks.

The sample order is a function of the seed and `consumed_samples` only (samplers.py). TP rank 0
of each model-parallel group reads; the other TP ranks receive each micro-batch by broadcast, so
the TP ranks of one replica always see the same tokens. The CP ranks of one replica read the same
samples too (the sampler splits over DP only) and each keeps its two chunks of the sequence
(context_parallel/), after the masks and position ids are built on the whole sequence.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .. import comm
from ..config import DataConfig
from ..context_parallel.documents import Documents
from ..context_parallel.sharding import slice_batch
from .samplers import PretrainingSampler


def collate(samples: list[dict]) -> torch.Tensor:
    """Stack the samples' `text` ([s + 1] each) into [b, s + 1] int64."""
    return torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))


def build_batch(tokens: torch.Tensor, eod: int | None = None, reset_position_ids: bool = False,
                reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                create_attention_mask: bool = True) -> dict:
    """tokens [b, s + 1] -> dict of input_ids, labels, loss_mask, position_ids ([b, s]) and
    attention_mask (None = plain causal; under --reset-attention-mask a context_parallel.documents
    `Documents`: the document id of every token, [b, s], in place of Megatron-LM's [b, 1, s, s] mask).

    A document ends at its end-of-document token; the next token starts a new document, whose
    positions restart at 0 (--reset-position-ids) and which cannot see earlier documents
    (--reset-attention-mask), as Megatron-LM's get_ltor_masks_and_position_ids. No [s, s] mask is
    ever built: plain causal attention needs none, and documents are attended tile by tile from
    their ids; `create_attention_mask` False (--no-create-attention-mask-in-dataloader) builds none.
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
        if reset_attention_mask and create_attention_mask:
            index = torch.arange(s, device=tokens.device)
            attention_mask = Documents(doc_id, index, index)
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": attention_mask}


def micro_batches(dataset, consumed_samples: int, cfg: DataConfig, ps, device: torch.device,
                  eod: int | None) -> Iterator[dict]:
    """This rank's micro-batches from `consumed_samples` on, built on `device`."""
    loader = None
    if ps.tp_rank == 0:
        sampler = PretrainingSampler(len(dataset), consumed_samples, cfg.micro_batch_size, ps.dp_rank, ps.dp_size)
        # its own generator: creating an iterator must not draw from the default stream that
        # dropout uses (a resumed run would otherwise see shifted dropout masks)
        loader = iter(torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate, num_workers=cfg.num_workers,
            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(cfg.seed)))
    shape = (cfg.micro_batch_size, cfg.seq_length + 1)
    while True:
        if loader is not None:
            tokens = next(loader).to(device, non_blocking=True)
            if tuple(tokens.shape) != shape:
                raise ValueError(f"data loader gave a batch of shape {tuple(tokens.shape)}, expected {shape}")
        else:
            tokens = torch.empty(shape, dtype=torch.int64, device=device)
        comm.broadcast(tokens, ps.tp_ranks[0], ps.tp_group)
        batch = build_batch(tokens, eod, cfg.reset_position_ids, cfg.reset_attention_mask, cfg.eod_mask_loss,
                            cfg.create_attention_mask_in_dataloader)
        yield slice_batch(batch, getattr(ps, "cp_size", 1), getattr(ps, "cp_rank", 0))
