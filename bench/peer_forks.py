"""A live sandbox forked into copies, ours beside sandlock's, in one run (bench/peers.py).

  ours      ``sandman.fork(parent, n)`` of a sandbox of the busybox image at the local
            level (userns and seccomp) that holds 1 MB of files of its own, until every
            copy has answered ``exec true``
  sandlock  ``Sandbox(init_fn=..., work_fn=...).fork(n)``: its ``init_fn`` (1 MB of
            state) runs once, then ``n`` copy-on-write clones of that process each run
            ``work_fn`` and end, and ``fork`` returns once they all have

Each is timed over --rounds rounds per ``n``, the median reported. A sandlock clone is
a process that runs one function: no filesystem of its own, no command after it, no
namespaces; each copy of ours is a sandbox with its own writable layer holding the
parent's files, which takes commands until it is released.
"""

import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

from peer_gaps import less_row  # (bench/peer_gaps.py)

STATE_BYTES = 1 << 20
TRADE = ("its clones are processes that run one function and end: no filesystem of "
         "their own (the host's, behind Landlock), no command after it, no namespaces; "
         "each copy of ours is a sandbox with its own writable layer holding the "
         "parent's files, taking commands until released")


def sandlock_forks(counts: Sequence[int], rounds: int) -> Dict[str, float]:
    """n -> the median seconds of ``fork(n)``."""
    from sandlock import Sandbox
    held: List[bytes] = []
    out = {}
    for n in counts:
        times = []
        for _ in range(rounds):
            box = Sandbox(fs_readable=["/"], fs_writable=["/tmp"],
                          init_fn=lambda: held.append(os.urandom(STATE_BYTES)),
                          work_fn=lambda clone: None)
            started = time.perf_counter()
            clones = box.fork(n)
            times.append(time.perf_counter() - started)
            if len(clones) != n:
                raise RuntimeError("sandlock: fork(%d) made %d clones" % (n, len(clones)))
        out[str(n)] = statistics.median(times)
    return out


def _cpu_s(pids: List[int]) -> float:
    """CPU seconds used so far by ``pids`` (those still there)."""
    from common import process_cpu_s  # (bench/common.py)
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu_s(pid)
        except OSError:
            continue
    return total


def _pool_pids(pool: str) -> List[int]:
    """The pids of the pool's actor and of its node agents."""
    import ray
    import sandman_ray as sandman
    from soak import agent_pids  # (bench/soak.py)
    return [ray.get(sandman.get_pool(pool).status.remote())["pid"]] + agent_pids(pool)


def our_forks(counts: Sequence[int], rounds: int, rootfs: str) -> dict:
    """n -> the median seconds of ``sandman.fork(parent, n)`` until every copy answered,
    and the median CPU seconds its pool's actor and node agents spent on it (the copy
    of the parent's files, 1 MB, among it)."""
    import sandman_ray as sandman
    from sandman_ray.providers.local import LocalProvider
    from common import CACHE, states, wait_for  # (bench/common.py)
    spec = sandman.SandboxSpec(image="dir:%s" % rootfs)
    pool = "bench-peer-fork-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=LocalProvider(state_root="/tmp/sandman-ray/bench-peer-fork",
                                                     cache_root=CACHE),
                        warm={spec: 1}, max_sandboxes=2 * max(counts) + 4)
    out: Dict[str, dict] = {"s": {}, "pool_cpu_s": {}}
    try:
        with sandman.sandbox(spec, pool=pool, timeout=120) as parent, \
                ThreadPoolExecutor(max(counts)) as threads:
            parent.write_file("/tmp/state", os.urandom(STATE_BYTES))
            wait_for(lambda: states(pool).get("ready", 0) >= 1, "the pool's warm sandbox")
            before = sum(states(pool).values())  # the parent, and the warm one
            snapshots = len(sandman.snapshots(pool))
            serving = _pool_pids(pool)
            for n in counts:
                times, cpu = [], []
                for _ in range(rounds):
                    used = _cpu_s(serving)
                    started = time.perf_counter()
                    copies = sandman.fork(parent, n)
                    answers = list(threads.map(lambda sb: sb.exec("true"), copies))
                    times.append(time.perf_counter() - started)
                    cpu.append(_cpu_s(serving) - used)
                    for sb in copies:
                        sandman.release(sb)
                    if any(a.exit_code != 0 for a in answers):
                        raise RuntimeError("a fork did not answer: %r" % answers)
                    # the copies and their snapshot gone before the next round
                    wait_for(lambda: sum(states(pool).values()) <= before and
                             len(sandman.snapshots(pool)) <= snapshots, "the forks' deletes")
                out["s"][str(n)] = statistics.median(times)
                out["pool_cpu_s"][str(n)] = statistics.median(cpu)
    finally:
        sandman.shutdown_pool(pool)
    return out


def forks(counts: Sequence[int], rounds: int, rootfs: str) -> dict:
    ours = our_forks(counts, rounds, rootfs)
    return {"counts": list(counts), "rounds": rounds, "trade": TRADE,
            "sandlock_s": sandlock_forks(counts, rounds), "ours_s": ours["s"],
            "ours_pool_cpu_s": ours["pool_cpu_s"]}


def rows(s: dict, anatomy: dict, namespaces_cpu_ms: Optional[float]) -> List[tuple]:
    """Each n: theirs, ours, and ours less what their clones do without: a daemon's and
    namespaces' start in each copy, a pool and an agent (their CPU over this machine's
    cores)."""
    cores = os.cpu_count() or 1
    out = []
    for n in s["counts"]:
        theirs, ours = s["sandlock_s"][str(n)], s["ours_s"][str(n)]
        out.append(("peers", "sandlock: fork a live sandbox into %d, all done" % n,
                    "%.3f s" % theirs, "ours (sandman.fork, local) %.3f s: %.2fx theirs"
                    % (ours, ours / theirs)))
        items = [("%d daemons (their start's CPU on %d cores)" % (n, cores),
                  n * anatomy["daemon_start_cpu_ms"] / cores / 1e3)]
        if namespaces_cpu_ms:
            items.append(("%d sets of namespaces and binds (their CPU)" % n,
                          n * namespaces_cpu_ms / cores / 1e3))
        items.append(("a pool that leases each copy, and its agent (their CPU)",
                      s["ours_pool_cpu_s"][str(n)] / cores))
        if ours > theirs:
            out.append(less_row("s", ours, theirs, items))
    out.append(("peers", "sandlock's fork: against ours", "", s["trade"]))
    return out
