"""What the sections of bench/run_all.py share: where their sandboxes live, the
environment of the commands they spawn, the percentile every table reports, the CPU
a process or the machine used, and waiting on a pool."""

import os
import time
from pathlib import Path
from typing import Callable, Dict, List

import ray

import sandman_ray as sandman
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


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used."""
    with open("/proc/%d/stat" % pid) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ticks_ms(ticks: int) -> float:
    """Clock ticks (of cpu_ticks, or a process's) in ms."""
    return ticks * 1e3 / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> int:
    """The machine's busy CPU time so far, in clock ticks."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def states(pool: str) -> dict:
    return ray.get(sandman.get_pool(pool).status.remote())["states"]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for %s" % what)
        time.sleep(0.2)


def interleaved(calls: Dict[str, Callable[[], object]], batches: int, per: int,
                warm: int = 20) -> Dict[str, List[float]]:
    """Each call's times (s): ``warm`` untimed calls each, then ``batches`` rounds in
    which each call in turn (the order rotating) is timed ``per`` times: side by side,
    so that the machine's drift falls on all of them alike."""
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(warm):
            call()
    names = list(calls)
    for turn in range(batches):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            for _ in range(per):
                started = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - started)
    return times


def run_alone(measure: Callable[[], dict], rows: Callable[[dict], list],
              name: str) -> int:
    """A section run by itself (``python bench/<section>.py``): ``measure()`` on a Ray
    of this machine's two CPUs, its ``rows`` as a table, then its JSON line."""
    import json
    import ray
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench", log_to_driver=False)
    try:
        result = measure()
    finally:
        ray.shutdown()
    for row in rows(result):
        print("%-6s %-62s %-18s %s" % row)
    print(json.dumps({"bench": name, "results": result}))
    return 0
