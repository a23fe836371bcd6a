"""LocalProvider on a local Ray, in one run:

  create -> first exec answered   p50 / p99 / all answering, at 1, 50 and 200 at once
  reset  -> ready (daemon answers) p50 / p99
  delete                           p50
  memory                           PSS per idle sandbox (daemon + bwrap), from smaps_rollup

Prints a table and one JSON line.

    python bench/local.py [--image dir:/path] [--bursts 1,50,200] [--resets 50]
"""

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from pathlib import Path

import ray

from sandman_ray import AsyncDaemonClient
from sandman_ray.daemon.sandmand import descendants
from sandman_ray.image_builders import build_busybox_rootfs
from sandman_ray.providers.local import LocalProvider
from sandman_ray.spec import SandboxSpec

ROOT = Path(__file__).resolve().parent.parent


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def pss_kb(pid: int) -> int:
    """PSS of ``pid`` and all its descendants, in KiB."""
    total = 0
    for current in [pid] + descendants(pid):
        try:
            with open("/proc/%d/smaps_rollup" % current) as fh:
                total += next(int(l.split()[1]) for l in fh if l.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return total


async def create_and_exec(provider, spec):
    sandbox_id = "bench-" + uuid.uuid4().hex[:10]
    start = time.perf_counter()
    info = await provider.create(sandbox_id, spec, {"bench": "local"})
    client = await AsyncDaemonClient.connect(info.address, info.token)
    result = await client.exec("true")
    elapsed = time.perf_counter() - start
    client.close()
    assert result.exit_code == 0
    return sandbox_id, info, elapsed


async def burst(provider, spec, n):
    start = time.perf_counter()
    results = await asyncio.gather(*[create_and_exec(provider, spec) for _ in range(n)])
    wall = time.perf_counter() - start
    return results, wall


async def main_async(args):
    provider = LocalProvider(state_root="/tmp/sandman-ray/bench-state",
                             cache_root=str(ROOT / ".cache" / "provider")).bind("bench-local")
    spec = SandboxSpec(image=args.image)
    rows, out = [], {}
    await burst(provider, spec, 1)  # warm: agent, bundle, image cache
    for sid in [i.sandbox_id for i in await provider.list({"bench": "local"})]:
        await provider.delete(sid)
    for n in args.bursts:
        results, wall = await burst(provider, spec, n)
        latencies = [r[2] for r in results]
        rows.append(("create -> first exec, %d at once" % n, pct(latencies, 0.5),
                     pct(latencies, 0.99), wall))
        out["create_%d" % n] = {"p50_ms": pct(latencies, 0.5) * 1e3,
                                "p99_ms": pct(latencies, 0.99) * 1e3, "all_s": wall}
        if n == max(args.bursts):
            await asyncio.sleep(1.0)  # let start-up settle before measuring idle memory
            pss = [pss_kb(r[1].details["pid"]) for r in results]
            out["pss_kb_per_sandbox"] = sum(pss) / len(pss)
        ids = [r[0] for r in results]
        if n == 1:
            resets = []
            for _ in range(args.resets):
                t = time.perf_counter()
                info = await provider.reset(ids[0])
                client = await AsyncDaemonClient.connect(info.address, info.token)
                await client.ping()
                resets.append(time.perf_counter() - t)
                client.close()
            rows.append(("reset -> ready (ping)", pct(resets, 0.5), pct(resets, 0.99), None))
            out["reset"] = {"p50_ms": pct(resets, 0.5) * 1e3, "p99_ms": pct(resets, 0.99) * 1e3}
        deletes = []
        for sid in ids:
            t = time.perf_counter()
            await provider.delete(sid)
            deletes.append(time.perf_counter() - t)
        if n == max(args.bursts):
            rows.append(("delete", pct(deletes, 0.5), pct(deletes, 0.99), None))
            out["delete"] = {"p50_ms": pct(deletes, 0.5) * 1e3}
    await provider.shutdown()
    print("%-36s %10s %10s %12s" % ("operation", "p50 ms", "p99 ms", "all done s"))
    for name, p50, p99, wall in rows:
        print("%-36s %10.1f %10.1f %12s" % (name, p50 * 1e3, p99 * 1e3,
                                           "%.2f" % wall if wall is not None else ""))
    print("%-36s %10.1f" % ("PSS per idle sandbox (MB)", out["pss_kb_per_sandbox"] / 1024))
    print(json.dumps({"bench": "local", "image": args.image, "machine": {
        "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": out}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=None, help="default: a busybox rootfs")
    parser.add_argument("--bursts", default="1,50,200")
    parser.add_argument("--resets", type=int, default=50)
    args = parser.parse_args()
    args.bursts = [int(b) for b in args.bursts.split(",")]
    if args.image is None:
        args.image = "dir:%s" % build_busybox_rootfs(ROOT / ".cache" / "images" / "busybox")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main_async(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
