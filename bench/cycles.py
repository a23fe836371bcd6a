"""The cycle and reuse sections of bench/run_all.py: one lease cycle after another on
a warm pool, each step timed (also in bare actor calls of the same run); and episodes
on K sandboxes, reset between them, beside a new sandbox per episode."""

import asyncio
import time
import uuid
from typing import Dict, List

import ray

import sandman_ray as sandman
from sandman_ray.spec import SandboxSpec

from common import pct, process_cpu_s, provider, states, wait_for
from local import create_and_exec
from noop_section import Bare

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


def reuse_rows(reuse: dict, k: int) -> List[tuple]:
    rows = []
    for name, row in reuse.items():
        if name == "ratio":
            rows.append(("reuse", "reset vs re-create", "%.2fx the episodes/s"
                         % row["reset / re-create"], ""))
            continue
        rows.append(("reuse", "%s: %d episodes on %d sandboxes" % (name, row["episodes"], k),
                     "%.1f episodes/s" % row["episodes_per_s"],
                     "p50 %.1f ms, p99 %.1f ms" % (row["p50_ms"], row["p99_ms"])))
    return rows


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


def rows(c: dict) -> List[tuple]:
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
