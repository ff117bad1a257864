"""ResilienceConfig: Megatron-LM's flags for surviving faults: the re-run state machine and its
error injection (runtime/rerun.py) and the weight-hash check across data-parallel replicas
(runtime/weight_hash.py). Their meanings and defaults follow Megatron-LM's
(megatron/training/config/resilience_config.py, training_config.py), except where a field says so."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import flag


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

    @property
    def validates(self) -> bool:
        return self.rerun_mode != "disabled"


__all__ = ["ResilienceConfig"]
