"""`python -m megalite.inprocess`'s own command line: the launcher's flags, then the script and
its flags, whose --inprocess-* settings the launcher acts on (megalite/inprocess/launcher.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config.resilience import ResilienceConfig
from .parser import configs_from_namespace, parse_args


@dataclass
class LauncherArgs:
    nproc: int
    master_addr: str
    master_port: int  # 0: a free port
    command: list[str]  # the script and its flags
    resilience: ResilienceConfig  # the script's --inprocess-* settings


def parse_launcher_args(argv=None) -> LauncherArgs:
    ap = argparse.ArgumentParser(prog="python -m megalite.inprocess",
                                 description="in-process restart's launcher (docs/operations.md)")
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True,
                    help="worker processes: --inprocess-active-world-size of them train, the rest are warm spares")
    ap.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    ap.add_argument("--master-port", "--master_port", type=int, default=0, help="the store's port (0: a free one)")
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    r = configs_from_namespace(parse_args(a.script_args)).resilience
    if not r.inprocess_restart:
        ap.error(f"{a.script} runs under python -m megalite.inprocess with --inprocess-restart only")
    if (r.inprocess_active_world_size or a.nproc_per_node) > a.nproc_per_node:
        ap.error(f"--inprocess-active-world-size {r.inprocess_active_world_size} is more than --nproc-per-node "
                 f"{a.nproc_per_node}")
    return LauncherArgs(a.nproc_per_node, a.master_addr, a.master_port, [a.script, *a.script_args], r)


__all__ = ["LauncherArgs", "parse_launcher_args"]
