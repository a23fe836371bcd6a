"""What both example programs do around their training loop."""

import argparse
import os
from pathlib import Path
from typing import Any, Dict, Sequence

import ray

from sandman_ray.providers.local import leftovers

HERE = Path(__file__).resolve().parent
CACHE_ROOT = str(HERE.parent.parent / ".cache" / "provider")


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     names: Sequence[str]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            parser.error("--%s must be at least 1" % name.replace("_", "-"))


def init_ray(namespace: str) -> None:
    """A local Ray on two CPUs, or the running cluster ``RAY_ADDRESS`` names, whose
    workers (of this job) import this directory's modules."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    options: Dict[str, Any] = {"namespace": namespace,
                               "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **options)
    else:
        ray.init(num_cpus=2, include_dashboard=False, **options)


def sandboxes_left(pool: str, state_root: str) -> int:
    """Sandbox processes, state directories and cgroups of ``pool`` still on this host."""
    left = leftovers(pool, state_root)
    return len(left["processes"]) + len(left["directories"]) + len(left["cgroups"])
