"""The distributed optimizer (ZeRO; Rajbhandari et al. 2020, Sec. 5): fp32 master weights and
Adam's moments are sharded over the data-parallel ranks, for every sharding strategy but
no_shard; optionally part of them lives in host memory (ZeRO-Offload; Ren et al. 2021).

Layout (see distributed/buckets.py): parameters and gradients are laid out alike, in buckets,
each padded to a multiple of DP. DP rank r owns the r-th 1/DP slice of every bucket
(`DataParallel.owned_ranges`); a slice may begin or end inside a parameter, so the optimizer
steps *pieces*: (parameter, flat range [lo, hi) of it). The data-parallel module hands it, per
bucket, views of this rank's slice of the reduced gradient (`grad_shard`; ZeRO-1 keeps the whole
buffer, ZeRO-2/3 only the slice) and of the parameters (`param_shard`; ZeRO-1/2 a slice of the
whole flat parameter buffer, ZeRO-3 the only copy this rank has). Per iteration:

  reduce(-scatter) each bucket    -> rank r holds the summed gradient of its slice   (DataParallel)
  unscale, overflow check, norm   -> all-reduced over DP and the model-parallel group
  AdamW on the slice's fp32 masters (the parameter slice itself when params are fp32)
  masters -> parameter slice (cast to bf16/fp16); ZeRO-1/2: all-gather each bucket  (DataParallel)

Optimizer state per rank is 12 bytes per parameter / DP with 16-bit parameters (fp32 master
4 + Adam m, v 8), 8 / DP with fp32 parameters (the parameter is its own master); with
--use-precision-aware-optimizer each of them in its own dtype (precision_adam.py: bf16 moments
and an fp16 master 2 bytes each).

--optimizer-cpu-offload --optimizer-offload-fraction f: the masters and moments of the first
round(f x n) of this rank's n elements (a piece is cut at the boundary) are host tensors (pinned when CUDA is present),
and the inner optimizer steps them there (torch's AdamW runs each device's tensors with that
device's kernels). Their gradients are copied to the host before the step, the updated masters
back into the parameter slices after it. With fp32 parameters an offloaded piece gets a host
master of its own. On a CPU-only run host and device are one memory: the path runs the same
kernels on the same numbers, so losses are identical with and without offload (tests).
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor_parallel.param_info import param_info
from .muon_matrices import ShardedMatrices, matrix_specs, settings_of
from .optimizer import MixedPrecisionOptimizer


class DistributedOptimizer(MixedPrecisionOptimizer):
    distributed = True

    def __init__(self, named_params, config, dp, ps):
        if not dp.strategy.shards_optimizer:
            raise ValueError("the distributed optimizer needs a DataParallel with a sharding strategy other "
                             "than no_shard")
        self.offload = config.optimizer_cpu_offload
        self.offload_fraction = config.optimizer_offload_fraction if self.offload else 0.0
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"--optimizer-offload-fraction must be in [0, 1], got {self.offload_fraction}")
        super().__init__(named_params, config, dp, ps)

    # -- what is stepped: this rank's slice of every bucket ----------------------------------------
    def _build_masters(self) -> None:
        dp, tp_rank = self.dp, self.ps.tp_rank
        total = sum(hi - lo for _, _, lo, hi, _ in dp.shard_pieces())
        # offloaded: the first round(f x total) elements; the piece at the boundary is cut in two
        pieces, on_host, n_host = [], [], 0
        target = round(self.offload_fraction * total)
        for b, p, lo, hi, off in dp.shard_pieces():  # (bucket, param, lo, hi, offset in the bucket's slice)
            cut = min(hi, lo + max(target - n_host, 0))
            for a, z, host in ((lo, cut, True), (cut, hi, False)):
                if a < z:
                    pieces.append((b, p, a, z, off + a - lo))
                    on_host.append(host)
                    n_host += (z - a) if host else 0
        n_device = 0 if self.fp32_params else sum(hi - lo for (_, _, lo, hi, _), h in zip(pieces, on_host) if not h)
        pin = torch.cuda.is_available()
        self.master_data = torch.empty(n_device, dtype=self.master_dtype, device=self.device) if n_device else None
        self.host_master_data = self.host_grad_data = None
        if n_host:
            # an fp32 parameter's host master stays fp32 (it is the parameter's only stepped copy)
            master_dtype = torch.float32 if self.fp32_params else self.master_dtype
            self.host_master_data = torch.empty(n_host, dtype=master_dtype, pin_memory=pin)
            self.host_grad_data = torch.empty(n_host, dtype=torch.float32, pin_memory=pin)
        # the norm, the overflow check, unscaling and clipping run over the uncut pieces, so the
        # numbers do not depend on where the offload boundary falls
        self.main_grads, self.counted, buckets = [], [], []
        for b, p, lo, hi, off in dp.shard_pieces():
            self.main_grads.append(dp.grad_shard(b)[off:off + hi - lo])
            self.counted.append(param_info(p).is_owner(tp_rank))
            buckets.append(b)
        self._build_grad_stats(buckets)
        self.masters, self.master_ndims, self._step_grads = [], [], []
        self._pieces, self._host_grads, self._copy_back, self._places = [], [], [], []
        d = h = 0
        for (b, p, lo, hi, off), host in zip(pieces, on_host):
            n = hi - lo
            grad = dp.grad_shard(b)[off:off + n]
            weight = dp.param_shard(b)[off:off + n]
            if host:
                master = self.host_master_data[h:h + n]
                self._host_grads.append(self.host_grad_data[h:h + n])
                h += n
            elif self.fp32_params:
                master = weight  # stepped in place
                self._host_grads.append(None)
            else:
                master = self.master_data[d:d + n]
                self._host_grads.append(None)
                d += n
            if master is not weight:
                master.copy_(weight)
                self._copy_back.append((weight, master))
            self.masters.append(master)
            self._step_grads.append(grad)  # views of the same memory as main_grads
            self.master_ndims.append(p.ndim)
            self._pieces.append((p, lo, hi))
            self._places.append((b, off))  # bucket, offset in this rank's slice of it
        self.offloaded_elements, self.total_elements = n_host, total

    def _muon_matrices(self, named_params, config):
        """--optimizer muon: each matrix orthogonalized by the one DP rank that owns it."""
        pieces = [(m, p, b, off) for (p, _, _), m, (b, off) in zip(self._pieces, self.masters, self._places)]
        return ShardedMatrices(self.dp, pieces, matrix_specs(named_params, self.ps, config), settings_of(config),
                               self.device)

    @torch.no_grad()
    def masters_from_params(self) -> None:
        for weight, master in self._copy_back:
            master.copy_(weight)

    def _master_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master_data, self.host_master_data) if t is not None)

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """Slices partition each model-parallel rank's buffer: sum over DP (x CP), then over TP x PP.
        With --num-distributed-optimizer-instances each instance holds every slice: the sum counts
        each one once per instance."""
        comm.all_reduce(stats, self.ps.dp_cp_group)
        comm.all_reduce(stats, self.ps.mp_group)
        if self.ps.instances > 1:
            stats.div_(self.ps.instances)

    def _attach_grads(self) -> None:
        """Offloaded pieces get a host copy of their gradient (device to host). The flat
        gradients were scaled and clipped in place; the masters' cut pieces view them."""
        copied = False
        for m, g, hg in zip(self.masters, self._step_grads, self._host_grads):
            if hg is not None:
                hg.copy_(g, non_blocking=True)
                self._set_grad(m, hg)
                copied = True
            else:
                self._set_grad(m, g)
        if copied and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host step reads the copies

    def _update_params(self) -> None:
        """Masters -> this rank's slices of the parameters (host to device for offloaded
        pieces); the data-parallel module gathers the rest."""
        for weight, master in self._copy_back:
            weight.copy_(master, non_blocking=True)
        self.dp.start_param_sync()

    def describe(self) -> str:
        line = super().describe()
        if self.offload:
            share = self.offloaded_elements / max(self.total_elements, 1)
            line += (f", optimizer state offloaded to host: {100 * share:.0f}% of this rank's "
                     f"{self.total_elements / 1e6:.2f}M elements (--optimizer-offload-fraction "
                     f"{self.offload_fraction:g}), stepped on the CPU")
        return line

    def pieces(self) -> list[tuple]:
        return [(p, lo, hi, m) for (p, lo, hi), m in zip(self._pieces, self.masters)]
