"""The re-run state machine's flags and the weight-hash check: each only where it acts."""
from __future__ import annotations

from dataclasses import fields

from ..config import RunConfig
from ..config.resilience import INPROCESS
from ..config.sharding import get_strategy
from .errors import fail


def check_resilience(c: RunConfig) -> None:
    """A setting that would change nothing is refused, not ignored (runtime/rerun.py, weight_hash.py)."""
    r, t = c.resilience, c.training
    inprocess = [f.name for f in fields(r) if f.name.startswith("inprocess_") and getattr(r, f.name) not in (None, False)]
    if inprocess:
        fail(f"--{inprocess[0].replace('_', '-')} is not supported: {INPROCESS}")
    check_non_persistent(c)
    if r.error_injection_rate and r.rerun_mode != "validate_results":
        fail(f"--error-injection-rate needs --rerun-mode validate_results (this run: {r.rerun_mode}): only result "
             "validation sees the injected faults")
    if "resilience.error_injection_type" in c.explicit and not r.error_injection_rate:
        fail("--error-injection-type needs --error-injection-rate > 0 (without it no fault is injected)")
    if r.rerun_mode == "validate_results" and not (t.check_for_nan_in_loss_and_grad or t.check_for_spiky_loss):
        fail("--rerun-mode validate_results has nothing to validate with --no-check-for-nan-in-loss-and-grad and "
             "without --check-for-spiky-loss")
    if r.result_rejected_tracker_filename and r.rerun_mode != "validate_results":
        fail(f"--result-rejected-tracker-filename needs --rerun-mode validate_results (this run: {r.rerun_mode}): "
             "only result validation rejects results")
    if r.check_weight_hash_across_dp_replicas_interval is not None:
        if get_strategy(c.ddp.data_parallel_sharding_strategy).shards_params:
            fail("--check-weight-hash-across-dp-replicas-interval cannot run with --data-parallel-sharding-strategy "
                 "optim_grads_params: each data-parallel rank holds a different slice of the weights, there is no "
                 "replica to compare (as in Megatron-LM)")
        if c.parallel.data_parallel_size == 1:
            c.notices.append("--check-weight-hash-across-dp-replicas-interval: data-parallel size 1, each rank's "
                             "weights have no replica to compare with; the hashes are computed and nothing is "
                             "compared")


def check_non_persistent(c: RunConfig) -> None:
    """--non-persistent-*: each setting where it acts (checkpoint/native/local.py)."""
    r = c.resilience
    kind = r.non_persistent_ckpt_type
    given = lambda name: f"resilience.{name}" in c.explicit  # noqa: E731
    if kind == "in_memory":
        fail("--non-persistent-ckpt-type in_memory is not supported: an in-memory copy outlives a failure only with "
             "in-process restart (--inprocess-restart), which megalite does not build yet; use local (with "
             "--replication) or global")
    if (kind is None) != (r.non_persistent_save_interval is None):
        fail("--non-persistent-save-interval and --non-persistent-ckpt-type go together (one without the other saves "
             "nothing)")
    if kind == "local" and not r.non_persistent_local_ckpt_dir:
        fail("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir")
    if kind == "global" and not (r.non_persistent_global_ckpt_dir or c.checkpoint.save):
        fail("--non-persistent-ckpt-type global needs --non-persistent-global-ckpt-dir or --save")
    for name, needs in (("non_persistent_local_ckpt_dir", "local"), ("non_persistent_local_ckpt_algo", "local"),
                        ("non_persistent_global_ckpt_dir", "global")):
        if given(name) and kind != needs:
            fail(f"--{name.replace('_', '-')} needs --non-persistent-ckpt-type {needs}")
    if given("non_persistent_local_ckpt_algo"):
        c.notices.append(f"--non-persistent-local-ckpt-algo {r.non_persistent_local_ckpt_algo}: megalite's local "
                         "save writes one file per rank atomically (a temporary directory renamed into place) either "
                         "way")
    if r.replication:
        if kind != "local":
            fail("--replication needs --non-persistent-ckpt-type local (as in Megatron-LM)")
        if r.replication_jump is None:
            fail("--replication needs --replication-jump (as in Megatron-LM)")
        if c.parallel.world_size % (r.replication_jump * r.replication_factor):
            fail(f"--replication-jump {r.replication_jump} x --replication-factor {r.replication_factor} must divide "
                 f"the world size ({c.parallel.world_size})")
    elif given("replication_jump") or given("replication_factor"):
        fail(f"--{'replication-jump' if given('replication_jump') else 'replication-factor'} needs --replication")
    if kind is not None and c.training.check_for_spiky_loss + c.training.check_for_large_grads:
        fail("--non-persistent-ckpt-type cannot run with --check-for-spiky-loss / --check-for-large-grads yet (their "
             "checkpoints wait for the next loss; non-persistent saves do not)")
    if kind == "local" and get_strategy(c.ddp.data_parallel_sharding_strategy).shards_params:
        fail("--non-persistent-ckpt-type local cannot run with --data-parallel-sharding-strategy optim_grads_params "
             "(not built: its parameters live in ZeRO-3's shards)")
