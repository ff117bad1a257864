"""Experiment trackers: Weights & Biases and TensorBoard, both optional.

One rank logs (the logging rank: last pipeline stage, TP 0, DP 0, which owns the loss): the
same metrics as the console line and the JSONL record, under `train/...` at each log interval
and `valid/...`, `test/...` at each evaluation, with the iteration as the step; plus the full
configuration (RunConfig.to_dict(), JSON-safe) once at start-up.

Neither package is required. Asking for one that is not installed fails in `validate_args`,
before any process group exists, with the `pip install` line to fix it (`check_available`).
W&B honours its own environment (WANDB_MODE=offline, WANDB_API_KEY, ...).
"""
from __future__ import annotations

import importlib.util
import json
import os

from ..config.run import json_safe
from ..config.training import TrackingConfig

# flag -> (module that must be importable, what to install)
REQUIREMENTS = {
    "wandb_project": ("wandb", "pip install wandb"),
    "tensorboard_dir": ("tensorboard", "pip install tensorboard"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return False


def missing_packages(config: TrackingConfig) -> list[str]:
    """One message per tracker asked for whose package is not importable."""
    out = []
    for attr, (module, install) in REQUIREMENTS.items():
        if getattr(config, attr) and not _installed(module):
            flag = "--" + attr.replace("_", "-")
            out.append(f"{flag} needs the {module} package, which is not installed: {install} "
                       f"(or `pip install megalite[{module}]`), or drop {flag}")
    return out


def scalars(record: dict) -> dict[str, float]:
    """The numeric entries of a JSONL record (booleans and None dropped; they are not curves)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iteration", "split")}


class Tracker:
    """Fans metrics out to the trackers asked for; a no-op when none is (or off the logging rank)."""

    def __init__(self, config: TrackingConfig | None = None, enabled: bool = True):
        self.wandb_run = None
        self.tb_writer = None
        if config is None or not enabled:
            return
        if config.wandb_project:
            import wandb
            save_dir = config.wandb_save_dir
            if save_dir is None and config.save:
                save_dir = os.path.join(config.save, "wandb")  # Megatron-LM's default
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
            self.wandb_run = wandb.init(project=config.wandb_project, name=config.wandb_exp_name,
                                        entity=config.wandb_entity, dir=save_dir)
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb_writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=1000)

    @property
    def active(self) -> bool:
        return self.wandb_run is not None or self.tb_writer is not None

    def log_config(self, config: dict) -> None:
        """The full configuration, once (W&B run config; a TensorBoard text panel)."""
        safe = json_safe(config)
        if self.wandb_run is not None:
            self.wandb_run.config.update(safe, allow_val_change=True)
        if self.tb_writer is not None:
            flat = {f"{s}.{k}": v for s, section in safe.items() for k, v in section.items()}  # RunConfig.to_dict()
            rows = "\n".join(f"| {k} | {json.dumps(v)} |" for k, v in sorted(flat.items()))
            self.tb_writer.add_text("config", "| flag | value |\n| --- | --- |\n" + rows, global_step=0)

    def log(self, record: dict, step: int, prefix: str) -> None:
        """The numeric fields of `record` as `prefix/key` at `step` (the iteration)."""
        values = {f"{prefix}/{k}": v for k, v in scalars(record).items()}
        if not values:
            return
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)
        if self.tb_writer is not None:
            for key, value in values.items():
                self.tb_writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
