"""The optimizer over fp32 master weights, with loss scaling and global-norm clipping.

fp32 training steps the parameters themselves. With --bf16 or --fp16 the model's parameters are
16-bit while the optimizer keeps an fp32 master copy of each (Micikevicius et al. 2018, Sec. 3.1):
the step reads the fp32 `main_grad` accumulated by the gradient buffer, updates the master,
and the result is cast back into the 16-bit parameter. --fp16 adds loss scaling (grad_scaler.py):
a step whose gradients overflowed is skipped on every rank.

One step, after the data-parallel module has reduced the gradients: multiply by `grad_scale`
(1 / loss scale, token renormalisation) -> one all-reduce of [squared norm, overflow count] ->
skip on overflow -> clip -> update -> masters copied into the parameters. Under torch's fused
AdamW the two multiplications are no passes of their own: their product goes to the kernel as its
`grad_scale` (by which it divides each gradient as it reads it, the hook torch.amp's GradScaler
uses), and the norm is the unscaled gradients' times `grad_scale` -- two fewer reads and writes of
every fp32 gradient in a step that clips or unscales (Megatron-LM's FusedAdam takes the clip
factor the same way, as its `grad_scale`).
distributed_optimizer.py shards the masters and the optimizer state over DP (ZeRO-1/2/3) and
offloads them to host memory (--optimizer-cpu-offload).

The update itself is torch.optim's AdamW / SGD, fused where the device has fused kernels (CUDA,
and the CPU on recent torch), unless --no-fused-optimizer; both paths compute the same update
up to float rounding. --optimizer muon chains Muon for the matrices with AdamW or Lion for the
rest (muon.py); `_muon_matrices` says how each whole matrix is assembled for Newton-Schulz. apex's FusedAdam is not used: torch's fused AdamW gives the same on CUDA.
Optimizers count steps per parameter (torch) or per group (apex-style); `step_count` and
`set_step_count` read and restore either, so checkpoints resume Adam's bias correction exactly. Adam's state is allocated eagerly at
construction, so the memory footprint logged before the first step is the memory the run
will really hold. --use-precision-aware-optimizer stores masters and moments in narrower dtypes
and steps them with precision_adam.py's AdamW (fp32 arithmetic), which reads each gradient as
`decoupled_grad`; `step`'s `after_update` hook is where --qk-clip (qk_clip.py) rescales the
updated masters before they reach the parameters.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..config import OptimizerConfig
from ..tensor_parallel.param_info import param_info
from .clip_grads import GradStats, clip_coefficient, scale_
from .grad_scaler import build_grad_scaler
from .muon import ChainedOptimizer, build_muon
from .muon_matrices import LocalMatrices, matrix_specs, settings_of
from .precision_adam import STORAGE_DTYPES, PrecisionAwareAdamW


def _param_groups(named_masters, weight_decay: float):
    """Megatron's rule: no weight decay on biases and norm weights (1-D tensors; with
    --apply-wd-to-qk-layernorm the query/key norms decay too, Qwen3-Next's); and, with
    --decoupled-lr, the word embedding and output layer in groups of their own (`decoupled`).
    `named_masters`: (tensor stepped, whether it decays, whether it takes the decoupled learning rate)."""
    groups = []
    for decoupled in (False, True):
        for decay in (True, False):
            params = [m for m, wd, d in named_masters if d == decoupled and wd == decay]
            if params:
                groups.append({"params": params, "weight_decay": weight_decay if decay else 0.0,
                               "decoupled": decoupled})
    return groups


def _torch_fused_supported(device: torch.device) -> bool:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # older torch: CUDA only
        return device.type == "cuda"


def build_inner_optimizer(groups, config: OptimizerConfig, device: torch.device, fused: bool | None = None,
                          matrices=None):
    """(optimizer over `groups`, description). `fused` defaults to config.fused_optimizer.
    --optimizer muon: `matrices` (muon_matrices.py) says which masters are Muon's and orthogonalizes them."""
    fused = config.fused_optimizer if fused is None else fused
    use_fused = fused and _torch_fused_supported(device)
    if config.optimizer == "muon":
        return build_muon(groups, config, matrices, lambda rest: _adamw(rest, config, use_fused))
    if config.optimizer == "adam":
        return _adamw(groups, config, use_fused)
    opt = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, fused=use_fused or None)
    return opt, "sgd (torch SGD, fused)" if use_fused else "sgd (torch SGD, unfused)"


