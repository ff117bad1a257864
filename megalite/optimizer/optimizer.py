"""The optimizer over fp32 master weights.

fp32 training steps the parameters themselves. With --bf16 the model's parameters are bf16
while the optimizer keeps an fp32 master copy of each (Micikevicius et al. 2018, Sec. 3.1):
the step reads the fp32 `main_grad` accumulated by the gradient buffer, updates the master,
and the result is cast back into the bf16 parameter.

Adam's state is allocated eagerly at construction, so the memory footprint logged before the
first step is the memory the run will really hold.
"""
from __future__ import annotations

import torch

from .clip_grads import clip_grad_norm


def _param_groups(named_masters, weight_decay: float):
    """Megatron's rule: no weight decay on biases and norm weights (1-D tensors)."""
    decay = [p for n, p in named_masters if p.ndim > 1]
    no_decay = [p for n, p in named_masters if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class MixedPrecisionOptimizer:
    """Owns everything from the accumulated gradients to updated parameters: the DP reduction
    (through the gradient buffer), normalisation, clipping and the update."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], args, grad_buffer, ps):
        self.grad_buffer, self.ps, self.clip_grad = grad_buffer, ps, args.clip_grad
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.fp32_params = all(p.dtype == torch.float32 for p in self.params)
        self.masters = (self.params if self.fp32_params
                        else [p.detach().float().clone().requires_grad_(True) for p in self.params])
        groups = _param_groups(list(zip(self.names, self.masters)), args.weight_decay)
        groups = [g for g in groups if g["params"]]
        if args.optimizer == "adam":
            # decoupled weight decay (AdamW), as Megatron-LM's Adam with weight decay
            self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                               eps=args.adam_eps)
            for m in self.masters:
                self.optimizer.state[m] = {"step": torch.tensor(0.0),
                                           "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                                           "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}
        else:
            self.optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
            if args.sgd_momentum:
                for m in self.masters:
                    self.optimizer.state[m] = {"momentum_buffer": torch.zeros_like(m)}

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments, plus fp32 master copies when the
        parameters are not fp32 themselves."""
        n = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.ndim > 0)
        if not self.fp32_params:
            n += sum(m.numel() * m.element_size() for m in self.masters)
        return n

    @property
    def loss_scale(self) -> float:
        """Factor the schedule multiplies the loss by before backward."""
        return 1.0

    def zero_grad(self) -> None:
        self.grad_buffer.zero()

    def reduce_gradients(self) -> None:
        """Sum gradients over the data-parallel group."""
        self.grad_buffer.all_reduce()

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> dict:
        """Multiply the reduced gradients by `grad_scale` (1 / loss scale, token renormalisation),
        clip them by the global norm, update. Returns grad_norm, loss_scale and skipped."""
        if grad_scale != 1.0:
            self.grad_buffer.scale(grad_scale)
        grad_norm = clip_grad_norm(self.params, self.clip_grad, self.ps.mp_group, self.ps.tp_rank)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        for m, p in zip(self.masters, self.params):
            m.grad = p.main_grad
        self.optimizer.step()
        for m, p in zip(self.masters, self.params):
            m.grad = None
            if m is not p:
                p.copy_(m)
        return {"grad_norm": grad_norm, "loss_scale": self.loss_scale, "skipped": False}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()
