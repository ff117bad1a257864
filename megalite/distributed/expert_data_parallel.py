"""The data-parallel side of an expert-parallel MoE model: two DataParallel domains, one face.

Under expert parallelism an expert's weights live on one EP rank and are replicated only over
its expert-data-parallel group (world / (ETP x EP x PP) ranks: with --expert-tensor-parallel-size
below TP it takes TP ranks too, whose tokens each reach the expert), while every other weight is replicated over
DP x CP (parallel_state.py). So the expert weights get a DataParallel of their own over the
expert-DP group (its buckets, reductions, ZeRO shards and gathers), the rest the usual one over
DP x CP (Megatron-LM's expert-parallel buffers in its DDP). The optimizer, the loop and
checkpoints see one object: buckets are named (domain, bucket) and everything else is the union.
"""
from __future__ import annotations

from torch import nn

from ..tensor_parallel.param_info import param_info
from .data_parallel import DataParallel


def build_data_parallel(model: list[nn.Module], params: list[nn.Parameter], ps, config, num_microbatches: int,
                        **kwargs):
    """A DataParallel, or an ExpertDataParallel when experts have a grid of their own (EP > 1 or
    ETP != TP: their replicas are the expert-DP group, not DP x CP)."""
    if ps.separate_expert_grid and any(param_info(p).expert_parallel for p in params):
        return ExpertDataParallel(model, params, ps, config, num_microbatches, **kwargs)
    return DataParallel(model, params, ps, config, num_microbatches, **kwargs)


class ExpertDataParallel:
    def __init__(self, model, params, ps, config, num_microbatches: int, **kwargs):
        self.ps, self.config, self.params = ps, config, list(params)
        dense = [p for p in self.params if not param_info(p).expert_parallel]
        experts = [p for p in self.params if param_info(p).expert_parallel]
        self.domains = ([DataParallel(model, dense, ps, config, num_microbatches, **kwargs)] if dense else []) + \
            [DataParallel(model, experts, ps, config, num_microbatches, experts=True, **kwargs)]
        self.strategy = self.domains[0].strategy
        self._domain_of = {p: d for d in self.domains for p in d.params}

    # -- every domain ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for d in self.domains:
            d.zero_grad()

    def set_num_microbatches(self, n: int) -> None:
        for d in self.domains:
            d.set_num_microbatches(n)

    def finish_grad_sync(self) -> None:
        for d in self.domains:
            d.finish_grad_sync()

    def start_param_sync(self) -> None:
        for d in self.domains:
            d.start_param_sync()

    def finish_param_sync(self) -> None:
        for d in self.domains:
            d.finish_param_sync()

    def close(self) -> None:
        for d in self.domains:
            d.close()

    # -- per parameter, or per (domain, bucket) --------------------------------------------------
    def main_grad(self, p: nn.Parameter):
        return self._domain_of[p].main_grad(p)

    def shard_pieces(self):
        for i, d in enumerate(self.domains):
            for b, p, lo, hi, off in d.shard_pieces():
                yield (i, b), p, lo, hi, off

    def grad_shard(self, key):
        return self.domains[key[0]].grad_shard(key[1])

    def grad_flats(self):
        return [(flat, [(i, b) for b in buckets]) for i, d in enumerate(self.domains)
                for flat, buckets in d.grad_flats()]

    def bucket_of(self, p: nn.Parameter):
        d = self._domain_of[p]
        return self.domains.index(d), d.bucket_of(p)

    def param_shard(self, key):
        return self.domains[key[0]].param_shard(key[1])

    def param_pieces(self) -> list[tuple]:
        return [piece for d in self.domains for piece in d.param_pieces()]

    def param_slice(self, p: nn.Parameter, lo: int, hi: int):
        return self._domain_of[p].param_slice(p, lo, hi)

    def describe(self) -> list[str]:
        return self.domains[0].describe() + [f"experts over expert-DP {self.ps.expert_dp_size}"
                                             + (f" ({self.domains[-1].describe()[-1]})")]

    @property
    def grad_bytes(self) -> int:
        return sum(d.grad_bytes for d in self.domains)

    @property
    def param_bytes(self) -> int:
        return sum(d.param_bytes for d in self.domains)
