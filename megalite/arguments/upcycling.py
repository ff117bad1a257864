"""--moe-use-upcycling and --moe-upcycling-granularity (checkpoint/upcycling/plan.py): what they need,
checked before any process starts; with `check_files`, against the checkpoints under --load and --save."""
from __future__ import annotations

import os

from ..checkpoint.upcycling.plan import dense_ffn_problem, step0_differences
from ..config.run import RunConfig
from ..errors import CheckpointError
from .errors import fail


def check_upcycling(c: RunConfig, check_files: bool) -> None:
    ck, m = c.checkpoint, c.model
    g = ck.moe_upcycling_granularity
    if not ck.moe_use_upcycling:
        if g != 1:
            fail("--moe-upcycling-granularity needs --moe-use-upcycling")
        return
    for needed, given in (("--load (the dense checkpoint)", ck.load), ("--num-experts (the MoE model to build)",
                                                                       m.num_experts),
                          ("--save (where the upcycled checkpoint is written)", ck.save)):
        if not given:
            fail(f"--moe-use-upcycling needs {needed}")
    if m.num_experts % g:
        fail(f"--num-experts ({m.num_experts}) is not divisible by --moe-upcycling-granularity ({g})")
    model = c.model.to_dict()
    c.notices.extend(f"--moe-use-upcycling: the step-0 function differs from the dense model's: {why}"
                     for why in step0_differences(model, g))
    if check_files:
        _check_checkpoints(c, model, g)


def _check_checkpoints(c: RunConfig, model: dict, g: int) -> None:
    from ..checkpoint.files import checked_metadata
    from ..checkpoint.paths import TRACKER, read_tracker
    ck = c.checkpoint
    if os.path.isfile(os.path.join(ck.save, TRACKER)):
        fail(f"--moe-use-upcycling: --save {ck.save} already holds a checkpoint (iteration {read_tracker(ck.save)}); "
             "upcycling is for the first run only (as Megatron-LM): drop --moe-use-upcycling to resume, or choose "
             "an empty --save")
    try:
        meta = checked_metadata(ck.load, "--load")
    except CheckpointError as e:
        fail(f"--moe-use-upcycling: {e}")
    dense = meta["model_config"]
    if dense.get("num_experts"):
        fail(f"--moe-use-upcycling: --load {ck.load} holds an MoE checkpoint (--num-experts {dense['num_experts']}, "
             f"{meta['dir']}); upcycling converts a dense one")
    problem = dense_ffn_problem(dense, model, g)
    if problem:
        fail(f"--moe-use-upcycling: --load {ck.load}: {problem}")
