"""Forward and backward of one micro-batch on one model chunk, shared by every schedule
(schedules.py, zero_bubble.py): the loss sum and its normalisation, the backward from a received
output gradient, and freeing a sent activation's storage (see schedules.py for the loss scaling)."""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import Variable


class Step:
    """Forward and backward of one micro-batch on one chunk, shared by every schedule."""

    def __init__(self, batches, model, backward_scale, forward_only, microbatch_mean=False, timeline=None):
        self.batches, self.model = batches, model
        self.backward_scale, self.forward_only = backward_scale, forward_only
        self.microbatch_mean = microbatch_mean
        self.stats = []
        self.timeline = timeline  # --log-pipeline-timeline (timeline.py)
        self.counts = {}  # (kind, chunk) -> passes so far: the micro-batch of the next one

    def _span(self, kind: str, chunk_id: int):
        n = self.counts.get((kind, chunk_id), 0)
        self.counts[(kind, chunk_id)] = n + 1
        return self.timeline.span(kind, chunk_id, n) if self.timeline is not None else contextlib.nullcontext()

    def forward(self, chunk_id: int, input_tensor):
        with self._span("F", chunk_id):
            return self._forward(chunk_id, input_tensor)

    def backward(self, input_tensor, output_tensor, output_grad, chunk_id: int = 0, kind: str = "BW"):
        """Backward through one chunk (BW: all of it; B: the input gradient of the zero-bubble
        split, whose weight gradients wait in a WgradStore); returns its input's gradient."""
        with self._span(kind, chunk_id):
            return self._backward(input_tensor, output_tensor, output_grad)

    def _forward(self, chunk_id: int, input_tensor):
        chunk = self.model[chunk_id]
        chunk.set_input_tensor(input_tensor)
        batch = next(self.batches[chunk_id])
        with torch.set_grad_enabled(not self.forward_only):
            # MTP (model/mtp.py) rolls the loss mask with the labels: the chunk that holds it gets it
            mtp = {"loss_mask": batch["loss_mask"]} if getattr(chunk, "mtp", None) is not None else {}
            out = chunk(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"], **mtp)
            if not chunk.post_process:
                return out  # activations for the next stage
            mask = batch["loss_mask"]
            loss_sum = (out.float() * mask).sum()  # [b, s] per-token losses -> the micro-batch's sum
        num_tokens = mask.sum()
        # under context parallelism, the whole sequence's count: the CP ranks' partial sums (summed
        # with the gradients over DP x CP) then make the micro-batch's mean
        denominator = batch.get("num_tokens_sequence", num_tokens)
        mtp = chunk.mtp_loss(denominator, self.microbatch_mean) if mtp else None
        self.stats.append((loss_sum.detach(), num_tokens) + ((mtp[1],) if mtp is not None else ()))
        if self.microbatch_mean:  # a micro-batch without loss tokens adds 0 (Megatron-LM's would be NaN)
            loss_sum = loss_sum / denominator.clamp(min=1)
        if mtp is not None:  # the MTP loss, weighed by --mtp-loss-scaling-factor / D, in the same normalisation
            loss_sum = loss_sum + mtp[0]
        return loss_sum * self.backward_scale

    @staticmethod
    def _backward(input_tensor, output_tensor, output_grad):
        if output_grad is None:  # the loss
            torch.autograd.backward(output_tensor)
        else:
            # the output's storage was released after sending (see release): only its autograd
            # node is needed, which torch.autograd.backward's shape check would not allow
            Variable._execution_engine.run_backward(
                tensors=(output_tensor,), grad_tensors=(output_grad,), keep_graph=False, create_graph=False,
                inputs=(), allow_unreachable=True, accumulate_grad=True)
        return input_tensor.grad if input_tensor is not None else None


def release(t: torch.Tensor | None) -> None:
    """Free a sent activation's storage; its autograd graph stays (Megatron's
    deallocate_output_tensor). The receiver holds its own copy."""
    if t is not None and t._base is None and t.requires_grad:
        t.data = torch.empty((1,), device=t.device, dtype=t.dtype)
