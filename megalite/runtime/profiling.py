"""--profile: a torch.profiler trace of a few training iterations on the ranks asked for.

Megatron-LM's --profile starts and stops an nsys capture (cudaProfilerStart/Stop) around the
iterations after --profile-step-start up to --profile-step-end; with --use-pytorch-profiler it
records them with torch.profiler into --tensorboard-dir. megalite always does the latter, which
also works on CPU: one Chrome-trace file per profiled rank (`rank<N>.<time>.pt.trace.json`,
TensorBoard's profiler plugin and chrome://tracing read it), in --tensorboard-dir, else ./profile.
"""
from __future__ import annotations

import os

import torch


class Profiler:
    def __init__(self, t, rank: int, device: torch.device):
        self.enabled = bool(t.profile) and rank in t.profile_ranks
        self.start_at, self.end_at, self.dir, self.rank = t.profile_step_start, t.profile_step_end, t.profile_dir, rank
        self.device, self.prof = device, None

    def before_iteration(self, completed: int) -> None:
        """Called with the number of iterations completed so far, before the next one."""
        if self.enabled and self.prof is None and completed == self.start_at:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(self.dir, exist_ok=True)
            self.prof = torch.profiler.profile(
                activities=activities, record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.dir, worker_name=f"rank{self.rank}"))
            self.prof.start()

    def after_iteration(self, completed: int) -> None:
        if self.prof is not None and completed >= self.end_at:
            self.stop()

    def stop(self) -> None:
        """Write the trace (also when training ends before --profile-step-end)."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            print(f"> rank {self.rank}: profile of iterations {self.start_at + 1}..{self.end_at} written to "
                  f"{self.dir}/", flush=True)
