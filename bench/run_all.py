"""The benchmark suite: every measure side by side in one run, one table, and
``bench/results/latest.json`` with the machine's description.

    python bench/run_all.py [--n 200] [--clients 4] [--samples 1000]     (make bench)

On a local Ray with the LocalProvider:

  noop   a no-op command through the public API and the session form, beside the
         floor of our path, the least a daemon can do, the yardstick of ``.remote()``'s
         own shape, the daemon client, the direct calls and SWE-ReX's server
         (``bench/noop_section.py``).
  burst  N acquires from M client processes at once, cold (no sandbox yet) and warm (N
         ready), time to 50 % and 100 % usable (acquired and ``true`` answered, by a direct
         call: ``await sb.exec_async("true")``), with the
         median time each sandbox spent per stage: queued, created, started until it
         answered, ready until lent, lent until usable, and the PoolActor's CPU per
         sandbox (its leases, first calls and releases); for the warm burst, leases per
         second. Beside it, the same N without the pool: each client process starting its
         own sandboxes at once through the provider; and the raw provider burst: N
         created at once through the provider from one process, its node agent
         started at the first create as a provider used directly does, and again with
         the agent started before the clock (``Provider.warm_up``): the provider's own
         pace. The cold, unpooled and raw bursts take turns, in --rounds rounds, and
         each reports its median round. (A pool starts its node agents as it is
         created, and a pooled client calls ``sandman_ray.prepare`` as it starts, before
         the clock starts; the unpooled one binds its provider, whose agent starts at
         its first create.)
  cycle  one client on a warm pool, one lease cycle after another: acquire, a first
         ``exec true`` (a direct call; every other cycle through the host instead), the
         next call on the same path (a steady one: the first call's ratio to it),
         release, and the whole cycle, p50 and p99, also in bare actor calls (timed back
         to back, in rounds between the rounds of cycles), and the PoolActor's CPU per
         cycle.
  reuse  E episodes on K sandboxes (K at a time; an episode runs one command):
         release and acquire again (a reset) versus a new sandbox per episode.
  stream MB/s of ``cat`` of a 100 MB file through ``sb.exec_stream``, directly and
         through ``.remote()``, and the daemon's RSS growth while a reader stops.
  fork   a sandbox with 50 MB of new files forked into 8, until all answer with the
         files intact, beside 8 fresh sandboxes that copy the files in (bench/forks.py).
  cost   memory (PSS) per idle sandbox and per handle host actor; CPU per create.
  isolation  what each isolation level costs, one after the other in this run
         (``bench/isolation.py``): create -> first exec (one at a time) and
         ``exec true`` through the daemon client, for the LocalProvider with root inside
         as host root and no network namespace (how sandboxes ran before user
         namespaces: the figures of before), with a user namespace (the default), with a
         network namespace too (``network=True``), under gVisor, and Podman with runc
         (a user namespace per container), with the ratios to the figures of before;
         with ``--isolation-against REF`` (make bench: the commit before the system
         call policy), REF's code measured in turns beside this checkout's.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import ray

import sandman_ray as sandman
from sandman_ray import AsyncDaemonClient, ExecResult
from sandman_ray.image_builders import build_busybox_rootfs
from sandman_ray.spec import SandboxSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forks  # noqa: E402  (bench/forks.py)
import progress  # noqa: E402  (bench/progress.py)
import isolation  # noqa: E402  (bench/isolation.py)
from local import create_and_exec, pss_kb  # noqa: E402

from common import CACHE, ROOT, STATE, pct, provider  # noqa: E402  (bench/common.py)
from noop_section import Bare, noop, noop_rows  # noqa: E402  (bench/noop_section.py)

RESULTS = ROOT / "bench" / "results" / "latest.json"


# ---------------------------------------------------------------------- burst
POOLED_CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    n = int(sys.argv[4])
    sandman.prepare(sys.argv[2])  # as a rollout worker starts: its pool and handle host
    print("go", flush=True)
    start = float(sys.stdin.readline())   # a shared wall-clock start
    async def one():
        h = await sandman.acquire_async(sys.argv[3], pool=sys.argv[2], timeout=600)
        r = await h.exec_async("true")  # a direct call, as the unpooled client's
        assert r.exit_code == 0
        return time.time(), h
    async def main():
        while time.time() < start:
            await asyncio.sleep(0.001)
        return await asyncio.gather(*[one() for _ in range(n)])
    results = asyncio.run(main())
    print("usable " + json.dumps([[t, h.sandbox] for t, h in results]), flush=True)
    sys.stdin.readline()
    for _, h in results:
        sandman.release(h)
""")
UNPOOLED_CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, ray
    sys.path.insert(0, "bench")
    from local import create_and_exec
        from sandman_ray.spec import SandboxSpec
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    n = int(sys.argv[4])
    provider = LocalProvider(state_root=%r, cache_root=%r).bind(sys.argv[2])
    spec = SandboxSpec(image=sys.argv[3])
    print("go", flush=True)
    start = float(sys.stdin.readline())
    async def one():
        sandbox_id, _, _ = await create_and_exec(provider, spec)
        return time.time(), sandbox_id
    async def main():
        while time.time() < start:
            await asyncio.sleep(0.001)
        return await asyncio.gather(*[one() for _ in range(n)])
    results = asyncio.run(main())
    print("usable " + json.dumps(results), flush=True)
    sys.stdin.readline()
    asyncio.run(provider.shutdown())
