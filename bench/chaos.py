"""The fault suite: do the bad things on purpose, then count what is left.

    python bench/chaos.py [--trials 10] [--scenarios driver_sigkill,agent_killed,...]

Each trial makes a fresh pool on a local Ray cluster (LocalProvider, image ``host``; a
head node, to which ``node_removed`` adds a worker node and removes it), does one
bad thing, waits for the pool to recover, then shuts the pool down and counts the
sandboxes left on the host (processes and state directories) and the leases or strays
the pool still had. It prints a line per trial and a table per scenario: trials,
passed, sandboxes leaked, reclaim time (max and p99: from the fault to the lease being
free again), errors surfaced to callers. The last line is JSON.
"""

import argparse
import asyncio
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import ray
from ray.cluster_utils import Cluster

import sandman_ray as sandman
from sandman_ray.errors import SandboxLost
from sandman_ray.providers.faults import FaultyProvider
from sandman_ray.providers.local import LocalProvider, leftovers
from sandman_ray.providers.nodes import agent_name

import progress  # bench/progress.py

ROOT = Path(__file__).resolve().parent.parent
STATE = "/tmp/sandman-ray-chaos/state"
CACHE = str(ROOT / ".cache" / "provider")
IMAGE = "host"
RECLAIM_TIMEOUT_S = 30.0
CLUSTER: Optional[Cluster] = None
HOLDING_DRIVER = """
import sys, ray, sandman_ray as sandman
ray.init(address=sys.argv[1], namespace="sandman-chaos", log_to_driver=False)
handles = [sandman.acquire(sys.argv[3], pool=sys.argv[2], timeout=120)
           for _ in range(int(sys.argv[4]))]
ray.get([h.exec.remote("sleep 600 &") for h in handles])  # work left running inside
print("holding", flush=True)
sys.stdin.read()
"""


@dataclass
class Trial:
    """One fault and its outcome."""

    scenario: str
    ok: bool = False
    reclaim_s: Optional[float] = None   # fault -> lease free again (None: not measured)
    surfaced: int = 0                   # errors callers saw (expected ones included)
    leaked: int = 0                     # sandboxes left on the host after shutdown
    detail: str = ""
    notes: List[str] = field(default_factory=list)


# ---------------------------------------------------------------------- helpers
def new_pool(provider=None, **config) -> str:
    name = "chaos-" + uuid.uuid4().hex[:8]
    config.setdefault("sweep_interval_s", 0.2)
    config.setdefault("lease_grace_s", 3.0)
    sandman.create_pool(name, provider=provider or LocalProvider(state_root=STATE,
                                                                 cache_root=CACHE), **config)
    return name


def status(pool: str) -> dict:
    return ray.get(sandman.get_pool(pool).status.remote())


def ready_on_alive_nodes(pool: str) -> int:
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return sum(1 for s in ray.get(sandman.get_pool(pool).list_sandboxes.remote())
               if s["state"] == "ready" and s["node_id"] in alive)


def leased(pool: str) -> int:
    return status(pool)["states"]["leased"]


