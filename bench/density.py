"""How many leased sandboxes one node holds, and what each costs, running and paused.

    python bench/density.py [--ns 100,250,500,1000] [--samples 100] [--exec-samples 1000]
                            [--paused 20]
    python bench/density.py --floors

On a local Ray with the LocalProvider and ``builtin:debian``, one pool leases N
sandboxes to this driver, each with a live shell session (``run``) and a sleeping
background process (``spawn``), growing N step by step. At each N: the acquires of
the step (p50, p99), ``exec true`` on random sandboxes directly and through
``.remote()``, pause and resume of random sandboxes (the handle's ``pause()`` /
``resume()``), PSS per sandbox running (every process of every sandbox, from the
host's /proc) and paused (``pause(reclaim=True)`` on ``--paused`` of them, then
resumed: their first call is timed, and later steps pick among the others), the node's
available memory, and the threads and open files of the pool's actor, the node agent
and the handle host. Where a step cannot be reached, the run says at which N and why,
and stops there. Prints a table and a JSON line; writes bench/results/density.json.
Last, beside the idle handle host, the floors of any actor here: bare actors and a
plain ``import ray`` (``--floors`` measures only those).
(``make bench`` runs it as its density section: ``density``, ``rows``.)
"""

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, ROOT, cpu_ticks, pct  # noqa: E402  (bench/common.py)
from local import pss_of as pss_kb  # noqa: E402  (bench/local.py)

import sandman_ray as sandman  # noqa: E402
from sandman_ray.providers.local import LocalProvider, leftovers  # noqa: E402
from sandman_ray.spec import DEFAULT_IMAGE  # noqa: E402

STATE = "/tmp/sandman-ray/bench-density"
RESULTS = ROOT / "bench" / "results" / "density.json"
FLOORS = ROOT / "bench" / "results" / "density-floors.json"
GROW_AT_ONCE = 25  # acquires in flight while a step grows


def sandbox_pids(pool: str, sandbox_id: str) -> List[int]:
    """The processes in one sandbox's cgroups, read from the host's cgroup files."""
    pids = set()
    for procs in glob.glob("/sys/fs/cgroup/*/sandman/%s-*/%s/cgroup.procs" % (pool, sandbox_id)) + \
            glob.glob("/sys/fs/cgroup/sandman/%s-*/%s/cgroup.procs" % (pool, sandbox_id)):
        with open(procs) as fh:
            pids.update(int(line) for line in fh if line.strip())
    return sorted(pids)


def threads_and_fds(pid: int) -> Dict[str, int]:
    with open("/proc/%d/status" % pid) as fh:
        threads = next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))
    return {"threads": threads, "fds": len(os.listdir("/proc/%d/fd" % pid))}


def actor_pids(pool: str, sb) -> Dict[str, int]:
    """The pids of the pool's actor, the node agent and this driver's handle host (the
    one holding ``sb``)."""
    from sandman_ray.providers.nodes import NAMESPACE, agent_name
    pid = lambda actor: ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))  # noqa: E731
    node = ray.get_runtime_context().get_node_id()
    return {"pool": ray.get(sandman.get_pool(pool).status.remote())["pid"],
            "agent": pid(ray.get_actor(agent_name(pool, node), namespace=NAMESPACE)),
            "host": pid(sb._host)}


@contextlib.contextmanager
def swap_file(gb: int):
    """A swap file of ``gb`` GiB for the run, where the node has no swap (reclaim can
    push a paused sandbox's anonymous memory only into swap); removed after."""
    with open("/proc/swaps") as fh:
        has_swap = len(fh.read().splitlines()) > 1
    if has_swap or gb <= 0:
        yield None
        return
    path = "/var/tmp/sandman-bench-density.swap"
    subprocess.run(["fallocate", "-l", "%dG" % gb, path], check=True)
    os.chmod(path, 0o600)
    try:
        subprocess.run(["mkswap", path], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["swapon", path], check=True)
        try:
            yield path
        finally:
            subprocess.run(["swapoff", path], check=True)
    finally:
        os.unlink(path)


class _Bare:
    """A Ray actor that does nothing: the floor of any actor's memory on this node."""

    def pid(self) -> int:
        return os.getpid()


