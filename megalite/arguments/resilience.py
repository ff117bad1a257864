"""The re-run state machine's flags and the weight-hash check: each only where it acts."""
from __future__ import annotations

import os
from dataclasses import fields

from ..config import RunConfig
from ..config.resilience import LAUNCHER_ENV, NVRX_ONLY
from ..config.sharding import get_strategy
from .errors import fail


def check_resilience(c: RunConfig) -> None:
    """A setting that would change nothing is refused, not ignored (runtime/rerun.py, weight_hash.py)."""
    r, t = c.resilience, c.training
    check_non_persistent(c)
    check_inprocess(c)
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


NVRX_FLAGS = ("inprocess_soft_timeout", "inprocess_hard_timeout", "inprocess_monitor_thread_interval",
              "inprocess_progress_watchdog_interval", "inprocess_completion_timeout", "inprocess_last_call_wait",
              "inprocess_termination_grace_time")


def check_inprocess(c: RunConfig) -> None:
    """--inprocess-*: only with --inprocess-restart, under megalite's launcher (megalite/inprocess/)."""
    r = c.resilience
    given = [f.name for f in fields(r) if f.name.startswith("inprocess_") and f"resilience.{f.name}" in c.explicit]
    for name in given:
        if name in NVRX_FLAGS:
            fail(f"--{name.replace('_', '-')} is not supported: {NVRX_ONLY}")
    if not r.inprocess_restart:
        if given:
            fail(f"--{given[0].replace('_', '-')} needs --inprocess-restart")
        return
    if r.inprocess_empty_cuda_cache:
        c.notices.append("--inprocess-empty-cuda-cache: in-process restart runs on gloo, on the CPU: there is no "
                         "CUDA cache to empty")
    if r.inprocess_granularity == "node":
        fail("--inprocess-granularity node is not supported: megalite's launcher (python -m megalite.inprocess) runs "
             "one node and replaces the failed rank only; use rank")
    if r.non_persistent_ckpt_type != "in_memory":
        fail("--inprocess-restart needs --non-persistent-ckpt-type in_memory (with --non-persistent-save-interval and "
             "--replication): the survivors restore from the in-memory snapshots, never from disk")
    if c.parallel.fake_process_group or c.training.dry_run:
        fail("--inprocess-restart cannot run with --fake-process-group / --dry-run (nothing runs to restart)")
    if not os.environ.get(LAUNCHER_ENV):
        fail("--inprocess-restart needs megalite's launcher: python -m megalite.inprocess --nproc-per-node N "
             "pretrain_gpt.py ... (torchrun stops every worker when one dies)")
    if r.inprocess_active_world_size is not None and r.inprocess_active_world_size != c.parallel.world_size:
        fail(f"--inprocess-active-world-size {r.inprocess_active_world_size} must equal the training world size "
             f"({c.parallel.world_size}, WORLD_SIZE as the launcher sets it)")
    if r.inprocess_heartbeat_timeout <= r.inprocess_heartbeat_interval:
        fail(f"--inprocess-heartbeat-timeout {r.inprocess_heartbeat_timeout:g} must exceed "
             f"--inprocess-heartbeat-interval {r.inprocess_heartbeat_interval:g} (else a healthy rank is killed)")


def check_inprocess_backend(c: RunConfig) -> None:
    """Once the backend is known (validation's torch-side checks): in-process restart on gloo only."""
    if c.resilience.inprocess_restart and c.parallel.distributed_backend != "gloo":
        fail(f"--inprocess-restart runs on --distributed-backend gloo only (this run: "
             f"{c.parallel.distributed_backend}): an NCCL collective with a dead peer does not fail, it hangs until "
             "NCCL's watchdog aborts the process, the survivors' memory with it; megalite does not abort NCCL "
             "communicators (nvidia-resiliency-ext's AbortTorchDistributed)")


def check_non_persistent(c: RunConfig) -> None:
    """--non-persistent-*: each setting where it acts (checkpoint/native/local.py)."""
    r = c.resilience
    kind = r.non_persistent_ckpt_type
    given = lambda name: f"resilience.{name}" in c.explicit  # noqa: E731
    if kind == "in_memory" and not r.inprocess_restart:
        fail("--non-persistent-ckpt-type in_memory needs --inprocess-restart: an in-memory copy outlives a failure "
             "only in a surviving process (a restarted job starts with empty memory); use local (with --replication) "
             "or global")
    if kind == "in_memory" and not r.replication:
        fail("--non-persistent-ckpt-type in_memory needs --replication (with --replication-jump): a killed rank's "
             "only copy of its state would die with it")
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
        if kind not in ("local", "in_memory"):
            fail("--replication needs --non-persistent-ckpt-type local or in_memory")
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
    if kind in ("local", "in_memory") and get_strategy(c.ddp.data_parallel_sharding_strategy).shards_params:
        fail(f"--non-persistent-ckpt-type {kind} cannot run with --data-parallel-sharding-strategy optim_grads_params "
             "(not built: its parameters live in ZeRO-3's shards)")
