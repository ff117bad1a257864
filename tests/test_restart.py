"""Automatic restart: under `torchrun --max-restarts 1`, a worker killed with SIGKILL after a
checkpoint makes torchrun restart the group; the new workers rendezvous (through a store of
their own attempt, not the dead workers' addresses), resume from the latest checkpoint with the
same command line, finish with exit status 0, and log the losses an uninterrupted run logs."""
import os
import signal

from dist_helpers import run_pretrain
from proc_helpers import kill_all, records, start_torchrun, wait_for, workers
from tiny import mock, tiny

NPROC = 2  # DP 2: a rank other than 0 is killed; more ranks would add process starts, not cases
FLAGS = mock(1000) + tiny(train_iters=20, log_interval=1, eval_iters=1, eval_interval=1000,
                           seed=7)  # dropout on: the restored RNG states must make the masks match too


def test_killed_worker_is_restarted_and_resumes_exactly(tmp_path):
    straight, _ = run_pretrain(NPROC, FLAGS, tmp_path, "straight")
    ck = str(tmp_path / "ck")
    proc, jsonl = start_torchrun(NPROC, FLAGS + ["--save", ck, "--load", ck, "--save-interval", "5"], tmp_path,
                                 "restarted", torchrun_args=("--max-restarts", "1"))
    try:
        first = workers(proc, NPROC)
        wait_for(lambda: os.path.isdir(os.path.join(ck, "iter_0000005")), 300, proc, "the first checkpoint")
        os.kill(first[1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0
    finally:
        kill_all(proc)
    logged = records(jsonl)
    starts = [i for i, r in enumerate(logged) if r.get("event") == "memory_footprint"]
    assert len(starts) == 2, "torchrun did not restart the workers exactly once"
    resumed = {r["iteration"]: r["lm_loss"] for r in logged[starts[1]:] if "consumed_samples" in r}
    loads = [r for r in logged[starts[1]:] if r.get("event") == "checkpoint_load"]
    assert len(loads) == NPROC and min(resumed) > 5 and max(resumed) == 20, sorted(resumed)
    reference = {r["iteration"]: r["lm_loss"] for r in straight if "consumed_samples" in r}
    worst = max(abs(resumed[i] - reference[i]) / abs(reference[i]) for i in resumed)
    assert worst <= 1e-6, f"resumed losses differ from the uninterrupted run's by {worst:.2e}"