""") % (STATE, CACHE)


def clients_burst(script: str, address: str, target: str, image: str, n: int,
                  clients: int) -> tuple:
    """Start ``clients`` processes, let them go at one wall-clock moment, and return
    (start, [(usable wall time, sandbox id)])."""
    procs = [subprocess.Popen([sys.executable, "-c", script, address, target, image,
                               str(n // clients + (1 if i < n % clients else 0))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=str(ROOT)) for i in range(clients)]
    try:
        for p in procs:
            while True:
                line = p.stdout.readline()
                if not line:
                    raise SystemExit("burst: a client process exited before it was ready")
                if line.strip() == "go":
                    break
        start = time.time() + 0.5
        for p in procs:
            p.stdin.write("%f\n" % start)
            p.stdin.flush()
        usable = []
        for p in procs:
            for line in p.stdout:
                if line.startswith("usable "):
                    usable += [tuple(u) for u in json.loads(line[7:])]
                    break
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(300)
        if len(usable) != n:
            raise SystemExit("burst: %d of %d sandboxes usable" % (len(usable), n))
        return start, usable
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


# "started": when the provider started the sandbox (its SandboxInfo.created_at); from
# there to "ready" its daemon came up and answered
STAGES = (("queued", "requested", "creating"), ("created", "creating", "started"),
          ("started", "started", "ready"), ("ready -> lent", "ready", "leased"))


def stages(pool: str, start: float, usable: List[tuple]) -> Dict[str, float]:
    """Median seconds per stage over the burst's sandboxes, from the pool's events; a
    stage counts only from the burst's start (a warm sandbox was ready before it)."""
    seen: Dict[str, Dict[str, float]] = {}
    for when, sandbox_id, state, _ in ray.get(sandman.get_pool(pool).recent_events.remote(100000)):
        seen.setdefault(sandbox_id, {}).setdefault(state, when)  # the first time
    out = {}
    for name, a, b in STAGES:
        spans = [s[b] - max(s[a], start) for s in seen.values()
                 if a in s and b in s and s[b] >= start]
        if spans:
            out[name] = pct(spans, 0.5)
    lent = [t - max(seen[sid]["leased"], start) for t, sid in usable
            if "leased" in seen.get(sid, {})]
    out["lent -> usable"] = pct(lent, 0.5)
    return out


