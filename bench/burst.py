"""Bursts through the pool on a local Ray with the LocalProvider, in one run:

  cold burst   N acquires from M client processes at once, no warm sandboxes:
               time until 50 % and 100 % are usable (acquired and answered `true`)
  warm burst   the same with N warm sandboxes ready beforehand
  warm acquire one client acquiring and releasing one sandbox with an idle handle,
               each acquire once the previous release's reset is done (as between
               episodes), beside a bare Ray actor call in the same run

Prints a table and one JSON line.

    python bench/burst.py [--n 200] [--clients 4] [--rounds 200]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import ray

import sandman_ray as sandman
from sandman_ray.image_builders import build_busybox_rootfs

ROOT = Path(__file__).resolve().parent.parent
STATE = "/tmp/sandman-ray/bench-burst"
CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    n = int(sys.argv[4])
    print("go", flush=True)
    start = float(sys.stdin.readline())   # a shared wall-clock start
    async def one():
        h = await sandman.acquire_async(sys.argv[3], pool=sys.argv[2], timeout=600)
        r = await h.exec.remote("true")
        assert r.exit_code == 0
        return time.time() - start, h
    async def main():
        return await asyncio.gather(*[one() for _ in range(n)])
    results = asyncio.run(main())
    print("times " + json.dumps([t for t, _ in results]), flush=True)
    sys.stdin.readline()
""")


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered)) - (1 if q == 1 else 0)))]


def burst(address, pool, image, n, clients):
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, address, pool, image,
                               str(n // clients + (1 if i < n % clients else 0))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=str(ROOT)) for i in range(clients)]
    try:
        for p in procs:
            while p.stdout.readline().strip() != "go":
                pass
        start = time.time() + 0.2
        for p in procs:
            p.stdin.write("%f\n" % start)
            p.stdin.flush()
        times = []
        for p in procs:
            for line in p.stdout:
                if line.startswith("times "):
                    times += json.loads(line[6:])
                    break
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(120)
        return times
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@ray.remote(num_cpus=0)
class Bare:
    async def call(self):
        return None


def warm_acquire(pool, image, rounds):
    sb = sandman.acquire(image, pool=pool)
    sandman.release(sb)  # from here on an idle handle waits in this process
    bare = Bare.remote()
    ray.get(bare.call.remote())
    acquire, actor = [], []
    pool_actor = sandman.get_pool(pool)
    for _ in range(rounds):
        # as between episodes: the last released sandbox has finished its reset (a reset
        # is ~50 ms of CPU, which back-to-back acquires on 2 cores would also measure)
        while ray.get(pool_actor.status.remote())["states"]["resetting"]:
            time.sleep(0.01)
        t = time.perf_counter()
        sb = sandman.acquire(image, pool=pool)
        acquire.append(time.perf_counter() - t)
        sandman.release(sb)
        t = time.perf_counter()
        ray.get(bare.call.remote())
        actor.append(time.perf_counter() - t)
    return acquire, actor


def wait_ready(pool, n):
    actor = sandman.get_pool(pool)
    deadline = time.monotonic() + 600
    while ray.get(actor.status.remote())["states"]["ready"] < n:
        if time.monotonic() > deadline:
            raise SystemExit("warm pool did not fill")
        time.sleep(0.2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--image", default=None)
    args = parser.parse_args()
    image = args.image or "dir:%s" % build_busybox_rootfs(ROOT / ".cache" / "images" / "busybox")
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench", log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    provider = sandman.LocalProvider(state_root=STATE, cache_root=str(ROOT / ".cache" / "provider"))
    out, rows = {}, []
    try:
        for kind in ("cold", "warm"):
            pool = "burst-%s-%s" % (kind, uuid.uuid4().hex[:6])
            warm = {image: args.n} if kind == "warm" else {}
            sandman.create_pool(pool, provider=provider, warm=warm, max_sandboxes=args.n + 8,
                                max_starting=64)
            if warm:
                wait_ready(pool, args.n)
            times = burst(address, pool, image, args.n, args.clients)
            out[kind] = {"n": args.n, "clients": args.clients, "usable_50_s": pct(times, 0.5),
                         "usable_100_s": max(times)}
            rows.append(("%s burst: %d from %d clients" % (kind, args.n, args.clients),
                         pct(times, 0.5), max(times)))
            sandman.shutdown_pool(pool)
        pool = "burst-steady-" + uuid.uuid4().hex[:6]
        sandman.create_pool(pool, provider=provider, warm={image: 2})
        wait_ready(pool, 2)
        acquire, actor = warm_acquire(pool, image, args.rounds)
        sandman.shutdown_pool(pool)
        out["warm_acquire"] = {"p50_ms": pct(acquire, 0.5) * 1e3, "p99_ms": pct(acquire, 0.99) * 1e3,
                               "bare_actor_call_p50_ms": pct(actor, 0.5) * 1e3}
    finally:
        ray.shutdown()
    print("%-40s %12s %12s" % ("burst", "50 % usable", "100 % usable"))
    for name, half, full in rows:
        print("%-40s %11.2fs %11.2fs" % (name, half, full))
    w = out["warm_acquire"]
    print("%-40s %9.2f ms (p99 %.2f ms)" % ("warm acquire, idle handle (p50)", w["p50_ms"], w["p99_ms"]))
    print("%-40s %9.2f ms" % ("bare Ray actor call (p50)", w["bare_actor_call_p50_ms"]))
    print(json.dumps({"bench": "burst", "machine": {"cpus": os.cpu_count(),
                      "kernel": platform.release(), "python": platform.python_version()},
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": out}))


if __name__ == "__main__":
    main()
