"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Stages form a ring: rank r sends activations to r+1 and gradients to r-1; with interleaved
chunks the last rank's output feeds the first rank's next chunk, so the ring wraps. Every call
posts all of its sends and receives as one batch (`batch_isend_irecv`) and waits for them, so
two neighbours that exchange in both directions at once cannot deadlock, on gloo or NCCL.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


class PipeComm:
    def __init__(self, ps, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.ps, self.shape, self.dtype, self.device = ps, tuple(shape), dtype, device

    def communicate(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                    recv_prev: bool = False, recv_next: bool = False):
        """Send to the next/previous stage and receive from them, all at once. Returns
        (tensor from prev, tensor from next); received activations require grad."""
        if self.ps.pp_size == 1:
            return None, None
        # Activations first, then gradients, on every rank: with two stages the previous and next
        # rank are the same peer, and sends/receives between one pair are matched in order.
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.ps.next_pp_rank))
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.ps.prev_pp_rank))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.ps.prev_pp_rank))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.ps.next_pp_rank))
        comm.exchange(ops)  # posts all, waits for all (a timeout or a dead peer names this exchange)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # batch_isend_irecv runs on its own stream
        if from_prev is not None:
            from_prev.requires_grad_()
        return from_prev, from_next
