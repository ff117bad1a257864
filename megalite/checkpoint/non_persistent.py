"""Non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type): a
frequent save of the latest state for this job's next restart, besides the persistent ones of
--save-interval that outlive it. As Megatron-LM: `global` writes a full checkpoint (megalite's
format, loadable on any layout) to --non-persistent-global-ckpt-dir (default <--save>/non_persistent),
keeping only the latest; `local` writes each rank's own state to its own directory, replicated on
peers (native/local.py); `in_memory` keeps the same states in host memory (native/memory.py), for
in-process restart (megalite/inprocess/). A resume with --load takes the newest of the persistent checkpoint and
the non-persistent one."""
from __future__ import annotations

import os
import re
import shutil

from .load import load_checkpoint
from .native import CheckpointSaver, TrainState
from .native.local import LocalCheckpointer, replication_groups
from .native.memory import InMemoryCheckpointer
from .paths import read_tracker


class NonPersistent:
    def __init__(self, r, save_dir: str | None, ps, check_finite: bool, fully_parallel: bool, memory=None):
        self.kind, self.interval = r.non_persistent_ckpt_type, r.non_persistent_save_interval
        if self.kind == "global":
            self.root = r.non_persistent_global_ckpt_dir or os.path.join(save_dir, "non_persistent")
            self.saver = CheckpointSaver(self.root, async_save=False, check_finite=check_finite,
                                         fully_parallel=fully_parallel)
            return
        group = [ps.rank]
        if r.replication:
            group = next(g for g in replication_groups(ps.world_size, r.replication_jump, r.replication_factor)
                         if ps.rank in g)
        if self.kind == "in_memory":
            if memory is None:
                raise ValueError("--non-persistent-ckpt-type in_memory: the restart loop's HostSnapshots are missing")
            self.root, self.local = "host memory", InMemoryCheckpointer(memory, ps, group)
        else:
            self.root = r.non_persistent_local_ckpt_dir
            self.local = LocalCheckpointer(self.root, ps, group)

    @classmethod
    def build(cls, cfg, ps, memory=None) -> "NonPersistent | None":
        """`memory`: in_memory's HostSnapshots, owned by the in-process restart loop."""
        r = cfg.resilience
        if r.non_persistent_ckpt_type is None:
            return None
        return cls(r, cfg.checkpoint.save, ps, cfg.training.check_for_nan_in_loss_and_grad,
                   cfg.checkpoint.ckpt_fully_parallel_save, memory)

    @property
    def in_memory(self) -> bool:
        return self.kind == "in_memory"

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def save(self, ts: TrainState, iteration: int) -> None:
        if self.kind != "global":
            self.local.save(ts, iteration)
            if not self.in_memory:  # (in memory: every few iterations, a line each would drown the log)
                ts.log(f"> saved local non-persistent checkpoint of iteration {iteration} under {self.root}")
            return
        self.saver.save(ts, iteration)
        if ts.ps.rank == 0:  # non-persistent: only the latest is kept
            for name in os.listdir(self.root):
                if re.fullmatch(r"iter_\d{7}", name) and int(name[5:]) != iteration:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def newer(self, persistent: int) -> tuple | None:
        """The non-persistent checkpoint to resume from where it is newer than the persistent one
        (iteration `persistent`), before either is read: (iteration, where), or None. A collective
        for local checkpoints (which rank holds which state)."""
        if self.kind == "global":
            latest = read_tracker(self.root) if os.path.isdir(self.root) else None
            return (latest, None) if latest is not None and latest > persistent else None
        found = self.local.newest()
        return found if found is not None and found[0] > persistent else None

    def load(self, ts: TrainState, found: tuple, **load_args) -> int:
        """Resume from `newer`'s answer; returns the iteration."""
        if self.kind == "global":
            ts.log(f"> the non-persistent checkpoint (iteration {found[0]}) is newer than --load's")
            return load_checkpoint(ts, self.root, **load_args)
        return self.local.restore(ts, *found)

    def close(self) -> None:
        if self.kind == "global":
            self.saver.close()


__all__ = ["NonPersistent"]