class _BareLean(_Bare):
    """A bare actor that skips Ray's serializers of other libraries' types, as a handle
    host does (sandman_ray.host): the floor of a host's memory."""

    def __init__(self):
        from sandman_ray.host import _without_foreign_serializers
        _without_foreign_serializers()


class _BareLeanHostModules(_BareLean):
    """A lean bare actor that has imported the handle host's modules (sandman_ray.host
    and what it imports) and holds nothing: what a host costs before its first lease."""

    def __init__(self):
        super().__init__()
        import sandman_ray.host  # noqa: F401


def memory_of(pid: int) -> dict:
    """Threads, fds, PSS and anonymous memory (private or copied on write: what no other
    process shares) of ``pid``."""
    return dict(threads_and_fds(pid), pss_mb=pss_kb([pid]) / 1024,
                anon_mb=pss_kb([pid], "Anonymous") / 1024)


def bare_actor() -> dict:
    """The memory of a bare actor, of one that skips other libraries' serializers as a
    handle host does, of that one with the host's modules imported, and of a threaded
    one of the handle host's earlier shape (threads for calls and a control group),
    each idle after 1,000 calls (an actor's memory grows with its first calls)."""
    out = {}
    for name, actor_class in (
            ("bare", ray.remote(num_cpus=0)(_Bare)),
            ("bare, without other libraries' serializers", ray.remote(num_cpus=0)(_BareLean)),
            ("bare, lean, the host's modules imported",
             ray.remote(num_cpus=0)(_BareLeanHostModules)),
            ("threaded, 192 + 64", ray.remote(num_cpus=0, max_concurrency=192,
                                              concurrency_groups={"control": 64})(_Bare))):
        actor = actor_class.remote()
        for _ in range(1000):
            pid = ray.get(actor.pid.remote())
        out[name] = memory_of(pid)
        ray.kill(actor)
    return out


def import_floor() -> dict:
    """The memory of a plain Python process (this interpreter, no Ray connection) that
    has only run ``import ray``: what every Ray worker process carries before it does
    anything, and so the least a handle host can cost while it is a Ray actor."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, ray; sys.stdout.write('ready\\n'); "
         "sys.stdout.flush(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the import ray process exited with %s" % child.wait())
        return memory_of(child.pid)
    finally:
        child.stdin.close()
        child.wait()


def floors() -> dict:
    """What any Ray actor costs here, beside which the handle host's memory reads."""
    return {"bare_actor": bare_actor(), "import_ray": import_floor()}


def available_mb() -> float:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) for line in fh
                    if line.startswith("MemAvailable:")) / 1024


async def grow(pool: str, held: list, n: int) -> List[float]:
    """Acquire until ``held`` has ``n`` sandboxes, each with a session and a sleeper;
    the time of each acquire."""
    times = []

    async def one():
        start = time.perf_counter()
        sb = await sandman.acquire_async(DEFAULT_IMAGE, pool=pool, timeout=300)
        times.append(time.perf_counter() - start)
        await sb.run_async("cd /tmp")
        await sb.spawn_async("sleep 1000000")
        await sb.exec.remote("true")  # its host's connection is open too, as a user's is
        held.append(sb)
    while len(held) < n:
        await asyncio.gather(*(one() for _ in range(min(GROW_AT_ONCE, n - len(held)))))
    return times


