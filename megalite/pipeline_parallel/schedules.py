"""Forward/backward over the micro-batches of one iteration.

A schedule takes the model chunks and, per chunk, an iterator of micro-batches (dicts from
data.batch.build_batch, already on the device); each chunk consumes the iteration's
micro-batches in order, at its own pace. The chunk that holds the loss (last stage, last
virtual chunk) returns per-token losses; the schedule sums them over the loss mask. Backward
runs on that sum x `backward_scale` (the loss scale over the nominal number of tokens in the
global batch), so gradients summed over micro-batches and DP ranks are those of the
global-batch mean loss. With `microbatch_mean` (Megatron-LM's default loss) the sum is first
divided by the micro-batch's own token count, and `backward_scale` is the loss scale over the
number of micro-batches in the global batch: the mean of the micro-batches' token means. A
schedule returns the per-micro-batch (loss_sum, num_tokens), as device tensors, on the last
stage and [] elsewhere.

Schedules (Narayanan et al. 2021, Sec. 2.2):
- no pipelining: gradient accumulation on one stage;
- 1F1B (PipeDream-Flush): min(p - rank - 1, m) warm-up forwards, then one forward / one
  backward, then cool-down backwards; at most p micro-batches' activations live at once;
- interleaved 1F1B: v model chunks per rank, bubble (p-1)/(v·m) instead of (p-1)/m.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable

from .p2p import PipeComm


class _Step:
    """Forward and backward of one micro-batch on one chunk, shared by every schedule."""

    def __init__(self, batches, model, backward_scale, forward_only, microbatch_mean=False):
        self.batches, self.model = batches, model
        self.backward_scale, self.forward_only = backward_scale, forward_only
        self.microbatch_mean = microbatch_mean
        self.stats = []

    def forward(self, chunk_id: int, input_tensor):
        chunk = self.model[chunk_id]
        chunk.set_input_tensor(input_tensor)
        batch = next(self.batches[chunk_id])
        with torch.set_grad_enabled(not self.forward_only):
            out = chunk(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"])
            if not chunk.post_process:
                return out  # activations for the next stage
            mask = batch["loss_mask"]
            loss_sum = (out.float() * mask).sum()  # [b, s] per-token losses -> the micro-batch's sum
        num_tokens = mask.sum()
        self.stats.append((loss_sum.detach(), num_tokens))
        if self.microbatch_mean:  # a micro-batch without loss tokens adds 0 (Megatron-LM's would be NaN)
            # under context parallelism, the whole sequence's count: the CP ranks' partial sums
            # (summed with the gradients over DP x CP) then make the micro-batch's mean
            denominator = batch.get("num_tokens_sequence", num_tokens)
            loss_sum = loss_sum / denominator.clamp(min=1)
        return loss_sum * self.backward_scale

    @staticmethod
    def backward(input_tensor, output_tensor, output_grad):
        """Backward through one chunk; returns the gradient of its input activations."""
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


def forward_backward_no_pipelining(batches, model, num_microbatches: int, backward_scale: float,
                                   forward_only: bool = False, microbatch_mean: bool = False, **_):
    """Gradient accumulation on one stage: forward and backward each micro-batch in turn."""
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean)
    for _ in range(num_microbatches):
        loss = step.forward(0, None)
        if not forward_only:
            step.backward(None, loss, None)
    return step.stats


def forward_backward_1f1b(batches, model, num_microbatches: int, backward_scale: float,
                          forward_only: bool = False, comm: PipeComm = None, microbatch_mean: bool = False, **_):
    ps = comm.ps
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean)
    first, last = ps.is_first_stage, ps.is_last_stage
    m = num_microbatches
    num_warmup = m if forward_only else min(ps.pp_size - ps.pp_rank - 1, m)
    num_steady = m - num_warmup
    inputs, outputs = [], []

    def recv_forward():
        return None if first else comm.communicate(recv_prev=True)[0]

    for _ in range(num_warmup):
        x = recv_forward()
        y = step.forward(0, x)
        comm.communicate(send_next=None if last else y)
        if not forward_only:
            inputs.append(x)
            outputs.append(y)
            release(None if last else y)

    x = recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        y = step.forward(0, x)
        # send this activation, receive the gradient of the oldest one in flight
        _, dy = comm.communicate(send_next=None if last else y, recv_next=not last)
        inputs.append(x)
        outputs.append(y)
        release(None if last else y)
        x_old, y_old = inputs.pop(0), outputs.pop(0)
        dx = step.backward(x_old, y_old, dy)
        if i == num_steady - 1:
            comm.communicate(send_prev=None if first else dx)
        else:
            x, _ = comm.communicate(send_prev=None if first else dx, recv_prev=not first)

    if not forward_only:
        for _ in range(num_warmup):
            x_old, y_old = inputs.pop(0), outputs.pop(0)
            _, dy = comm.communicate(recv_next=not last)
            dx = step.backward(x_old, y_old, dy)
            comm.communicate(send_prev=None if first else dx)
    return step.stats


def forward_backward_interleaved(batches, model, num_microbatches: int, backward_scale: float,
                                 forward_only: bool = False, comm: PipeComm = None, microbatch_mean: bool = False,
                                 **_):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2), following Megatron-LM's
    forward_backward_pipelining_with_interleaving. Virtual micro-batch k runs on chunk
    (k // p) % v (reversed for backward); chunk c of rank p-1 feeds chunk c+1 of rank 0."""
    ps = comm.ps
    p, rank, v, m = ps.pp_size, ps.pp_rank, len(model), num_microbatches
    step = _Step(batches, model, backward_scale, forward_only, microbatch_mean)
    total = m * v
    all_warmup = forward_only or m == p
    num_warmup = total if all_warmup else min((p - rank - 1) * 2 + (v - 1) * p, total)
    num_steady = total - num_warmup
    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    output_grads = [[] for _ in range(v)]
    first_rank, last_rank = ps.is_first_stage, ps.is_last_stage

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def is_first_virtual(c):
        return first_rank and c == 0

    def is_last_virtual(c):
        return last_rank and c == v - 1

    def forward_k(k):
        c = chunk_of(k, True)
        if is_first_virtual(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        y = step.forward(c, inputs[c][-1])
        outputs[c].append(y)
        if forward_only:  # nothing to keep for a backward
            inputs[c].pop()
            outputs[c].pop()
        return y

    def backward_k(k):
        c = chunk_of(k, False)
        if is_last_virtual(c) and not output_grads[c]:
            output_grads[c].append(None)
        return step.backward(inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0))

    # warm-up: forwards only
    if not first_rank:
        inputs[0].append(comm.communicate(recv_prev=True)[0])
    else:
        inputs[0].append(None)
    for k in range(num_warmup):
        y = forward_k(k)
        c = chunk_of(k, True)
        next_c = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        send = None if is_last_virtual(c) else y
        if k == num_warmup - 1 and not all_warmup:
            x, dy = comm.communicate(send_next=send, recv_prev=recv_prev, recv_next=not last_rank)
            output_grads[v - 1].append(dy)
        else:
            x, _ = comm.communicate(send_next=send, recv_prev=recv_prev)
        if not forward_only:
            release(send)
        if recv_prev:
            inputs[next_c].append(x)

    # steady state: one forward, one backward
    for i in range(num_steady):
        fk, bk = i + num_warmup, i
        y = forward_k(fk)
        dx = backward_k(bk)
        fc, bc = chunk_of(fk, True), chunk_of(bk, False)
        send_y = None if is_last_virtual(fc) else y
        send_dx = None if is_first_virtual(bc) else dx

        recv_prev = True
        if first_rank:
            # rank 0's next input comes from rank p-1, which is p-1 virtual steps behind
            next_fc = chunk_of(fk - (p - 1), True)
            if next_fc == v - 1:
                recv_prev = False
            next_fc += 1
        else:
            next_fc = chunk_of(fk + 1, True)
        recv_next = True
        if last_rank:
            next_bc = chunk_of(bk - (p - 1), False)
            if next_bc == 0:
                recv_next = False
            next_bc -= 1
        else:
            next_bc = chunk_of(bk + 1, False)
        if i == num_steady - 1:
            recv_prev = False
        x, dy = comm.communicate(send_next=send_y, send_prev=send_dx, recv_prev=recv_prev, recv_next=recv_next)
        release(send_y)
        if recv_prev:
            inputs[next_fc].append(x)
        if recv_next:
            output_grads[next_bc].append(dy)

    # cool-down: backwards only
    if not forward_only:
        if all_warmup:
            output_grads[v - 1].append(None if last_rank else comm.communicate(recv_next=True)[1])
        for k in range(num_steady, total):
            dx = backward_k(k)
            bc = chunk_of(k, False)
            next_bc = chunk_of(k + 1, False)
            recv_next = not (last_rank and next_bc == v - 1) and k != total - 1
            _, dy = comm.communicate(send_prev=None if is_first_virtual(bc) else dx, recv_next=recv_next)
            if recv_next:
                output_grads[next_bc].append(dy)
    return step.stats


def get_forward_backward_func(pp_size: int, vpp_size: int = 1):
    if pp_size == 1:
        return forward_backward_no_pipelining
    return forward_backward_interleaved if vpp_size > 1 else forward_backward_1f1b
