"""AdamW whose state is stored in lower precision and computed in fp32: Megatron-LM's
precision-aware optimizer (--use-precision-aware-optimizer; Transformer Engine's FusedAdam with
master_weight_dtype / exp_avg_dtype / exp_avg_sq_dtype), written in plain PyTorch.

Storage and arithmetic are separate: each step widens a tensor's moments, its master weight and
its gradient to fp32, runs the AdamW update (Loshchilov & Hutter 2019, Algorithm 2; the same
operations in the same order as torch.optim.AdamW's single-tensor path, so with fp32 storage the
two agree to the bit) and rounds the results back into their storage dtypes (round to nearest).
The working copies live one tensor at a time, so the extra memory is that of the largest tensor,
not of the model.

Bytes per parameter of state (planning/memory.py `optimizer_bytes_per_param`): exp_avg 4 / 2,
exp_avg_sq 4 / 2, and for 16-bit parameters a master weight of 4 (fp32) or 2 (fp16).

The gradient is handed over as `decoupled_grad` (Megatron-LM's name), not `.grad`: torch refuses
a `.grad` whose dtype differs from the tensor's, and here a bf16 gradient (--main-grads-dtype
bf16) may meet an fp16 master.
"""
from __future__ import annotations

import math

import torch

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW over tensors of any floating dtype, moments stored as `exp_avg_dtype` /
    `exp_avg_sq_dtype` (torch dtypes), every update computed in fp32."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype

    def init_state(self) -> None:
        """Zero moments in their storage dtypes, step 0 (counted per tensor, as torch's AdamW)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {}
                self._init_one(p)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is None:
                    continue
                if not self.state.get(p):
                    self.state[p] = {}
                    self._init_one(p)
                self._update(p, grad, self.state[p], group)

    def _init_one(self, p: torch.Tensor) -> None:
        self.state[p].update(exp_avg=torch.zeros_like(p, dtype=self.exp_avg_dtype),
                             exp_avg_sq=torch.zeros_like(p, dtype=self.exp_avg_sq_dtype),
                             step=torch.tensor(0.0, dtype=torch.float32))

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """One AdamW step of `p` in fp32; the fp32 results rounded into the stored tensors."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        wide = [t if t.dtype == torch.float32 else t.float() for t in (p, state["exp_avg"], state["exp_avg_sq"])]
        param, exp_avg, exp_avg_sq = wide
        g = grad.reshape(p.shape)
        g = g if g.dtype == torch.float32 else g.float()
        param.mul_(1 - lr * wd)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        for stored, w in zip((p, state["exp_avg"], state["exp_avg_sq"]), wide):
            if stored is not w:
                stored.copy_(w)  # round to nearest into the storage dtype
