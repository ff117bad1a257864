"""ResilienceConfig: Megatron-LM's flags for surviving faults: the re-run state machine and its
error injection (runtime/rerun.py) and the weight-hash check across data-parallel replicas
(runtime/weight_hash.py). Their meanings and defaults follow Megatron-LM's
(megatron/training/config/resilience_config.py, training_config.py), except where a field says so."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag


# the environment megalite's in-process launcher (megalite/inprocess/launcher.py) gives its workers
LAUNCHER_ENV = "MEGALITE_INPROCESS_STORE"  # host:port of the launcher's store
SLOT_ENV = "MEGALITE_INPROCESS_SLOT"  # the worker process's number (a rank moves between processes; a slot doesn't)
REPLACEMENT_ENV = "MEGALITE_INPROCESS_REPLACEMENT"  # set for a process started to replace a dead rank mid-job

NVRX_ONLY = ("megalite's in-process restart (megalite/inprocess/) finds a failed rank by its exit or by a stale "
             "heartbeat (--inprocess-heartbeat-timeout) and replaces that one rank; nvidia-resiliency-ext's progress "
             "watchdog, monitor thread and completion barriers, which this flag tunes, have no counterpart here")


@dataclass
class ResilienceConfig:
    """Result validation by re-running an iteration, and silent-corruption checks (docs/operations.md)"""
    rerun_mode: str = flag(
        "--rerun-mode", "disabled", "validate_results: an iteration whose loss or gradients are rejected (NaN/Inf "
        "with --check-for-nan-in-loss-and-grad, a loss spike with --check-for-spiky-loss) is run again from the same "
        "state and data, in place and then on another data-parallel replica, to tell a transient fault, a "
        "persistent fault of one rank and a correct result apart; report_stats: every iteration is run twice and "
        "the spread of the loss reported; disabled (megalite's default; Megatron-LM's is validate_results): no "
        "re-runs", choices=["disabled", "validate_results", "report_stats"])
    error_injection_rate: int = flag(
        "--error-injection-rate", 0, "with --rerun-mode validate_results: inject a fault into about one result "
        "validation in this many (0: none), on a rank and micro-batch drawn from --seed and the iteration",
        check=(lambda v: v >= 0, ">= 0"))
    error_injection_type: str = flag(
        "--error-injection-type", "transient_error", "the fault --error-injection-rate injects (a NaN loss): "
        "transient_error (only in the first run), persistent_error (whenever the faulty rank computes), "
        "correct_result (whenever anyone computes the faulty micro-batch)",
        choices=["correct_result", "transient_error", "persistent_error"])
    result_rejected_tracker_filename: str | None = flag(
        "--result-rejected-tracker-filename", None, "a file each rejected result is appended to, one line each, in "
        "Megatron-LM's format (ts= node= device= jobID= rank= iteration= status= result= message=)", type=str)
    check_weight_hash_across_dp_replicas_interval: int | None = flag(
        "--check-weight-hash-across-dp-replicas-interval", None, "every N iterations (and at start), hash each "
        "parameter on every rank and compare the hashes across data-parallel replicas; a mismatch names the ranks "
        "and the parameters and stops the run before any checkpoint of it", type=int,
        check=(lambda v: v >= 1, ">= 1"))

    # non-persistent checkpoints (checkpoint/native/local.py): the latest state, for this job's next restart
    non_persistent_save_interval: int | None = flag(
        "--non-persistent-save-interval", None, "iterations between non-persistent saves (with "
        "--non-persistent-ckpt-type); a resume with --load takes the newest of the persistent and non-persistent "
        "checkpoints", type=int, check=(lambda v: v >= 1, ">= 1"))
    non_persistent_ckpt_type: str | None = flag(
        "--non-persistent-ckpt-type", None, "global: a full checkpoint under --non-persistent-global-ckpt-dir (default "
        "<--save>/non_persistent), only the latest kept; local: each rank's own state in its own directory under "
        "--non-persistent-local-ckpt-dir (node-local storage), same layout only, with --replication copies on peers; "
        "in_memory: each rank's state in host memory, with --replication-factor - 1 copies on peers (needs "
        "--inprocess-restart: a copy in memory outlives a failure only in a surviving process)", choices=["global", "local", "in_memory"])
    non_persistent_global_ckpt_dir: str | None = flag(
        "--non-persistent-global-ckpt-dir", None, "where --non-persistent-ckpt-type global saves (default "
        "<--save>/non_persistent)", type=str)
    non_persistent_local_ckpt_dir: str | None = flag(
        "--non-persistent-local-ckpt-dir", None, "where --non-persistent-ckpt-type local saves: rank_RRRRR/ "
        "below it for each rank (a node-local path)", type=str)
    non_persistent_local_ckpt_algo: str = flag(
        "--non-persistent-local-ckpt-algo", "fully_parallel", "Megatron-LM's choice of local saving strategy; "
        "megalite's local save is one file per rank written atomically either way (a notice)",
        choices=["fully_parallel", "atomic"])
    replication: bool = flag(
        "--replication", False, "with --non-persistent-ckpt-type local: each rank's local checkpoint is also "
        "written by the other --replication-factor - 1 ranks of its group, --replication-jump ranks apart",
        action="store_true")
    replication_jump: int | None = flag(
        "--replication-jump", None, "J: the ranks n, n+J, ..., n+(F-1)J (in blocks of J x F) hold each other's local "
        "checkpoints (J = ranks per node puts every copy on another node)", type=int,
        check=(lambda v: v >= 1, ">= 1"))
    replication_factor: int = flag(
        "--replication-factor", 2, "F: the ranks holding each local checkpoint (its own and F - 1 copies)",
        check=(lambda v: v >= 2, ">= 2"))

    # in-process restart (megalite/inprocess/, as Megatron-LM's with nvidia-resiliency-ext's Wrapper)
    inprocess_restart: bool = flag(
        "--inprocess-restart", False, "survive a dead or frozen rank without restarting the job: under python -m "
        "megalite.inprocess, the surviving processes rebuild their process groups with a replacement (a spare, or "
        "a new process), every rank restores the latest --non-persistent-ckpt-type in_memory snapshot (the lost "
        "rank's from its replica) and training goes on (docs/operations.md)", action="store_true")
    inprocess_max_iterations: int | None = flag(
        "--inprocess-max-iterations", None, "the most in-process restarts before the job fails (default: no limit)",
        type=int, check=(lambda v: v >= 1, ">= 1"))
    inprocess_monitor_process_interval: float = flag(
        "--inprocess-monitor-process-interval", 1.0, "seconds between the launcher's checks of its workers' "
        "processes and heartbeats", check=(lambda v: v > 0, "> 0"))
    inprocess_heartbeat_interval: float = flag(
        "--inprocess-heartbeat-interval", 30.0, "seconds between a worker's heartbeats (a thread: it beats while "
        "the process runs, also while it waits in a collective)", check=(lambda v: v > 0, "> 0"))
    inprocess_heartbeat_timeout: float = flag(
        "--inprocess-heartbeat-timeout", 60.0, "a rank whose last heartbeat is older than this is frozen: the "
        "launcher kills it (SIGKILL) and replaces it", check=(lambda v: v > 0, "> 0"))
    inprocess_barrier_timeout: float = flag(
        "--inprocess-barrier-timeout", 120.0, "seconds a worker waits for the launcher's verdict after a failed "
        "collective (no new generation: the error is its own) and for the launcher's store, and a new process may "
        "take to its first heartbeat (imports, start-up)", check=(lambda v: v > 0, "> 0"))
    inprocess_active_world_size: int | None = flag(
        "--inprocess-active-world-size", None, "the ranks that train (WORLD_SIZE under the launcher); the launcher's "
        "other processes (--nproc-per-node minus this) wait as warm spares, each taking a failed rank's place "
        "without a new process's start-up", type=int, check=(lambda v: v >= 1, ">= 1"))
    inprocess_granularity: str = flag(
        "--inprocess-granularity", "rank", "rank: a failure replaces the failed rank only; node (Megatron-LM's "
        "default) is refused: megalite's launcher runs one node", choices=["node", "rank"])
    inprocess_empty_cuda_cache: bool = flag(
        "--inprocess-empty-cuda-cache", False, "Megatron-LM: release the CUDA cache's free blocks at every restart; "
        "a notice here (in-process restart runs on gloo, on the CPU)", action="store_true")
    inprocess_soft_timeout: float | None = flag("--inprocess-soft-timeout", None, "refused: " + NVRX_ONLY, type=float)
    inprocess_hard_timeout: float | None = flag("--inprocess-hard-timeout", None, "refused: " + NVRX_ONLY, type=float)
    inprocess_monitor_thread_interval: float | None = flag("--inprocess-monitor-thread-interval", None,
                                                           "refused: " + NVRX_ONLY, type=float)
    inprocess_progress_watchdog_interval: float | None = flag("--inprocess-progress-watchdog-interval", None,
                                                              "refused: " + NVRX_ONLY, type=float)
    inprocess_completion_timeout: float | None = flag("--inprocess-completion-timeout", None, "refused: " + NVRX_ONLY,
                                                      type=float)
    inprocess_last_call_wait: float | None = flag("--inprocess-last-call-wait", None, "refused: " + NVRX_ONLY,
                                                  type=float)
    inprocess_termination_grace_time: float | None = flag("--inprocess-termination-grace-time", None,
                                                          "refused: " + NVRX_ONLY, type=float)

    @property
    def validates(self) -> bool:
        return self.rerun_mode != "disabled"


__all__ = ["LAUNCHER_ENV", "NVRX_ONLY", "REPLACEMENT_ENV", "ResilienceConfig", "SLOT_ENV"]