def burst(n: int, clients: int, image: str, rounds: int = 3) -> dict:
    """The bursts. The cold one through the pool, the unpooled one and the raw provider
    burst take turns, ``rounds`` times (this machine's speed drifts by a fifth from one
    minute to the next); each reports its median round (by the time to 100 % usable),
    and the ratios are of those medians."""
    address = ray.get_runtime_context().gcs_address
    out: Dict[str, dict] = {}
    runs: Dict[str, List[dict]] = {"cold": [], "unpooled": [], "raw provider": [],
                                   "raw provider, agent running": []}
    for _ in range(rounds):
        runs["cold"].append(pool_burst("cold", {}, address, n, clients, image))
        name = "bench-unpooled-" + uuid.uuid4().hex[:6]
        start, usable = clients_burst(UNPOOLED_CLIENT, address, name, image, n, clients)
        runs["unpooled"].append(summary(start, usable))
        runs["raw provider"].append(raw_burst(n, image))
        runs["raw provider, agent running"].append(raw_burst(n, image, warmed=True))
    for kind, done in runs.items():
        done.sort(key=lambda r: r["usable_100_s"])
        out[kind] = dict(done[len(done) // 2], rounds_100_s=[r["usable_100_s"] for r in done])
    # the pool's pacing opened up (what pacing costs a burst on a machine that can take
    # it), then N sandboxes ready beforehand
    out["cold, pacing off"] = pool_burst("cold, pacing off", {
        "create_rate_per_s": 100000.0, "create_burst": n, "max_starting": n},
        address, n, clients, image)
    out["warm"] = pool_burst("warm", {}, address, n, clients, image)
    out["ratios"] = {
        "cold pool / unpooled": out["cold"]["usable_100_s"] / out["unpooled"]["usable_100_s"],
        "cold pool / raw provider": out["cold"]["usable_100_s"]
        / out["raw provider"]["usable_100_s"],
        "cold pool / raw provider, agent running": out["cold"]["usable_100_s"]
        / out["raw provider, agent running"]["usable_100_s"],
        "warm: unpooled / pool": out["unpooled"]["usable_100_s"] / out["warm"]["usable_100_s"]}
    return out


def pool_burst(kind: str, pacing: dict, address: str, n: int, clients: int,
               image: str) -> dict:
    """One burst of ``n`` acquires through a new pool (``kind`` "warm": n sandboxes
    ready first), with its stages and the PoolActor's CPU."""
    pool = "bench-burst-%s" % uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: n} if kind == "warm" else {},
                        max_sandboxes=n + 8, **pacing)
    try:
        if kind == "warm":
            wait_for(lambda: states(pool)["ready"] >= n, "%d warm sandboxes" % n)
        pid = ray.get(sandman.get_pool(pool).status.remote())["pid"]
        cpu = process_cpu_s(pid)
        start, usable = clients_burst(POOLED_CLIENT, address, pool, image, n, clients)
        out = summary(start, usable)
        # leases, first calls and releases (the clients release before they exit)
        out["pool_cpu_ms_per_sandbox"] = (process_cpu_s(pid) - cpu) * 1e3 / n
        out["stages_s"] = stages(pool, start, usable)
        if kind == "warm":
            lent = lent_times(pool, start)
            out["leases_per_s"] = len(lent) / max(lent) if lent else 0.0
        return out
    finally:
        sandman.shutdown_pool(pool)