def until(predicate: Callable[[], bool], timeout: float = RECLAIM_TIMEOUT_S) -> Optional[float]:
    """Seconds until ``predicate`` held, or None if it did not within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def sandbox_pids(sandbox_id: str) -> List[int]:
    """Host pids of the processes of one sandbox, bwrap first."""
    bwrap = [pid for pid in _pids() if sandbox_id.encode() in _cmdline(pid)
             and _cmdline(pid).startswith(b"bwrap")]
    found, frontier = list(bwrap), list(bwrap)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid in _pids() if _ppid(pid) == parent]
        found += children
        frontier += children
    return found


def _pids() -> List[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def finish(pool: str, trial: Trial) -> Trial:
    """Shut the pool down and count what it left; a trial with leftovers fails."""
    try:
        strays = ray.get(sandman.get_pool(pool).gc.remote(True))
        open_leases = leased(pool)
    finally:
        sandman.shutdown_pool(pool)
    left = leftovers(pool, STATE)
    trial.leaked = (len(left["processes"]) + len(left["directories"]) + len(left["cgroups"])
                    + len(strays))
    if strays:
        trial.notes.append("strays before shutdown: %d" % len(strays))
    if open_leases:
        trial.notes.append("leases still open: %d" % open_leases)
    trial.ok = trial.ok and trial.leaked == 0 and open_leases == 0
    return trial


# ---------------------------------------------------------------------- scenarios
def driver_sigkill(trial: Trial) -> Trial:
    """A driver holding 3 leases (with processes running in them) is SIGKILLed."""
    pool = new_pool()
    proc = subprocess.Popen([sys.executable, "-c", HOLDING_DRIVER,
                             ray.get_runtime_context().gcs_address, pool, IMAGE, "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if not any(line.strip() == "holding" for line in proc.stdout):
            trial.detail = "the driver did not get its sandboxes"
            return finish(pool, trial)
        held = leased(pool)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        trial.reclaim_s = until(lambda: leased(pool) == 0)
        trial.ok = held == 3 and trial.reclaim_s is not None
        trial.detail = "3 leases of a killed driver freed"
    finally:
        if proc.poll() is None:
            proc.kill()
    return finish(pool, trial)


@ray.remote(num_cpus=0)
class Holder:
    """A rollout worker that holds sandboxes."""

    def hold(self, pool: str, count: int) -> List[str]:
        self.handles = [sandman.acquire(IMAGE, pool=pool, timeout=120) for _ in range(count)]
        return ray.get([h.sandbox_id.remote() for h in self.handles])


def worker_killed(trial: Trial) -> Trial:
    """A rollout worker actor holding 2 leases is killed."""
    pool = new_pool()
    holder = Holder.remote()
    ray.get(holder.hold.remote(pool, 2))
    ray.kill(holder)
    trial.reclaim_s = until(lambda: leased(pool) == 0)
    trial.ok = trial.reclaim_s is not None
    trial.detail = "2 leases of a killed actor freed"
    return finish(pool, trial)


def handle_dropped(trial: Trial) -> Trial:
    """The caller drops its only reference to a handle without releasing it."""
    pool = new_pool()
    handle = sandman.acquire(IMAGE, pool=pool, timeout=120)
    ray.get(handle.exec.remote("true"))
    held = leased(pool)
    del handle
    gc.collect()
    trial.reclaim_s = until(lambda: leased(pool) == 0)
    trial.ok = held == 1 and trial.reclaim_s is not None
    trial.detail = "a dropped handle's lease freed"
    return finish(pool, trial)


def acquire_cancelled(trial: Trial) -> Trial:
    """Acquires cancelled at every stage (queued, creating, lent, binding), and one
    that times out."""
    pool = new_pool(max_sandboxes=8)

    async def run():
        surfaced = 0
        for delay in (0.0, 0.001, 0.01, 0.05, 0.2, 0.5):
            task = asyncio.ensure_future(sandman.acquire_async(IMAGE, pool=pool, timeout=60))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                handle = await task
                await sandman.release_async(handle)  # it won the race: give it back
            except asyncio.CancelledError:
                surfaced += 1
        try:
            await sandman.acquire_async(IMAGE, pool=pool, timeout=0.001)
        except sandman.AcquireTimeout:
            surfaced += 1
        return surfaced
    trial.surfaced = asyncio.run(run())
    started = time.monotonic()
    trial.reclaim_s = until(lambda: leased(pool) == 0)
    trial.ok = trial.reclaim_s is not None
    trial.detail = "6 cancelled acquires, 1 timed out; %.1f s to no lease" % (
        time.monotonic() - started)
    return finish(pool, trial)


def pool_killed_mid_burst(trial: Trial) -> Trial:
    """The PoolActor is killed (and restarted by Ray) while 6 acquires are in flight:
    each acquire asks the restarted pool again, so all 6 are served."""
    pool = new_pool()

    async def run():
        tasks = [asyncio.ensure_future(sandman.acquire_async(IMAGE, pool=pool, timeout=60))
                 for _ in range(6)]
        await asyncio.sleep(0.3)
        ray.kill(sandman.get_pool(pool), no_restart=False)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        working = 0
        for result in results:
            if isinstance(result, BaseException):
                continue
            if (await result.exec.remote("true")).exit_code == 0:
                working += 1
            await sandman.release_async(result)
        errors = [r for r in results if isinstance(r, BaseException)]
        return working, errors
    working, errors = asyncio.run(run())
    trial.surfaced = len(errors)
    trial.reclaim_s = until(lambda: leased(pool) == 0)
    trial.ok = working == 6 and trial.reclaim_s is not None
    trial.detail = "%d acquires served, %d failed%s" % (
        working, len(errors), ": %s" % str(errors[0]).splitlines()[0][:300] if errors else "")
    return finish(pool, trial)


def agent_killed(trial: Trial) -> Trial:
    """The node agent dies under 2 leased sandboxes: their holders get SandboxLost and
    the pool brings its warm capacity back."""
    pool = new_pool(warm={IMAGE: 2})
    handles = [sandman.acquire(IMAGE, pool=pool, timeout=120) for _ in range(2)]
    node = ray.get(handles[0].node_id.remote())
    sandbox_ids = [ray.get(h.sandbox_id.remote()) for h in handles]
    ray.kill(ray.get_actor(agent_name(pool, node, "agent"), namespace="sandman"))
    started = time.monotonic()
    # ray.kill returns at once; the sandboxes die with the agent's process
    until(lambda: not any(sandbox_pids(sid) for sid in sandbox_ids), timeout=10)
    for handle in handles:
        try:
            ray.get(handle.exec.remote("true"))
        except SandboxLost:
            trial.surfaced += 1
        sandman.release(handle)
    trial.reclaim_s = until(lambda: status(pool)["states"]["ready"] >= 2 and leased(pool) == 0)
    trial.ok = trial.surfaced == 2 and trial.reclaim_s is not None
    trial.detail = "SandboxLost x%d; warm set back after %.1f s" % (
        trial.surfaced, time.monotonic() - started)
    return finish(pool, trial)


def daemon_killed(trial: Trial) -> Trial:
    """The daemon inside a leased sandbox is SIGKILLed from the host."""
    pool = new_pool()
    handle = sandman.acquire(IMAGE, pool=pool, timeout=120)
    sandbox_id = ray.get(handle.sandbox_id.remote())
    pids = sandbox_pids(sandbox_id)
    daemon = [pid for pid in pids[1:] if b"sandmand" in _cmdline(pid)]
    if not daemon:
        trial.detail = "no daemon process found for %s" % sandbox_id
        sandman.release(handle)
        return finish(pool, trial)
    os.kill(daemon[0], signal.SIGKILL)
    started = time.monotonic()
    try:
        ray.get(handle.exec.remote("true"))
    except SandboxLost:
        trial.surfaced += 1
    sandman.release(handle)
    trial.reclaim_s = until(lambda: leased(pool) == 0)
    again = sandman.acquire(IMAGE, pool=pool, timeout=120)  # the pool still serves
    works = ray.get(again.exec.remote("true")).exit_code == 0
    sandman.release(again)
    trial.ok = trial.surfaced == 1 and works and trial.reclaim_s is not None
    trial.detail = "SandboxLost surfaced; the next acquire works (%.1f s)" % (
        time.monotonic() - started)
    return finish(pool, trial)


def term_ignoring_tree(trial: Trial) -> Trial:
    """A command whose whole tree ignores SIGTERM runs past its timeout."""
    pool = new_pool()
    handle = sandman.acquire(IMAGE, pool=pool, timeout=120)
    marker = "sleep %d.%d" % (300 + os.getpid() % 100, time.time_ns() % 1000)
    cmd = "trap '' TERM; (trap '' TERM; %s) & (trap '' TERM; %s) & %s" % ((marker,) * 3)
    result = ray.get(handle.exec.remote(cmd, timeout=1.0, kill_grace_s=0.5))
    listing = ray.get(handle.exec.remote(
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done")).text
    left = [line for line in listing.splitlines() if marker in line]
    sandman.release(handle)
    trial.surfaced = int(result.timed_out)
    trial.ok = result.timed_out and not left
    trial.detail = "timed out=%s, %d of its processes left" % (result.timed_out, len(left))
    return finish(pool, trial)


def node_removed(trial: Trial) -> Trial:
    """A Ray worker node with leased and warm sandboxes on it is removed: the holders
    of its sandboxes get SandboxLost, and the pool brings its warm capacity back on the
    node that is left."""
    node = CLUSTER.add_node(num_cpus=1)
    CLUSTER.wait_for_nodes()
    pool = new_pool(warm={IMAGE: 2})
    handles = [sandman.acquire(IMAGE, pool=pool, timeout=120, node=sandman.ANYWHERE)
               for _ in range(4)]  # spread over both nodes, not on the driver's
    placed = ray.get([h.node_id.remote() for h in handles])
    doomed = [h for h, n in zip(handles, placed) if n == node.node_id]
    kept = [h for h, n in zip(handles, placed) if n != node.node_id]
    if not doomed:
        trial.detail = "no sandbox was placed on the added node"
        for handle in handles:
            sandman.release(handle)
        CLUSTER.remove_node(node)
        return finish(pool, trial)
    CLUSTER.remove_node(node, allow_graceful=False)
    started = time.monotonic()

    async def lost(handle) -> Optional[float]:
        while time.monotonic() - started < RECLAIM_TIMEOUT_S:
            try:
                await handle.exec.remote("true")  # the old process may answer at first
            except SandboxLost:
                return time.monotonic() - started
            await asyncio.sleep(0.1)
        return None

    async def run():
        return await asyncio.gather(*(lost(h) for h in doomed))
    seen = asyncio.run(run())
    trial.surfaced = sum(t is not None for t in seen)
    for handle in doomed + kept:
        sandman.release(handle)
    if until(lambda: ready_on_alive_nodes(pool) >= 2 and leased(pool) == 0):
        trial.reclaim_s = time.monotonic() - started  # from the removal
    working = sandman.acquire(IMAGE, pool=pool, timeout=60)
    works = ray.get(working.exec.remote("true")).exit_code == 0
    sandman.release(working)
    trial.ok = trial.surfaced == len(doomed) and works and trial.reclaim_s is not None
    trial.detail = "%d of %d on the node: SandboxLost after %s s; warm set back" % (
        trial.surfaced, len(doomed), "/".join("-" if t is None else "%.1f" % t for t in seen))
    return finish(pool, trial)


def provider_faults(trial: Trial) -> Trial:
    """The provider throttles the first 10 creates and fails 30 % of the rest: 8
    concurrent acquires must all be served, slower."""
    inner = LocalProvider(state_root=STATE, cache_root=CACHE)
    pool = new_pool(provider=FaultyProvider(inner, throttle_first=10, fail_rate=0.3,
                                            seed=int(time.time())))

    async def run():
        return await asyncio.gather(*(sandman.acquire_async(IMAGE, pool=pool, timeout=120)
                                      for _ in range(8)), return_exceptions=True)
    started = time.monotonic()
    results = asyncio.run(run())
    served = [r for r in results if not isinstance(r, BaseException)]
    trial.surfaced = len(results) - len(served)
    for handle in served:
        sandman.release(handle)
    stats = status(pool)["stats"]
    trial.ok = len(served) == 8 and stats["throttled"] >= 1
    trial.detail = "8 served in %.1f s through %d throttles and %d create failures" % (
        time.monotonic() - started, stats["throttled"], stats["create_failures"])
    return finish(pool, trial)


SCENARIOS: Dict[str, Callable[[Trial], Trial]] = {
    "driver_sigkill": driver_sigkill, "worker_killed": worker_killed,
    "handle_dropped": handle_dropped, "acquire_cancelled": acquire_cancelled,
    "pool_killed": pool_killed_mid_burst, "agent_killed": agent_killed,
    "daemon_killed": daemon_killed, "term_ignoring_tree": term_ignoring_tree,
    "provider_faults": provider_faults, "node_removed": node_removed,
}


# ---------------------------------------------------------------------- the run
def p99(values: List[float]) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated, from: %s" % ", ".join(SCENARIOS))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or args.trials < 1:
        parser.error("unknown scenarios %s (known: %s)" % (unknown, ", ".join(SCENARIOS))
                     if unknown else "--trials must be at least 1")
    global CLUSTER  # a head node here; node_removed adds worker nodes and removes them
    CLUSTER = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=CLUSTER.address, log_to_driver=False, namespace="sandman-chaos")
    trials: List[Trial] = []
    try:
        with progress.bar(len(names) * args.trials, "chaos", unit="trial") as shown:
            for name in names:
                shown.set_description("chaos: " + name)
                for index in range(args.trials):
                    trial = Trial(name)
                    try:
                        SCENARIOS[name](trial)
                    except Exception as exc:  # a scenario that breaks is a failed trial
                        trial.ok = False
                        trial.detail = "%s: %s" % (type(exc).__name__, exc)
                    trials.append(trial)
                    shown.write("%-20s #%-3d %-4s reclaim %-7s leaked %d  %s%s" % (
                        name, index + 1, "ok" if trial.ok else "FAIL",
                        "-" if trial.reclaim_s is None else "%.2fs" % trial.reclaim_s,
                        trial.leaked, trial.detail,
                        "  (" + "; ".join(trial.notes) + ")" if trial.notes else ""),
                        file=sys.stdout)
                    sys.stdout.flush()
                    shown.update()
    finally:
        ray.shutdown()
        CLUSTER.shutdown()
    rows = []
    print("\n%-20s %6s %6s %7s %12s %12s %9s" % ("scenario", "trials", "passed", "leaked",
                                                  "reclaim max", "reclaim p99", "surfaced"))
    for name in names:
        mine = [t for t in trials if t.scenario == name]
        reclaims = [t.reclaim_s for t in mine if t.reclaim_s is not None]
        row = {"scenario": name, "trials": len(mine), "passed": sum(t.ok for t in mine),
               "leaked": sum(t.leaked for t in mine),
               "reclaim_max_s": max(reclaims) if reclaims else None,
               "reclaim_p99_s": p99(reclaims), "surfaced": sum(t.surfaced for t in mine)}
        rows.append(row)
        print("%-20s %6d %6d %7d %12s %12s %9d" % (
            name, row["trials"], row["passed"], row["leaked"],
            "-" if row["reclaim_max_s"] is None else "%.2f s" % row["reclaim_max_s"],
            "-" if row["reclaim_p99_s"] is None else "%.2f s" % row["reclaim_p99_s"],
            row["surfaced"]))
    passed = all(t.ok for t in trials)
    print(json.dumps({"bench": "chaos", "machine": {"cpus": os.cpu_count(),
                                                    "kernel": platform.release()},
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "passed": passed,
                      "scenarios": rows, "failures": [asdict(t) for t in trials if not t.ok]}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
