"""--distributed-timeout-minutes: a worker paused for good (SIGSTOP) makes its peers' collectives
time out; each of them dumps its Python stacks and fails with an error naming the timeout, the
collective, the iteration and the pipeline stage, within about twice the timeout, and the run
ends instead of hanging. (A stopped worker cannot act on torchrun's SIGTERM, so torchrun would
wait its fixed 30 s grace before SIGKILLing it; the test resumes it once its peers have failed.)"""
import os
import re
import signal
import time

from proc_helpers import kill_all, output, records, start_torchrun, state, wait_for, workers
from tiny import mock, tiny

TIMEOUT_MIN = 0.1  # 6 s
FLAGS = mock(1000) + tiny(train_iters=100000, log_interval=1, eval_iters=0, pipeline_model_parallel_size=2,
                           distributed_timeout_minutes=TIMEOUT_MIN)


def test_a_paused_rank_ends_the_run_with_a_named_timeout(tmp_path):
    proc, jsonl = start_torchrun(4, FLAGS, tmp_path, "timeout")
    try:
        pids = workers(proc, 4)
        wait_for(lambda: sum("consumed_samples" in r for r in records(jsonl)) >= 3, 300, proc, "three iterations")
        os.kill(pids[1], signal.SIGSTOP)
        paused = time.time()
        others = [pid for rank, pid in pids.items() if rank != 1]
        wait_for(lambda: all(state(pid) in "Z?" for pid in others), 600, None, "the other ranks to fail")
        failed = time.time() - paused
        # torchrun has sent the stopped worker SIGTERM, which it acts on once resumed (else torchrun
        # would SIGKILL it after its fixed 30 s grace: the same end, 30 s later)
        os.kill(pids[1], signal.SIGCONT)
        status = proc.wait(timeout=600)
        ended = time.time() - paused
    finally:
        kill_all(proc)
    _, err = output(proc)
    assert status != 0
    timeout_s = 60 * TIMEOUT_MIN
    # a rank times out at most one timeout after the pause plus the iteration it was in; a few
    # seconds more for stack dumps and process exit on a loaded machine
    assert failed <= 2 * timeout_s + 5, f"the running ranks took {failed:.1f} s to fail after the pause"
    assert ended <= failed + timeout_s + 10, f"the run took {ended:.1f} s to end after the pause"
    named = re.findall(r"CollectiveError: rank (\d) \(pipeline stage (\d) of 2, TP rank 0, DP rank \d\) in iteration "
                       r"(\d+): (\S+) over (.+?) timed out after [\d.]+ s \(--distributed-timeout-minutes 0.1\)", err)
    assert named, err[-5000:]
    # the running ranks report; the paused one may too, once resumed (its own collective then times
    # out before torchrun's SIGTERM ends it: seen once in a fresh-clone run)
    assert any(int(rank) != 1 for rank, *_ in named), named
    assert "this rank's Python stacks:" in err and 'File "' in err  # faulthandler's dump
