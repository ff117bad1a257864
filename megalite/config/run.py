"""RunConfig: every typed config of one run, by section. The sections' fields declare their flags
(config/fields.py), so this list of sections is also the list of the command line's groups, and a
RunConfig's `to_dict` is what checkpoints and experiment trackers record (versioned: `from_saved`
reads the flat flag record that checkpoints held before sections existed)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from .fields import flagged_fields
from .model import GPTConfig
from .data import DataConfig, TokenizerConfig
from .fp8 import FP8Config
from .kernels import KernelConfig
from .megatron import MegatronCompatConfig
from .optimizer import OptimizerConfig
from .parallel import DDPConfig, ParallelConfig, RecomputeConfig
from .resilience import ResilienceConfig
from .training import CheckpointConfig, TrackingConfig, TrainingConfig

CONFIG_VERSION = 2  # 1: a flat dict of the validated flags under "args"; 2: sections under "config"

# section name -> config class, in the order of --help
SECTIONS: dict[str, type] = {
    "model": GPTConfig, "kernels": KernelConfig, "parallel": ParallelConfig, "recompute": RecomputeConfig,
    "training": TrainingConfig, "optimizer": OptimizerConfig, "ddp": DDPConfig, "data": DataConfig,
    "tokenizer": TokenizerConfig, "checkpoint": CheckpointConfig, "tracking": TrackingConfig,
    "fp8": FP8Config, "resilience": ResilienceConfig, "megatron": MegatronCompatConfig,
}


@dataclass
class RunConfig:
    """Everything one run is configured with. `explicit` names the fields ("section.field") whose
    flags were given on the command line (or, with --use-checkpoint-args, taken from the
    checkpoint): rules that depend on whether a flag was given (not on its value) read it.
    `notices` are start-up notes from validation, printed once."""
    model: GPTConfig = field(default_factory=GPTConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    megatron: MegatronCompatConfig = field(default_factory=MegatronCompatConfig)
    explicit: frozenset = frozenset()
    notices: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """{section: {field: value}}: plain JSON-safe data (tuples become lists)."""
        return {name: json_safe(dataclasses.asdict(getattr(self, name))) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """The inverse of `to_dict`; fields it does not know (a newer or older megalite) are dropped."""
        return cls(**{name: _section(SECTIONS[name], d.get(name, {})) for name in SECTIONS})


def _section(cls, values: dict):
    known = {f.name for f in fields(cls) if f.init}
    return cls(**{k: v for k, v in values.items() if k in known})


def json_safe(value):
    """A config record -> something json.dumps, wandb's config and TensorBoard's text accept:
    dtypes, paths and other objects become strings, NaN/inf become strings, containers recurse."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [json_safe(v) for v in value]
    return str(value).replace("torch.", "")


def owners() -> dict[str, str]:
    """field name -> its section, for the fields set by a flag (each flag has exactly one field)."""
    out = {}
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            if "flag" in f.metadata:
                out[f.name] = name
    return out


# --use-checkpoint-args (arguments/checkpoint_args.py) takes these from the checkpoint only where
# the command line does not give them (Megatron-LM's _set_arg without force): the shape, which a
# script states on purpose; a shape the checkpoint's weights cannot fill is then refused by the
# load, naming the flag (checkpoint/native/state.py says which of its differences these are).
IF_NOT_GIVEN = ("model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.seq_length",
                "model.num_attention_heads", "model.kv_channels", "model.max_position_embeddings")


def shape_flags() -> set[str]:
    """The flags of IF_NOT_GIVEN, as the command line names them."""
    flags = {f"{s}.{f.name}": fl for s, cls in SECTIONS.items() for f, fl in flagged_fields(cls)}
    return {flags[key].name for key in IF_NOT_GIVEN}


def from_saved(meta: dict) -> dict:
    """{section: {field: value}} of a checkpoint's metadata, whichever version wrote it: version 2
    stores the sections; version 1 stored the validated flags flat (`args`), each sorted here into
    the section that owns its field now."""
    if "config" in meta:
        return meta["config"]
    flat = dict(meta.get("args") or {})
    out = {name: {} for name in SECTIONS}
    where = owners()
    for key, value in flat.items():
        if key in where:
            out[where[key]][key] = value
    return out


__all__ = ["CONFIG_VERSION", "SECTIONS", "IF_NOT_GIVEN", "RunConfig", "from_saved", "json_safe", "owners",
           "shape_flags"]
