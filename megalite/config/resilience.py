"""ResilienceConfig: Megatron-LM's flags for surviving faults: the re-run state machine and its
error injection (runtime/rerun.py) and the weight-hash check across data-parallel replicas
(runtime/weight_hash.py). Their meanings and defaults follow Megatron-LM's
(megatron/training/config/resilience_config.py, training_config.py), except where a field says so."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag


INPROCESS = ("in-process restart (surviving ranks rebuilding their process groups with a replacement, restored "
             "from in-memory copies) is not built yet; restart with torchrun --max-restarts and resume from "
             "--non-persistent-ckpt-type local checkpoints (docs/operations.md)")


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
        "in_memory is refused (it needs in-process restart, not built)", choices=["global", "local", "in_memory"])
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

    # Megatron-LM's in-process restart (nvidia-resiliency-ext's Wrapper): not built, each flag refused
    inprocess_restart: bool = flag("--inprocess-restart", False, "refused: " + INPROCESS, action="store_true")
    inprocess_max_iterations: int | None = flag("--inprocess-max-iterations", None, "refused: " + INPROCESS, type=int)
    inprocess_monitor_thread_interval: float | None = flag("--inprocess-monitor-thread-interval", None,
                                                           "refused: " + INPROCESS, type=float)
    inprocess_monitor_process_interval: float | None = flag("--inprocess-monitor-process-interval", None,
                                                            "refused: " + INPROCESS, type=float)
    inprocess_progress_watchdog_interval: float | None = flag("--inprocess-progress-watchdog-interval", None,
                                                              "refused: " + INPROCESS, type=float)
    inprocess_heartbeat_interval: float | None = flag("--inprocess-heartbeat-interval", None, "refused: " + INPROCESS,
                                                      type=float)
    inprocess_soft_timeout: float | None = flag("--inprocess-soft-timeout", None, "refused: " + INPROCESS, type=float)
    inprocess_hard_timeout: float | None = flag("--inprocess-hard-timeout", None, "refused: " + INPROCESS, type=float)
    inprocess_heartbeat_timeout: float | None = flag("--inprocess-heartbeat-timeout", None, "refused: " + INPROCESS,
                                                     type=float)
    inprocess_barrier_timeout: float | None = flag("--inprocess-barrier-timeout", None, "refused: " + INPROCESS,
                                                   type=float)
    inprocess_completion_timeout: float | None = flag("--inprocess-completion-timeout", None, "refused: " + INPROCESS,
                                                      type=float)
    inprocess_last_call_wait: float | None = flag("--inprocess-last-call-wait", None, "refused: " + INPROCESS,
                                                  type=float)
    inprocess_termination_grace_time: float | None = flag("--inprocess-termination-grace-time", None,
                                                          "refused: " + INPROCESS, type=float)
    inprocess_granularity: str | None = flag("--inprocess-granularity", None, "refused: " + INPROCESS,
                                             choices=["node", "rank"])
    inprocess_active_world_size: int | None = flag("--inprocess-active-world-size", None, "refused: " + INPROCESS,
                                                   type=int)
    inprocess_empty_cuda_cache: bool = flag("--inprocess-empty-cuda-cache", False, "refused: " + INPROCESS,
                                            action="store_true")

    @property
    def validates(self) -> bool:
        return self.rerun_mode != "disabled"


__all__ = ["INPROCESS", "ResilienceConfig"]