def _adamw(groups, config: OptimizerConfig, use_fused: bool):
    if config.use_precision_aware_optimizer:
        opt = PrecisionAwareAdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_eps, weight_decay=config.weight_decay,
                                  exp_avg_dtype=STORAGE_DTYPES[config.exp_avg_dtype],
                                  exp_avg_sq_dtype=STORAGE_DTYPES[config.exp_avg_sq_dtype])
        return opt, (f"adam (precision-aware: exp_avg {config.exp_avg_dtype}, exp_avg_sq {config.exp_avg_sq_dtype}, "
                     "computed in fp32)")
    # decoupled weight decay (AdamW), as Megatron-LM's Adam with weight decay
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                            fused=use_fused or None)
    return opt, "adam (torch AdamW, fused)" if use_fused else "adam (torch AdamW, unfused)"


def folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the step's gradient factor can go into the update kernel as torch.amp's
    `grad_scale`: torch's Adam/AdamW fused on every group (the foreach and single-tensor paths,
    Muon, SGD and the precision-aware AdamW take no such factor)."""
    return (type(optimizer) in (torch.optim.AdamW, torch.optim.Adam)
            and all(g.get("fused") for g in optimizer.param_groups))


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the state a first step would allocate, now (zeros, step 0)."""
    if isinstance(optimizer, ChainedOptimizer):
        for o in optimizer.optimizers:
            init_optimizer_state(o)
        return
    if hasattr(optimizer, "init_state"):  # muon.py's Muon and Lion, precision_adam.py's AdamW
        optimizer.init_state()
        return
    is_torch = type(optimizer) in (torch.optim.AdamW, torch.optim.SGD)
    for group in optimizer.param_groups:
        for m in group["params"]:
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"]:
                    optimizer.state[m] = {"momentum_buffer": torch.zeros_like(m)}
                continue
            state = {"exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}
            if is_torch:  # other optimizers (apex's FusedAdam) may count steps per group instead
                fused = group.get("fused") or group.get("capturable")
                state["step"] = (torch.zeros((), dtype=torch.float32, device=m.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
            optimizer.state[m] = state


def _host_value(t: torch.Tensor) -> float:
    """A one-element statistic read on the host; on the meta device (--dry-run), which holds no
    values, 0 (a step with nothing to clip and no overflow)."""
    return 0.0 if t.device.type == "meta" else float(t)


class MixedPrecisionOptimizer:
    """Owns everything from the reduced gradients to updated parameters: unscaling and
    normalisation, the overflow check, clipping and the update. The gradients and their
    reduction belong to the data-parallel module `dp`. Subclasses change which tensors are
    stepped (`masters`, `main_grads`) and how the result reaches the parameters."""

    distributed = False

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], config: OptimizerConfig, dp, ps):
        self.dp, self.ps, self.clip_grad = dp, ps, config.clip_grad
        self.count_zeros = config.log_num_zeros_in_grad
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.device = self.params[0].device
        self.fp32_params = all(p.dtype == torch.float32 for p in self.params)
        # --main-params-dtype: the masters' storage (16-bit parameters only; validation's rule)
        self.master_dtype = STORAGE_DTYPES[config.main_params_dtype]
        # the precision-aware update reads each gradient as it is (decoupled_grad), widening it itself
        self.decoupled_grads = config.use_precision_aware_optimizer
        self.scaler = build_grad_scaler(config)
        self.inject_overflow_at = config.inject_overflow_at_iteration
        self.skipped_iterations = 0  # steps skipped for overflow since the start of this run
        self._build_masters()
        decoupled = [config.decoupled_lr is not None and param_info(p).embedding_or_output for p, *_ in self.pieces()]
        names = {id(p): n for n, p in named_params}
        decays = [ndim > 1 or (config.apply_wd_to_qk_layernorm and ("q_layernorm." in names[id(p)]
                                                                    or "k_layernorm." in names[id(p)]))
                  for ndim, (p, *_) in zip(self.master_ndims, self.pieces())]
        groups = _param_groups(list(zip(self.masters, decays, decoupled)), config.weight_decay)
        matrices = self._muon_matrices(named_params, config) if config.optimizer == "muon" else None
        self.optimizer, self.impl = build_inner_optimizer(groups, config, self.device, matrices=matrices)
        init_optimizer_state(self.optimizer)
        self.fold_scale = folds_grad_scale(self.optimizer)
        self._grad_scale = None  # the fused kernel's divisor, made at the first step that needs one

    # -- what is stepped -------------------------------------------------------------------------
    def _build_masters(self) -> None:
        """One master per parameter: the parameter itself in fp32, else an fp32 copy."""
        self.masters = (self.params if self.fp32_params
                        else [p.detach().to(self.master_dtype, copy=True) for p in self.params])
        self.master_ndims = [p.ndim for p in self.params]
        self.main_grads = [self.dp.main_grad(p) for p in self.params]
        self.counted = [param_info(p).is_owner(self.ps.tp_rank) for p in self.params]
        if self.ps.separate_expert_grid:
            # expert weights differ across EP ranks (or are cut over ETP, not TP): each replica
            # group (DP x CP for dense weights, expert-DP for experts) counts once, and the stats
            # are summed over DP x CP
            self.counted = [c and self.ps.replica_rank(param_info(p).expert_parallel) == 0
                            for c, p in zip(self.counted, self.params)]
        self._build_grad_stats([self.dp.bucket_of(p) for p in self.params])

    def _build_grad_stats(self, piece_buckets: list) -> None:
        """The flat gradient tensors the step passes over (`grad_flats`) and what of them this
        rank counts in the norm (clip_grads.GradStats), from each piece's bucket: a flat in which
        no piece is counted is left out of the sum, the uncounted pieces of a counted flat are
        subtracted from it."""
        flats = self.dp.grad_flats()
        flat_of = {key: i for i, (_, keys) in enumerate(flats) for key in keys}
        members = [[] for _ in flats]
        for j, key in enumerate(piece_buckets):
            members[flat_of[key]].append(j)
        counted = [any(self.counted[j] for j in m) for m in members]
        duplicates = [self.main_grads[j] for m, c in zip(members, counted) if c for j in m if not self.counted[j]]
        zeros = [g for g, c in zip(self.main_grads, self.counted) if c] if self.count_zeros else None
        self.grad_flats = [f for f, _ in flats]
        self.grad_stats = GradStats(self.grad_flats, counted, duplicates, zeros)

    def _muon_matrices(self, named_params, config):
        """--optimizer muon: every replica orthogonalizes every matrix (its pieces are whole)."""
        return LocalMatrices(self.pieces(), matrix_specs(named_params, self.ps, config), settings_of(config))

    def _master_bytes(self) -> int:
        return 0 if self.fp32_params else sum(m.numel() * m.element_size() for m in self.masters)

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """All ranks agree on [squared norm, overflow count]: every DP replica holds the whole
        reduced gradient, so sum over model-parallel ranks and take the max over DP (under expert
        parallelism, where DP x CP ranks hold different experts, the sum of what each replica
        group's first rank counted)."""
        comm.all_reduce(stats, self.ps.mp_group)
        comm.all_reduce(stats, self.ps.dp_cp_group,
                        op=torch.distributed.ReduceOp.SUM if self.ps.separate_expert_grid
                        else torch.distributed.ReduceOp.MAX)

    def _attach_grads(self) -> None:
        """Give each master its (unscaled, clipped) gradient for the inner optimizer (the
        buffer's views already have the parameters' shapes: no op per parameter)."""
        for m, g in zip(self.masters, self.main_grads):
            self._set_grad(m, g)

    def _set_grad(self, master: torch.Tensor, g: torch.Tensor) -> None:
        if self.decoupled_grads:
            master.decoupled_grad = g
        else:  # --grad-reduce-in-bf16: the reduced bf16 gradient is widened for the fp32 update
            master.grad = g if g.dtype == master.dtype else g.to(master.dtype)

    def _update_params(self) -> None:
        if not self.fp32_params:  # one multi-tensor cast-and-copy, not one per parameter
            torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def masters_from_params(self) -> None:
        """fp32 runs after a checkpoint load: masters that are not the parameters' own memory
        (offloaded host copies) take the loaded values."""

    # -- public ------------------------------------------------------------------------------------
    def describe(self) -> str:
        """One line for the start-up log."""
        dtype = str(self.params[0].dtype).replace("torch.", "")
        master = str(self.master_dtype).replace("torch.float", "fp")
        parts = [self.impl, f"{dtype} params" + ("" if self.fp32_params else f", {master} master weights")]
        parts += self.dp.describe()
        if self.scaler is not None:
            parts.append(self.scaler.describe())
        return ", ".join(parts)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments / momentum, plus the fp32 master
        weights when the parameters are not fp32 themselves."""
        n = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.ndim > 0)
        return n + self._master_bytes()

    @property
    def loss_scale(self) -> float:
        """Factor the schedule multiplies the loss by before backward."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _inject_overflow(self, iteration) -> bool:
        """--inject-overflow-at-iteration (testing): the last rank writes an inf into a gradient."""
        return (self.inject_overflow_at is not None and iteration == self.inject_overflow_at
                and self.ps.rank == self.ps.world_size - 1)

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, iteration: int | None = None,
             decoupled_lr: float | None = None, reject_grad_norm=None, after_update=None) -> dict:
        """Multiply the reduced gradients by `grad_scale` (1 / loss scale, token renormalisation),
        skip the step if they overflowed (with loss scaling), clip them by the global norm,
        update at `lr` (`decoupled_lr` for the --decoupled-lr groups). `iteration` (1-based) only
        serves --inject-overflow-at-iteration. `reject_grad_norm(norm)` (--check-for-large-grads)
        returns why the norm is a spike, or None: a spike skips the update. Returns grad_norm (None
        when skipped for an overflow), loss_scale (for the next iteration), skipped, and spike (the
        reason, when skipped for one). `after_update(pieces)` (--qk-clip) changes the updated
        masters before they reach the parameters."""
        self.dp.finish_param_sync()
        if not self.fold_scale:
            scale_(self.grad_flats, grad_scale)
        inject = self._inject_overflow(iteration)
        if inject and self.main_grads:
            self.main_grads[0].view(-1)[0] = float("inf")
        stats = self.grad_stats.local()
        if inject and not self.main_grads:
            stats[1] += 1
        self._reduce_stats(stats)
        zeros = {"num_zeros_in_grad": int(_host_value(stats[2]))} if self.count_zeros else {}
        if self.scaler is not None:
            found_inf = _host_value(stats[1]) > 0
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped_iterations += 1
                return {"grad_norm": None, "loss_scale": self.scaler.scale, "skipped": True, **zeros}
        grad_norm = math.sqrt(_host_value(stats[0])) * (grad_scale if self.fold_scale else 1.0)
        spike = reject_grad_norm(grad_norm) if reject_grad_norm is not None else None
        if spike is not None:
            return {"grad_norm": grad_norm, "loss_scale": self.loss_scale, "skipped": True, "spike": spike, **zeros}
        factor = clip_coefficient(grad_norm, self.clip_grad)
        if self.fold_scale:
            self._kernel_grad_scale(factor * grad_scale)
        else:
            scale_(self.grad_flats, factor)
        for g in self.optimizer.param_groups:
            g["lr"] = decoupled_lr if g.get("decoupled") and decoupled_lr is not None else lr
        self._attach_grads()
        self.optimizer.step()
        for m in self.masters:
            m.grad = m.decoupled_grad = None
        if after_update is not None:
            after_update(self.pieces())
        self._update_params()
        return {"grad_norm": grad_norm, "loss_scale": self.loss_scale, "skipped": False, **zeros}

    def _kernel_grad_scale(self, factor: float) -> None:
        """The fused kernel divides each gradient by optimizer.grad_scale (None: by nothing)."""
        if factor == 1.0:
            self.optimizer.grad_scale = None
            return
        if self._grad_scale is None:
            self._grad_scale = torch.ones((), dtype=torch.float32, device=self.masters[0].device)
        self._grad_scale.fill_(1.0 / factor)
        self.optimizer.grad_scale = self._grad_scale

    def step_count(self) -> float | None:
        """Updates taken so far, wherever the inner optimizer counts them (per group or per
        parameter); None for an optimizer that keeps no count (SGD)."""
        for group in self.optimizer.param_groups:
            if "step" in group:
                return float(group["step"])
        for state in self.optimizer.state.values():
            if "step" in state:
                return float(state["step"])
        return None

    def set_step_count(self, step: float) -> None:
        per_param = [state["step"] for state in self.optimizer.state.values() if "step" in state]
        for t in per_param:
            t.fill_(step)
        for group in self.optimizer.param_groups:
            # per-group counters (apex-style, Muon, Lion), created if no step has run yet
            if not per_param or "step" in group:
                group["step"] = int(step)

    def pieces(self) -> list[tuple]:
        """(param, lo, hi, master) for every tensor stepped: [lo, hi) is the flat range of the
        parameter that `master` holds (the whole parameter here; a ZeRO-1 slice may cut it)."""
        return [(p, 0, p.numel(), m) for p, m in zip(self.params, self.masters)]
