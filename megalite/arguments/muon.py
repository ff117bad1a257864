"""--optimizer muon's flags and Lion's: each only where it acts."""
from __future__ import annotations

from ..config import RunConfig
from .errors import fail, flag

MUON_FIELDS = ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_num_ns_steps", "muon_scale_mode",
               "muon_extra_scale_factor", "muon_tp_mode", "muon_scalar_optimizer")
LION_FIELDS = ("lion_beta1", "lion_beta2")


def check_muon(c: RunConfig) -> None:
    """A Muon or Lion setting given where it would change nothing is refused, not ignored."""
    o = c.optimizer
    given = [f for f in MUON_FIELDS + LION_FIELDS if f"optimizer.{f}" in c.explicit]
    if o.optimizer != "muon":
        if given:
            fail(f"{flag(given[0])} is a setting of --optimizer muon; this run uses --optimizer {o.optimizer}")
        return
    lion = [f for f in given if f in LION_FIELDS]
    if lion and o.muon_scalar_optimizer != "lion":
        fail(f"{flag(lion[0])} is a setting of --muon-scalar-optimizer lion; this run's scalar optimizer is "
             f"{o.muon_scalar_optimizer}")
