"""The re-run state machine's flags and the weight-hash check: each only where it acts."""
from __future__ import annotations

from ..config import RunConfig
from ..config.sharding import get_strategy
from .errors import fail


def check_resilience(c: RunConfig) -> None:
    """A setting that would change nothing is refused, not ignored (runtime/rerun.py, weight_hash.py)."""
    r, t = c.resilience, c.training
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
