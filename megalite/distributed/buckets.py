"""Where every parameter lives in the flat data-parallel buffers: buckets and DP slices.

One layout serves the gradient buffer and the parameter buffer of every sharding strategy, in
elements:

    | bucket 0 (params n-1, n-2, ...) pad | bucket 1 ... pad | ...
    |<- rank 0 ->|<- rank 1 ->| ...          each bucket padded to a multiple of `pad_to` = DP

Buckets follow the reverse of the parameters' order, roughly the order backward produces their
gradients, which is what lets a bucket's reduction overlap the rest of backward. A parameter
never straddles two buckets, but a rank's 1/DP slice of a bucket may start or end inside a
parameter: the sharded strategies own slices, not parameters.

A bucket closes when it reaches `bucket_size` elements, before a parameter that alone fills a
bucket, or when the next parameter belongs to another *unit* (`unit_of`): the sharded-gradient
strategies cut at model chunks and around the tied embedding, ZeRO-3 at every layer, so that a
bucket is gathered and freed with the module that uses it (Megatron-FSDP's "FSDP units").
"""
from __future__ import annotations

from .. import comm


class BucketLayout:
    def __init__(self, params, dp_group, bucket_size: int = 40_000_000, pad_to: int = 1, unit_of=None):
        self.params = list(params)
        self.dp_size, self.dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
        if pad_to % self.dp_size and pad_to != 1:
            raise ValueError(f"pad_to ({pad_to}) must be 1 or a multiple of the data-parallel size ({self.dp_size})")
        self.pad_to = pad_to
        self.buckets: list[tuple[int, int]] = []  # [start, end) in elements, padded
        self.bucket_params: list[list] = []
        self.bucket_unit: list[object] = []
        self.param_index: dict = {}  # param -> [start, end) in the buffer
        self.param_bucket: dict = {}
        unit_of = unit_of or (lambda p: None)
        offset, bucket_start, members, unit = 0, 0, [], None

        def close():
            nonlocal offset, bucket_start, members
            offset = bucket_start + -(-(offset - bucket_start) // pad_to) * pad_to
            self.buckets.append((bucket_start, offset))
            self.bucket_params.append(members)
            self.bucket_unit.append(unit)
            bucket_start, members = offset, []

        for p in reversed(self.params):
            if members and (unit_of(p) != unit or p.numel() >= bucket_size):
                close()  # a new unit, or a parameter bigger than a bucket: it gets one of its own
            unit = unit_of(p)
            self.param_index[p] = (offset, offset + p.numel())
            self.param_bucket[p] = len(self.buckets)
            members.append(p)
            offset += p.numel()
            if offset - bucket_start >= bucket_size:
                close()
        if members:
            close()
        self.numel = offset

    def shard_range(self, bucket: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of `rank`'s (default: this rank's) 1/DP slice of `bucket`."""
        start, end = self.buckets[bucket]
        size = (end - start) // self.dp_size
        rank = self.dp_rank if rank is None else rank
        return start + rank * size, start + (rank + 1) * size

    def shard_offset(self, bucket: int) -> int:
        """Where `bucket`'s slice starts in a buffer that holds only this rank's slices."""
        return self.buckets[bucket][0] // self.dp_size

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp_size

    def pieces_in_shard(self, bucket: int):
        """(param, lo, hi) for every parameter that overlaps this rank's slice of `bucket`:
        [lo, hi) in the parameter's own flat elements."""
        s, e = self.shard_range(bucket)
        for p in self.bucket_params[bucket]:
            ps, pe = self.param_index[p]
            lo, hi = max(ps, s), min(pe, e)
            if lo < hi:
                yield p, lo - ps, hi - ps
