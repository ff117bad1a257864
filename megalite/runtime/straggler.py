"""--log-straggler: which rank is slow, and at what (as Megatron-LM's StragglerDetector, which
reports the min and max over ranks with the rank that has each).

In a synchronous job the slowest rank sets everyone's step time, and the others spend the
difference blocked in collectives, so step time alone cannot find it. Per rank and iteration:

    compute = step time - time blocked in collectives - time waiting for data

where "blocked in collectives" is what comm.py's monitor measures around every blocking call
(synchronous collectives, waits of asynchronous ones, pipeline send/recv), and "waiting for
data" is the time in the micro-batch iterators minus the collectives inside them (the TP
broadcast of each micro-batch). The rank with the largest compute time is the straggler; a
large data wait points at the input pipeline instead. On CUDA the step is bracketed by
synchronisations and so is every blocking call (monitor.py), so GPU time lands where it is
spent; GPU power, temperature and SM clock come from torch.cuda (pynvml) when installed.

Values are averaged per iteration over the log interval and gathered to every rank at each
log line (one small all-gather; only with --log-straggler).
"""
from __future__ import annotations

import time

import torch

from .. import comm

FIELDS = ("compute_ms", "data_wait_ms", "wait_ms", "power_w", "temperature_c", "clock_mhz")


def _gpu_stats_available(device: torch.device) -> str | None:
    """None when torch.cuda can read power, temperature and clock here, else why not."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        torch.cuda.power_draw(device), torch.cuda.temperature(device), torch.cuda.clock_rate(device)
    except Exception as e:  # ModuleNotFoundError for pynvml, or an NVML error
        return f"{type(e).__name__}: {e}"
    return None


class StragglerDetector:
    def __init__(self, ps, device: torch.device, monitor):
        self.ps, self.device, self.monitor = ps, device, monitor
        self.gpu_unavailable = _gpu_stats_available(device)
        self.reset()

    def reset(self) -> None:
        self.steps, self.step_s, self.wait_s, self.data_s = 0, 0.0, 0.0, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start_step(self) -> None:
        self._sync()
        self._t0, self._w0 = time.perf_counter(), self.monitor.wait_s

    def end_step(self) -> None:
        self._sync()
        self.step_s += time.perf_counter() - self._t0
        self.wait_s += self.monitor.wait_s - self._w0
        self.steps += 1

    def data_iterator(self, it):
        """Wrap a micro-batch iterator: time in next() counts as data wait, except the time its
        own collectives were blocked (already counted as collective wait)."""
        while True:
            t0, w0 = time.perf_counter(), self.monitor.wait_s
            batch = next(it)
            self.data_s += (time.perf_counter() - t0) - (self.monitor.wait_s - w0)
            yield batch

    def gather(self) -> dict[str, list[float]]:
        """Every rank's per-iteration averages since the last call (a collective: every rank
        calls it at the same log line), indexed by global rank."""
        n = max(self.steps, 1)
        data_ms = 1e3 * self.data_s / n
        wait_ms = 1e3 * self.wait_s / n
        mine = [1e3 * self.step_s / n - wait_ms - data_ms, data_ms, wait_ms, float("nan"), float("nan"), float("nan")]
        if self.gpu_unavailable is None:
            mine[3:] = [torch.cuda.power_draw(self.device) / 1e3, float(torch.cuda.temperature(self.device)),
                        float(torch.cuda.clock_rate(self.device))]
        t = torch.tensor(mine, dtype=torch.float64, device=self.device)
        rows = comm.all_gather(t.unsqueeze(0), comm.world_group()).tolist()
        self.reset()
        return {f: [row[i] for row in rows] for i, f in enumerate(FIELDS)}

    def report(self, iteration: int) -> tuple[str, dict]:
        """(text for the log line, the JSONL record)."""
        g = self.gather()
        parts = [_minmax("compute (ms)", g["compute_ms"], "{:.1f}"), _minmax("data wait (ms)", g["data_wait_ms"], "{:.1f}")]
        record = {"event": "straggler", "iteration": iteration,
                  **{f: [round(v, 3) for v in g[f]] for f in ("compute_ms", "data_wait_ms", "wait_ms")}}
        if self.gpu_unavailable is None:
            parts += [_minmax("power (W)", g["power_w"], "{:.0f}"), _minmax("temp (C)", g["temperature_c"], "{:.0f}"),
                      _minmax("clock (MHz)", g["clock_mhz"], "{:.0f}")]
            record.update({f: g[f] for f in ("power_w", "temperature_c", "clock_mhz")})
        return " | ".join(parts), record


def _minmax(label: str, values: list[float], fmt: str) -> str:
    lo = min(range(len(values)), key=values.__getitem__)
    hi = max(range(len(values)), key=values.__getitem__)
    return f"{label} min/max: {fmt.format(values[lo])} (rank {lo}) / {fmt.format(values[hi])} (rank {hi})"
