"""Pipeline parallelism: the schedules by name (no-pipelining, 1F1B, interleaved 1F1B) and, with
more than one stage, the point-to-point exchange of activations and gradients."""
from .schedules import SCHEDULES, check_schedule, default_schedule_name, get_schedule

__all__ = ["SCHEDULES", "check_schedule", "default_schedule_name", "get_schedule"]
