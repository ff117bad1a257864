"""--log-straggler names the slow rank: a worker the test keeps pausing (SIGSTOP/SIGCONT, while
it computes) shows the largest compute time; the others only wait longer in collectives.

On a loaded 2-core machine any rank may be descheduled for ~100 ms of a window, so one window's
maximum is noise-prone: the detection is judged on the sum over windows, with pauses (0.25 s,
then 0.25 s running) well above that noise, and each log line must name the maximum of its own
record. The compute times are per-iteration means over a window, so a pause that falls in compute
adds ~250/15 ms there. Under two busy loops beside it, in four runs, the slow rank's sum was
129-196 ms against at most 72 ms for the others (~16 s idle)."""
import os
import re
import signal
import time

from proc_helpers import kill_all, output, records, start_torchrun, state, wait_for, workers
from tiny import mock, tiny

# 4 windows of 15 iterations: the pauses start after the first and hold everyone up (the others wait in
# collectives), so the 45 iterations after it outlast several pauses. (Windows of 3 iterations, ~7 ms of
# compute each, could end within one pause cycle: a run where no pause fell in compute named rank 3.)
FLAGS = mock(1000) + tiny(seq_length=64, micro_batch_size=4, global_batch_size=16, train_iters=60, log_interval=15,
                           eval_iters=0, log_straggler=True, tensor_model_parallel_size=2)
SLOW = 2
PAUSE_S = 0.25


def test_paused_rank_is_named_slowest_in_compute(tmp_path):
    proc, jsonl = start_torchrun(4, FLAGS, tmp_path, "straggler")
    try:
        pid = workers(proc, 4)[SLOW]
        wait_for(lambda: any("consumed_samples" in r for r in records(jsonl)), 300, proc, "the first iteration")
        while proc.poll() is None:
            try:
                if state(pid) == "R":  # computing (a rank blocked in a collective sleeps): pause it there
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(PAUSE_S)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(PAUSE_S)  # then let it run: paused at most half the time
            except ProcessLookupError:  # the worker has finished; torchrun is about to
                pass
            time.sleep(0.02)
        assert proc.returncode == 0, output(proc)[1][-3000:]
    finally:
        kill_all(proc)
    reports = [r for r in records(jsonl) if r.get("event") == "straggler"]
    assert len(reports) == 4 and all(len(r["compute_ms"]) == 4 and len(r["data_wait_ms"]) == 4 for r in reports)
    later = reports[1:]  # the first window may end before the pauses start
    total = [sum(r["compute_ms"][k] for r in later) for k in range(4)]
    assert max(range(4), key=total.__getitem__) == SLOW, total
    lines = [int(m.group(1)) for m in re.finditer(r"compute \(ms\) min/max: [\d.]+ \(rank \d\) / [\d.]+ \(rank (\d)\)",
                                                  output(proc)[0])]
    assert lines == [max(range(4), key=r["compute_ms"].__getitem__) for r in reports], (lines, reports)
