"""Pipeline schedules (and, with more than one stage, the point-to-point exchange)."""
from .schedules import SCHEDULES, check_schedule, default_schedule_name, get_schedule

__all__ = ["SCHEDULES", "check_schedule", "default_schedule_name", "get_schedule"]
