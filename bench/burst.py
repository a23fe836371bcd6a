"""The burst section of bench/run_all.py: N acquires from M client processes at once,
cold and warm, beside the same N without the pool and the raw provider's own pace."""

import asyncio
import json
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Dict, List

import ray

import sandman_ray as sandman
from sandman_ray.spec import SandboxSpec

from common import CACHE, ROOT, STATE, pct, process_cpu_s, provider, states, wait_for
from local import create_and_exec

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
    from sandman_ray.providers.local import LocalProvider
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


def clients_burst(script: str, address: str, target, image: str, n: int,
                  clients: int) -> tuple:
    """Start ``clients`` processes, let them go at one wall-clock moment, and return
    (start, [(usable wall time, sandbox id)]). ``target``: what each is given (a list:
    one each)."""
    targets = target if isinstance(target, list) else [target] * clients
    procs = [subprocess.Popen([sys.executable, "-c", script, address, targets[i], image,
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


def summary(start: float, usable: List[tuple]) -> dict:
    times = [t - start for t, _ in usable]
    return {"usable_50_s": pct(times, 0.5), "usable_100_s": max(times), "n": len(times)}


def rows(b: dict, args) -> List[tuple]:
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