def timed(fn, rounds: int) -> List[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def busy_cores(seconds: float = 2.0) -> float:
    """The node's CPU in use over ``seconds`` (cores busy), nothing else asked of it."""
    start = cpu_ticks()
    time.sleep(seconds)  # the window measured
    return (cpu_ticks() - start) / os.sysconf("SC_CLK_TCK") / seconds


def measure(pool: str, held: list, samples: int, exec_samples: int, paused: int, rng,
            loop, reclaimed: set) -> dict:
    """One step's figures. The sandboxes of ``reclaimed`` (lease ids) were paused with
    reclaim at an earlier step, and their memory is in swap: the random picks leave
    them out (their first call after the resume is timed on its own, once)."""
    awake = [sb for sb in held if sb.lease_id not in reclaimed]
    pick = lambda: rng.choice(awake)  # noqa: E731
    idle = busy_cores()  # N leased sandboxes idle, their shells and sleepers waiting
    # direct: on the event loop whose connection each sandbox already has; beside it,
    # one sandbox again and again (what a random one adds: its daemon's memory and
    # connection cold in the caches), and .remote(); the three interleaved at random,
    # so that a slow stretch of the machine falls on each alike
    one = awake[0]
    ways = {"direct": lambda: loop.run_until_complete(pick().exec_async("true")),
            "same": lambda: loop.run_until_complete(one.exec_async("true")),
            "remote": lambda: ray.get(pick().exec.remote("true"))}
    order = [way for way in ways for _ in range(exec_samples if way != "same"
                                                 else exec_samples // 4)]
    rng.shuffle(order)
    took: Dict[str, List[float]] = {way: [] for way in ways}
    for way in order:
        took[way] += timed(ways[way], 1)
    direct, same, remote = took["direct"], took["same"], took["remote"]
    pauses, resumes = [], []
    for sb in rng.sample(awake, min(samples, len(awake))):
        pauses += timed(sb.pause, 1)
        resumes += timed(sb.resume, 1)
    sandboxed = leftovers(pool, STATE)["processes"]
    running_kb = pss_kb(sandboxed) / len(held)
    chosen = rng.sample(awake, min(paused, len(awake)))
    for sb in chosen:
        sb.pause(reclaim=True)
    paused_kb = sum(pss_kb(sandbox_pids(pool, sb.sandbox)) for sb in chosen) / len(chosen)
    for sb in chosen:
        sb.resume()
    # the first call after a resume from reclaim: the daemon's pages come back from swap
    after_reclaim = [timed(lambda: loop.run_until_complete(sb.exec_async("true")), 1)[0]
                     for sb in chosen]
    reclaimed.update(sb.lease_id for sb in chosen)
    status = timed(lambda: ray.get(sandman.get_pool(pool).status.remote()), 20)
    loop_ms = ray.get(sandman.get_pool(pool).status.remote())["loop_ms"]
    pids = actor_pids(pool, held[0])
    procs = {role: memory_of(pid) for role, pid in pids.items()}
    ms = lambda values, q: pct(values, q) * 1e3  # noqa: E731
    return {"exec_direct_p50_ms": ms(direct, 0.5), "exec_direct_p99_ms": ms(direct, 0.99),
            "exec_same_p50_ms": ms(same, 0.5), "exec_same_p99_ms": ms(same, 0.99),
            "exec_remote_p50_ms": ms(remote, 0.5), "exec_remote_p99_ms": ms(remote, 0.99),
            "pause_p50_ms": ms(pauses, 0.5), "pause_p99_ms": ms(pauses, 0.99),
            "resume_p50_ms": ms(resumes, 0.5), "resume_p99_ms": ms(resumes, 0.99),
            "pss_mb_per_sandbox_running": running_kb / 1024,
            "pss_mb_per_sandbox_paused": paused_kb / 1024, "paused_sampled": len(chosen),
            "exec_after_reclaim_p50_ms": ms(after_reclaim, 0.5),
            "exec_after_reclaim_max_ms": max(after_reclaim) * 1e3,
            "sandbox_processes": len(sandboxed), "available_mb": available_mb(),
            "idle_busy_cores": idle,
            "pool_status_p50_ms": ms(status, 0.5), "pool_loop_ms": loop_ms,
            "processes": procs}


def parse_ns(text: str) -> List[int]:
    ns = sorted({int(n) for n in text.split(",") if n.strip()})
    if not ns or ns[0] < 1:
        raise ValueError("the numbers of sandboxes must be whole numbers >= 1, not %r" % text)
    return ns


def density(ns: List[int], samples: int = 100, exec_samples: int = 2000, paused: int = 20,
            swap_gb: int = 4) -> dict:
    """The steps, on this process's Ray: a pool of its own, shut down after; raises
    unless it left nothing."""
    pool = "bench-density-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=LocalProvider(state_root=STATE, cache_root=CACHE),
                        max_sandboxes=max(ns))
    out = {"bench": "density", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "args": {"ns": ns, "samples": samples, "exec_samples": exec_samples,
                    "paused": paused, "swap_gb": swap_gb}, "steps": {}, "stopped": None}
    with swap_file(swap_gb) as swap:
        out["swap_file"] = swap
        try:
            grow_and_measure(pool, ns, samples, exec_samples, paused, out)
        finally:
            sandman.shutdown_pool(pool)
    out["left_after_shutdown"] = {k: len(v) for k, v in leftovers(pool, STATE).items()}
    out["summary"] = summary(out)
    if any(out["left_after_shutdown"].values()):
        raise RuntimeError("density: the pool left %s" % out["left_after_shutdown"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", default="100,250,500,1000")
    parser.add_argument("--samples", type=int, default=100, help="pauses and resumes per N")
    parser.add_argument("--exec-samples", type=int, default=2000,
                        help="execs per N, each way (a p99 of 100 is the second largest)")
    parser.add_argument("--paused", type=int, default=20)
    parser.add_argument("--swap-gb", type=int, default=4,
                        help="a swap file for the run where the node has none (0: none)")
    parser.add_argument("--floors", action="store_true",
                        help="only the floors of any actor here (bare actors, import ray), "
                        "in a minute; written to bench/results/density-floors.json")
    args = parser.parse_args(argv)
    try:
        ns = parse_ns(args.ns)
    except ValueError as exc:
        parser.error(str(exc))
    ray.init(num_cpus=2, namespace="sandman-bench", include_dashboard=False,
             log_to_driver=False)
    if args.floors:
        out = floors()
        for row in floor_rows(out):
            print("%-90s %8s  %s" % row[1:])
        print(json.dumps(out))
        FLOORS.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    out = density(ns, args.samples, args.exec_samples, args.paused, args.swap_gb)
    if out["stopped"]:
        print("stopped at N=%(n)d with %(held)d held: %(error)s" % out["stopped"])
    print_table(out)
    print(json.dumps(out))
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def grow_and_measure(pool: str, ns: List[int], samples: int, exec_samples: int, paused: int,
                     out: dict) -> None:
    """Grow the leases step by step, measuring at each N; then release them all and
    read the handle host idle."""
    held, rng, reclaimed = [], random.Random(1), set()
    loop = asyncio.new_event_loop()  # one loop: its direct connections serve every step
    try:
        for n in ns:
            try:
                acquires = loop.run_until_complete(grow(pool, held, n))
            except Exception as exc:  # noqa: BLE001 - where the node stops, and why
                out["stopped"] = {"n": n, "held": len(held), "available_mb": available_mb(),
                                  "error": "%s: %s" % (type(exc).__name__, str(exc)[:500])}
                break
            step = measure(pool, held, samples, exec_samples, paused, rng, loop, reclaimed)
            step.update(acquire_p50_ms=pct(acquires, 0.5) * 1e3,
                        acquire_p99_ms=pct(acquires, 0.99) * 1e3, acquires=len(acquires),
                        held=len(held))
            out["steps"][n] = step
            print_step(n, step)
        host = actor_pids(pool, held[0])["host"] if held else None
        for sb in held:
            sandman.release(sb)
        held.clear()
        if host is not None:
            out["host_idle"] = memory_of(host)
            out.update(floors())
    finally:
        for sb in held:
            try:
                sandman.release(sb)
            except Exception:  # noqa: BLE001 - the shutdown deletes it all the same
                pass
        loop.close()


def print_step(n: int, s: dict) -> None:
    print("N=%d: acquire %.1f / %.1f ms, exec direct %.2f / %.2f ms (the same sandbox %.2f / "
          "%.2f ms), .remote() %.2f / %.2f ms, pause %.1f / %.1f ms, resume %.1f / %.1f ms (p50 / p99); PSS per sandbox "
          "%.2f MB running, %.2f MB paused; available %.0f MB; idle %.2f cores; pool status "
          "%.1f ms; %s"
          % (n, s["acquire_p50_ms"], s["acquire_p99_ms"], s["exec_direct_p50_ms"],
             s["exec_direct_p99_ms"], s["exec_same_p50_ms"], s["exec_same_p99_ms"],
             s["exec_remote_p50_ms"], s["exec_remote_p99_ms"],
             s["pause_p50_ms"], s["pause_p99_ms"], s["resume_p50_ms"], s["resume_p99_ms"],
             s["pss_mb_per_sandbox_running"], s["pss_mb_per_sandbox_paused"],
             s["available_mb"], s["idle_busy_cores"], s["pool_status_p50_ms"],
             ", ".join("%s %.0f MB %d threads %d fds" % (k, v["pss_mb"], v["threads"], v["fds"])
                       for k, v in sorted(s["processes"].items()))), flush=True)


def summary(out: dict) -> dict:
    """What the steps add up to: the largest N held, the ratios of its p99s to those of
    the smallest N, pauses at the N nearest 500, and the handle host per held lease
    (its PSS at the largest N less that at the smallest, over the leases between)."""
    steps = {int(n): s for n, s in out["steps"].items()}
    if not steps:
        return {}
    low, high = min(steps), max(steps)
    mid = min(steps, key=lambda n: abs(n - 500))
    a, b = steps[low], steps[high]
    host = lambda s: s["processes"]["host"]["pss_mb"]  # noqa: E731
    return {"largest_n": high, "smallest_n": low, "pause_at_n": mid,
            "pause_p50_ms": steps[mid]["pause_p50_ms"], "pause_p99_ms": steps[mid]["pause_p99_ms"],
            "resume_p50_ms": steps[mid]["resume_p50_ms"],
            "resume_p99_ms": steps[mid]["resume_p99_ms"],
            "acquire_p99_ratio": b["acquire_p99_ms"] / a["acquire_p99_ms"],
            "exec_direct_p99_ratio": b["exec_direct_p99_ms"] / a["exec_direct_p99_ms"],
            "exec_remote_p99_ratio": b["exec_remote_p99_ms"] / a["exec_remote_p99_ms"],
            "pss_mb_per_paused_sandbox": b["pss_mb_per_sandbox_paused"],
            "host_kb_per_lease": (host(b) - host(a)) * 1024 / max(high - low, 1),
            "host_threads_at_largest_n": b["processes"]["host"]["threads"]}


def print_table(out: dict) -> None:
    rows = [("N", "acquire p50/p99", "exec direct", "exec .remote()", "pause", "resume",
             "PSS run/paused MB", "free MB", "idle cores", "tick p50/p99", "host MB/thr/fds",
             "agent MB/fds")]
    for n, s in sorted(out["steps"].items(), key=lambda kv: int(kv[0])):
        tick = s["pool_loop_ms"].get("tick", {})
        host, agent = s["processes"]["host"], s["processes"]["agent"]
        pair = lambda key: "%.1f / %.1f" % (s[key + "_p50_ms"], s[key + "_p99_ms"])  # noqa: E731
        rows.append((str(n), pair("acquire"), pair("exec_direct"), pair("exec_remote"),
                     pair("pause"), pair("resume"), "%.2f / %.2f" % (
                         s["pss_mb_per_sandbox_running"], s["pss_mb_per_sandbox_paused"]),
                     "%.0f" % s["available_mb"], "%.2f" % s["idle_busy_cores"], "%.2f / %.1f" % (
                         tick.get("p50_ms", float("nan")), tick.get("p99_ms", float("nan"))),
                     "%.0f / %d / %d" % (host["pss_mb"], host["threads"], host["fds"]),
                     "%.0f / %d" % (agent["pss_mb"], agent["fds"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for key, value in out.get("summary", {}).items():
        print("%-28s %s" % (key, "%.2f" % value if isinstance(value, float) else value))


def rows(out: dict) -> List[tuple]:
    """The density section's lines of ``make bench``'s table."""
    rows = []
    for n, s in sorted(out["steps"].items(), key=lambda kv: int(kv[0])):
        procs = s["processes"]
        pair = lambda key, unit="ms": "%.1f / %.1f %s" % (  # noqa: E731
            s[key[0] + "_p50_ms"], s[key[1] + "_p50_ms"], unit)
        p99 = lambda key: "p99 %.1f / %.1f ms" % (s[key[0] + "_p99_ms"],  # noqa: E731
                                                 s[key[1] + "_p99_ms"])
        rows += [("density", "N=%s held: exec true direct / .remote()" % n,
                  pair(("exec_direct", "exec_remote")), p99(("exec_direct", "exec_remote"))),
                 ("density", "N=%s: exec true direct, a random sandbox / the same one" % n,
                  pair(("exec_direct", "exec_same")), p99(("exec_direct", "exec_same"))),
                 ("density", "N=%s: pause / resume" % n, pair(("pause", "resume")),
                  p99(("pause", "resume"))),
                 ("density", "N=%s: acquire (%d at a time)" % (n, GROW_AT_ONCE),
                  "%.0f ms" % s["acquire_p50_ms"], "p99 %.0f ms" % s["acquire_p99_ms"]),
                 ("density", "N=%s: first exec after a resume from reclaim" % n,
                  "%.1f ms" % s["exec_after_reclaim_p50_ms"],
                  "max %.1f ms (its pages back from swap)" % s["exec_after_reclaim_max_ms"]),
                 ("density", "N=%s: PSS per sandbox running / paused (reclaim)" % n,
                  "%.2f / %.2f MB" % (s["pss_mb_per_sandbox_running"],
                                      s["pss_mb_per_sandbox_paused"]),
                  "available %.0f MB; idle %.2f cores busy; tick p50 %.2f ms" % (
                      s["available_mb"], s["idle_busy_cores"],
                      s["pool_loop_ms"].get("tick", {}).get("p50_ms", float("nan")))),
                 ("density", "N=%s: pool / agent / host PSS" % n, "%.0f / %.0f / %.0f MB" % (
                     procs["pool"]["pss_mb"], procs["agent"]["pss_mb"], procs["host"]["pss_mb"]),
                  "threads %d / %d / %d, fds %d / %d / %d" % tuple(
                      procs[r][k] for k in ("threads", "fds") for r in ("pool", "agent", "host")))]
    if out.get("stopped"):
        rows.append(("density", "stopped at N=%(n)d with %(held)d held" % out["stopped"], "",
                     out["stopped"]["error"][:120]))
    s = out.get("summary", {})
    if s:
        rows += [("density", "largest N / smallest: acquire p99, exec direct p99, .remote() p99",
                  "%.2fx / %.2fx / %.2fx" % (s["acquire_p99_ratio"], s["exec_direct_p99_ratio"],
                                             s["exec_remote_p99_ratio"]),
                  "N=%d vs N=%d; target <= 2x" % (s["largest_n"], s["smallest_n"])),
                 ("density", "pause / resume at N=%d" % s["pause_at_n"], "%.1f / %.1f ms" % (
                     s["pause_p50_ms"], s["resume_p50_ms"]), "p99 %.1f / %.1f ms; target p50 "
                  "<= 5 ms, p99 <= 20 ms" % (s["pause_p99_ms"], s["resume_p99_ms"])),
                 ("density", "handle host: per held lease",
                  "%.1f kB" % s["host_kb_per_lease"], "%d threads at N=%d; target <= 20 kB" % (
                      s["host_threads_at_largest_n"], s["largest_n"]))]
    return rows + floor_rows(out)


def floor_rows(out: dict) -> list:
    """The idle handle host beside the floors of any actor (PSS; anonymous memory, the
    part no other process shares)."""
    rows = []
    if "host_idle" in out:
        rows.append(("density", "handle host idle, its leases released", "%.0f MB" %
                     out["host_idle"]["pss_mb"], "anonymous %s; %d threads, %d fds; target "
                     "<= 30 MB" % (_anon(out["host_idle"]), out["host_idle"]["threads"],
                                   out["host_idle"]["fds"])))
    for name, bare in out.get("bare_actor", {}).items():
        rows.append(("density", "a Ray actor that does nothing (%s), idle" % name,
                     "%.0f MB" % bare["pss_mb"], "anonymous %s; %d threads: the floor of any "
                     "actor here" % (_anon(bare), bare["threads"])))
    if "import_ray" in out:
        rows.append(("density", "a Python process that only ran import ray (no Ray connection)",
                     "%.0f MB" % out["import_ray"]["pss_mb"], "anonymous %s: in every Ray "
                     "worker process before its first call" % _anon(out["import_ray"])))
    return rows


def _anon(memory: dict) -> str:
    return "%.0f MB" % memory["anon_mb"] if "anon_mb" in memory else "not read"


if __name__ == "__main__":
    sys.exit(main())