def raw_burst(n: int, image: str, warmed: bool = False) -> dict:
    """``n`` sandboxes created at once through the provider from this process, no pool
    and one client: create, connect, ``exec true``. Its node agent starts at the first
    create, as a provider used directly does; ``warmed``: before the clock
    (``warm_up``, as a pool does), which leaves the provider's own pace."""
    raw = provider().bind("bench-raw-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=image)

    async def run() -> tuple:
        if warmed:
            await raw.warm_up()
        start = time.time()

        async def one():
            await create_and_exec(raw, spec)
            return time.time(), ""
        return start, await asyncio.gather(*[one() for _ in range(n)])
    try:
        start, usable = asyncio.run(run())
    finally:
        asyncio.run(raw.shutdown())
    return summary(start, usable)


def lent_times(pool: str, start: float) -> List[float]:
    """Seconds from ``start`` to each lease the pool made after it."""
    return [when - start for when, _, state, _ in
            ray.get(sandman.get_pool(pool).recent_events.remote(100000))
            if state == "leased" and when >= start]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used."""
    with open("/proc/%d/stat" % pid) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(start: float, usable: List[tuple]) -> dict:
    times = [t - start for t, _ in usable]
    return {"usable_50_s": pct(times, 0.5), "usable_100_s": max(times), "n": len(times)}


def states(pool: str) -> dict:
    return ray.get(sandman.get_pool(pool).status.remote())["states"]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for %s" % what)
        time.sleep(0.2)


# ---------------------------------------------------------------------- reuse
def reuse(episodes: int, k: int, image: str) -> dict:
    pool = "bench-reuse-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: k})
    wait_for(lambda: states(pool)["ready"] >= k, "%d warm sandboxes" % k)
    fresh = provider().bind("bench-fresh-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=image)

    async def pooled_episode():
        sb = await sandman.acquire_async(image, pool=pool, timeout=120)
        assert (await sb.exec.remote("true")).exit_code == 0
        await sandman.release_async(sb)

    async def fresh_episode():
        sandbox_id, _, _ = await create_and_exec(fresh, spec)
        await fresh.delete(sandbox_id)

    async def loop(episode) -> tuple:
        per: List[float] = []

        async def worker(count):
            for _ in range(count):
                t = time.perf_counter()
                await episode()
                per.append(time.perf_counter() - t)
        start = time.perf_counter()
        await asyncio.gather(*(worker(episodes // k) for _ in range(k)))
        return time.perf_counter() - start, per
    out = {}
    try:
        for name, episode in (("reset", pooled_episode), ("re-create", fresh_episode)):
            wall, per = asyncio.run(loop(episode))
            out[name] = {"episodes": len(per), "episodes_per_s": len(per) / wall,
                         "p50_ms": pct(per, 0.5) * 1e3, "p99_ms": pct(per, 0.99) * 1e3}
    finally:
        sandman.shutdown_pool(pool)
        asyncio.run(fresh.shutdown())
    out["ratio"] = {"reset / re-create": out["reset"]["episodes_per_s"]
                    / out["re-create"]["episodes_per_s"]}
    return out


# ---------------------------------------------------------------------- cycle
CYCLE_STEPS = ("acquire", "first exec", "release", "whole cycle")
# the same cycles with the first exec through the handle host (``.remote()``), taking
# turns with those above
REMOTE_STEPS = ("first exec, .remote()", "whole cycle, .remote()")
# the call after the first, on each path: a steady call on the same lease
SECOND_STEPS = ("second exec", "second exec, .remote()")


def cycle(cycles: int, image: str, warm: int = 8, rounds: int = 10) -> dict:
    """One client on a warm pool: acquire, a first ``exec true`` (a direct call),
    release, one cycle after another, each step timed; every other cycle makes its
    first call through the host instead (REMOTE_STEPS). Bare actor calls are timed back
    to back in rounds between the rounds of cycles (as the noop section times them), so
    each step is also given in bare calls of the same run."""
    pool = "bench-cycle-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: warm})
    wait_for(lambda: states(pool)["ready"] >= warm, "%d warm sandboxes" % warm)
    bare = Bare.remote()
    times: Dict[str, List[float]] = {name: [] for name in
                                     CYCLE_STEPS + REMOTE_STEPS + SECOND_STEPS + ("bare call",)}
    pid = ray.get(sandman.get_pool(pool).status.remote())["pid"]
    try:
        sandman.release(sandman.acquire(image, pool=pool, timeout=120))  # the host starts
        ray.get(bare.noop.remote())
        cpu = process_cpu_s(pid)
        for _ in range(rounds):
            # one client, one lease at a time: the warm pool always has one ready
            wait_for(lambda: states(pool)["ready"] >= warm - 1, "ready sandboxes")
            for i in range(2 * max(1, cycles // rounds)):
                t0 = time.perf_counter()
                sb = sandman.acquire(image, pool=pool, timeout=120)
                t1 = time.perf_counter()
                if i % 2 == 0:
                    assert sb.exec("true").exit_code == 0
                else:
                    assert ray.get(sb.exec.remote("true")).exit_code == 0
                t2 = time.perf_counter()
                if i % 2 == 0:  # the next call on the lease: a steady one
                    assert sb.exec("true").exit_code == 0
                else:
                    assert ray.get(sb.exec.remote("true")).exit_code == 0
                t3 = time.perf_counter()
                sandman.release(sb)
                t4 = time.perf_counter()
                times[SECOND_STEPS[i % 2]].append(t3 - t2)
                whole = (t4 - t0) - (t3 - t2)  # the cycle without the second call
                if i % 2 == 0:
                    for name, span in zip(CYCLE_STEPS, (t1 - t0, t2 - t1, t4 - t3, whole)):
                        times[name].append(span)
                else:
                    for name, span in zip(REMOTE_STEPS, (t2 - t1, whole)):
                        times[name].append(span)
            for _ in range(50):
                t = time.perf_counter()
                ray.get(bare.noop.remote())
                times["bare call"].append(time.perf_counter() - t)
        # a lease, its release and its reset (and a status question per round)
        pool_cpu = (process_cpu_s(pid) - cpu) * 1e3 / (
            len(times["acquire"]) + len(times[REMOTE_STEPS[0]]))
    finally:
        sandman.shutdown_pool(pool)
    out = {name: {"p50_ms": pct(v, 0.5) * 1e3, "p99_ms": pct(v, 0.99) * 1e3, "samples": len(v)}
           for name, v in times.items()}
    out["pool_cpu_ms_per_cycle"] = pool_cpu
    call = out["bare call"]["p50_ms"]
    out["in bare calls"] = {"%s %s" % (name, q): out[name]["%s_ms" % q] / call
                            for name in CYCLE_STEPS + REMOTE_STEPS + SECOND_STEPS
                            for q in ("p50", "p99")}
    out["first / second call"] = {
        "direct": out["first exec"]["p50_ms"] / out["second exec"]["p50_ms"],
        ".remote()": out["first exec, .remote()"]["p50_ms"]
        / out["second exec, .remote()"]["p50_ms"]}
    return out


def _cycle_rows(c: dict) -> List[tuple]:
    calls = c["in bare calls"]
    rows = [("cycle", "one client, warm pool: %s" % name,
             "%.2f ms" % c[name]["p50_ms"],
             "p99 %.2f ms; %.1f / %.1f bare calls" % (c[name]["p99_ms"], calls[name + " p50"],
                                                     calls[name + " p99"]))
            for name in CYCLE_STEPS + REMOTE_STEPS + SECOND_STEPS]
    for path, ratio in c["first / second call"].items():
        rows.append(("cycle", "first call on a new lease / the next, %s" % path,
                     "%.2fx" % ratio, "target <= 1.5x"))
    rows.append(("cycle", "bare actor call (rounds between the cycles)",
                 "%.2f ms" % c["bare call"]["p50_ms"],
                 "p99 %.2f ms" % c["bare call"]["p99_ms"]))
    rows.append(("cycle", "PoolActor CPU per cycle (lease, release, reset)",
                 "%.2f ms" % c["pool_cpu_ms_per_cycle"], ""))
    return rows


# ---------------------------------------------------------------------- stream
STREAM_MB = 100


def stream(image: str, rounds: int = 3) -> dict:
    """MB/s of ``cat`` of a 100 MB file in the sandbox through ``sb.exec_stream``,
    directly and through ``.remote()`` (a Ray streaming generator), in turns; and how
    much the daemon's RSS grows while a reader stops reading (on each path: the
    command's writes stall, nothing piles up)."""
    pool = "bench-stream-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: 1})
    rates: Dict[str, List[float]] = {"direct": [], ".remote()": []}
    growth: Dict[str, float] = {}
    try:
        with sandman.sandbox(image, pool=pool, timeout=120) as sb:
            assert sb.exec("head -c %d /dev/zero > /tmp/big" % (STREAM_MB << 20)).ok
            paths = {"direct": lambda: sb.exec_stream("cat /tmp/big"),
                     ".remote()": lambda: (ray.get(ref) for ref in
                                           sb.exec_stream.remote("cat /tmp/big"))}
            for _ in range(rounds):
                for name, start in paths.items():
                    t, got = time.perf_counter(), 0
                    for item in start():
                        if not isinstance(item, ExecResult):
                            got += len(item[1])
                    assert got == STREAM_MB << 20, got
                    rates[name].append(got / 1e6 / (time.perf_counter() - t))
            for name in paths:
                growth[name] = _stalled_growth_mb(sb, name)
    finally:
        sandman.shutdown_pool(pool)
    return {"mb_per_s": {name: statistics.median(v) for name, v in rates.items()},
            "rounds_mb_per_s": rates, "rss_growth_mb_reader_stopped": growth}


def _daemon_rss_kib(sb) -> int:
    """The RSS of the sandbox's daemon (PID 1 in its pid namespace)."""
    status = sb.read_file("/proc/1/status").decode()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _stalled_growth_mb(sb, path: str) -> float:
    """Start a stream on ``path``, read two chunks, stop reading; once ``cat`` writes no
    more (its written bytes unchanged over a second), how much the daemon grew (MB)."""
    before = _daemon_rss_kib(sb)
    if path == "direct":
        items = sb.exec_stream("cat /tmp/big")
        next(items), next(items)
    else:
        items = sb.exec_stream.remote("cat /tmp/big")
        ray.get(next(items)), ray.get(next(items))
    pid = int(sb.exec("pidof cat").stdout.split()[0])
    written, still = -1, 0
    while still < 10:
        now = int(sb.read_file("/proc/%d/io" % pid).split(b"wchar:")[1].split()[0])
        still = still + 1 if now == written else 0
        written = now
        time.sleep(0.1)  # a pace to look at the writer, not a wait for an event
    grown = (_daemon_rss_kib(sb) - before) / 1024
    items.close() if path == "direct" else items.cancel()
    return grown


# ---------------------------------------------------------------------- cost
def cpu_ticks() -> int:
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def cost(image: str, count: int = 20) -> dict:
    p = provider().bind("bench-cost-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=image)

    async def run():
        await p.create("cost-warmup", spec, {})  # the agent, bundle and image first
        await asyncio.sleep(1.0)
        idle = cpu_ticks()
        await asyncio.sleep(2.0)
        idle_per_s = (cpu_ticks() - idle) / 2.0
        start, t = cpu_ticks(), time.monotonic()
        infos = await asyncio.gather(*(p.create("cost-%d" % i, spec, {}) for i in range(count)))
        for info in infos:
            client = await AsyncDaemonClient.connect(info.address, info.token)
            await client.ping()
            client.close()
        busy = cpu_ticks() - start - idle_per_s * (time.monotonic() - t)
        await asyncio.sleep(1.0)  # start-up settles before idle memory is read
        pss = [pss_kb(info.details["pid"]) for info in infos]
        return busy / os.sysconf("SC_CLK_TCK") / count, sum(pss) / len(pss)
    pool = "bench-cost-pool-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: 1})
    try:
        cpu_s, sandbox_kb = asyncio.run(run())
        sb = sandman.acquire(image, pool=pool, timeout=120)
        host_pid = ray.get(sb._host.__ray_call__.remote(lambda self: os.getpid()))
        host_kb = pss_kb(host_pid)
        sandman.release(sb)
    finally:
        sandman.shutdown_pool(pool)
        asyncio.run(p.shutdown())
    return {"cpu_ms_per_create": cpu_s * 1e3, "pss_mb_per_idle_sandbox": sandbox_kb / 1024,
            "pss_mb_per_handle_host": host_kb / 1024}


# ---------------------------------------------------------------------- the run
def machine() -> dict:
    model = ""
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as fh:
        mem_kb = int(fh.readline().split()[1])
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_gb": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "os": _os_release(), "python": platform.python_version(),
            "ray": ray.__version__}


def _os_release() -> str:
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def table(results: dict, args) -> List[tuple]:
    rows = []
    if "noop" in results:
        rows += noop_rows(results["noop"])
    if "burst" in results:
        rows += _burst_rows(results["burst"], args)
    if "cycle" in results:
        rows += _cycle_rows(results["cycle"])
    for name, row in results.get("reuse", {}).items():
        if name == "ratio":
            rows.append(("reuse", "reset vs re-create", "%.2fx the episodes/s"
                         % row["reset / re-create"], ""))
            continue
        rows.append(("reuse", "%s: %d episodes on %d sandboxes" % (name, row["episodes"], args.k),
                     "%.1f episodes/s" % row["episodes_per_s"],
                     "p50 %.1f ms, p99 %.1f ms" % (row["p50_ms"], row["p99_ms"])))
    if "fork" in results:
        rows += forks.rows(results["fork"])
    if "stream" in results:
        st = results["stream"]
        for name, rate in st["mb_per_s"].items():
            rows.append(("stream", "cat of %d MB through exec_stream, %s" % (STREAM_MB, name),
                         "%.0f MB/s" % rate, "target >= %d MB/s; rounds %s" % (
                             200 if name == "direct" else 50,
                             ", ".join("%.0f" % r for r in st["rounds_mb_per_s"][name]))))
        for name, grown in st["rss_growth_mb_reader_stopped"].items():
            rows.append(("stream", "daemon RSS growth while the reader stops, %s" % name,
                         "%.1f MB" % grown, "target < 32 MB"))
    if "isolation" in results:
        rows += isolation.rows(results["isolation"])
    if "cost" in results:
        c = results["cost"]
        rows.append(("cost", "PSS per idle sandbox (daemon + bwrap)",
                     "%.1f MB" % c["pss_mb_per_idle_sandbox"], ""))
        rows.append(("cost", "PSS per handle host actor (one per client process and node)",
                     "%.1f MB" % c["pss_mb_per_handle_host"], ""))
        rows.append(("cost", "CPU per create (whole machine, idle subtracted)",
                     "%.1f ms" % c["cpu_ms_per_create"], ""))
    return rows


def _burst_rows(b: dict, args) -> List[tuple]:
    rows = []
    for kind in ("cold", "cold, pacing off", "warm", "unpooled", "raw provider",
                 "raw provider, agent running"):
        clients = 1 if kind.startswith("raw provider") else args.clients
        rows.append(("burst", "%s: %d from %d client%s, 50 %% / 100 %% usable"
                     % (kind, args.n, clients, "s" * (clients > 1)),
                     "%.2f s / %.2f s" % (b[kind]["usable_50_s"], b[kind]["usable_100_s"]),
                     "; ".join(note for note in (
                         "median of rounds at %s s" % ", ".join(
                             "%.2f" % t for t in b[kind]["rounds_100_s"])
                         if len(b[kind].get("rounds_100_s", ())) > 1 else "",
                         "PoolActor CPU %.1f ms per sandbox" % b[kind]["pool_cpu_ms_per_sandbox"]
                         if "pool_cpu_ms_per_sandbox" in b[kind] else "") if note)))
        if "stages_s" in b[kind]:
            rows.append(("burst", "%s: median per stage" % kind, "", ", ".join(
                "%s %.2f s" % kv for kv in b[kind]["stages_s"].items())))
    rows.append(("burst", "warm: leases per second (4 clients, warm pool of %d)" % args.n,
                 "%.0f /s" % b["warm"]["leases_per_s"], ""))
    for kind in ("cold", "cold, pacing off", "warm"):
        rows.append(("burst", "%s pool vs unpooled, 100 %% usable" % kind, "%.2fx sooner" % (
            b["unpooled"]["usable_100_s"] / b[kind]["usable_100_s"]), ""))
    rows.append(("burst", "cold pool / raw provider burst, 100 % usable", "%.2fx" %
                 b["ratios"]["cold pool / raw provider"], "target <= 1.25x"))
    rows.append(("burst", "cold pool / raw provider burst, agent running, 100 % usable",
                 "%.2fx" % b["ratios"]["cold pool / raw provider, agent running"],
                 "the pool's cost over the provider's own pace"))
    return rows


# in the order they run; stream last: its 100 MB chunks stay in the host's heap
SECTIONS = ("noop", "burst", "cycle", "reuse", "fork", "cost", "isolation", "stream")


def isolation_section(args) -> dict:
    """The isolation levels; with ``--isolation-against REF``, REF's beside in turns
    (three each, a third of the creates per turn), the figures of this checkout's last
    turn in the table and every turn under ``against``."""
    if not args.isolation_against:
        return isolation.isolation(args.creates)
    per_turn = max(1, args.creates // 3)
    result = isolation.against(args.isolation_against, per_turn, 3,
                               lambda: isolation.isolation(per_turn))
    if "turns" not in result:
        return dict(isolation.isolation(args.creates), against=result)
    return dict(result["turns"]["this"][-1], against=result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="burst size")
    parser.add_argument("--clients", type=int, default=4, help="burst client processes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="burst: rounds of the cold, unpooled and raw bursts, in turn")
    parser.add_argument("--samples", type=int, default=1000, help="no-op samples per row")
    parser.add_argument("--episodes", type=int, default=200, help="reuse: episodes")
    parser.add_argument("--k", type=int, default=4, help="reuse: sandboxes at a time")
    parser.add_argument("--cycles", type=int, default=200, help="cycle: lease cycles")
    parser.add_argument("--sections",
                        default=",".join(SECTIONS))
    parser.add_argument("--creates", type=int, default=30,
                        help="isolation: creates one at a time per level")
    parser.add_argument("--isolation-against", default=None, metavar="REF",
                        help="isolation: measure commit REF's levels too, in turns "
                             "(bench/isolation.py)")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sorted(sections - set(SECTIONS))
    if unknown:
        parser.error("unknown sections %s (known: %s)" % (unknown, ", ".join(SECTIONS)))
    image = "dir:%s" % build_busybox_rootfs(ROOT / ".cache" / "images" / "busybox")
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench", log_to_driver=False)
    results: Dict[str, dict] = {}
    runs = {"noop": lambda: noop(args.samples),
            "burst": lambda: burst(args.n, args.clients, image, args.rounds),
            "cycle": lambda: cycle(args.cycles, image),
            "reuse": lambda: reuse(args.episodes, args.k, image),
            "fork": forks.fork_vs_fresh,
            "cost": lambda: cost(image),
            "isolation": lambda: isolation_section(args),
            "stream": lambda: stream(image)}
    try:
        with progress.bar(len(sections), "make bench", unit="section") as shown:
            for name in (n for n in SECTIONS if n in sections):
                shown.set_description("make bench: " + name)
                results[name] = runs[name]()
                shown.update()
        description = machine()
    finally:
        ray.shutdown()
    report = {"bench": "run_all", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": description, "args": vars(args),
              "duration_s": round(time.monotonic() - started, 1), "results": results}
    print("%-6s %-62s %-18s %s" % ("", "measure", "result", ""))
    for section, name, value, note in table(results, args):
        print("%-6s %-62s %-18s %s" % (section, name, value, note))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
