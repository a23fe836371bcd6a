"""What the sections of bench/run_all.py share: where their sandboxes live, the
environment of the commands they spawn, and the percentile every table reports."""

from pathlib import Path
from typing import List

from sandman_ray.providers.local import LocalProvider

ROOT = Path(__file__).resolve().parent.parent
STATE = "/tmp/sandman-ray/bench-all"
CACHE = str(ROOT / ".cache" / "provider")
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def provider() -> LocalProvider:
    return LocalProvider(state_root=STATE, cache_root=CACHE)
