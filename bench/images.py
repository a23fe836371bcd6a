"""The images section of bench/run_all.py: many task images and per-task settings.

    python bench/images.py [--n 200] [--clients 4] [--rounds 1] [--images 100]
                           [--many 500] [--base-mb 200]

Many task images: bench/image_burst.py.

Per-task settings on a warm pool: ``n`` acquires of one image from ``clients`` client
processes at once, each spec setting its own ``env`` (a task id) and ``workdir``, on a
pool that keeps ``n`` sandboxes of the image warm. With late binding (the default:
``PoolConfig.late_bind``) the warm sandboxes serve them and take each lease's settings
as they are lent; with today's keys (``late_bind=False``), each distinct spec waits for
a create of its own while the warm set stands by. Each acquire is usable once a command
run in it has printed its own task id and working directory. The two bursts take turns,
``rounds`` times; each reports its median round.
"""

import argparse
import os
import sys
import textwrap
import uuid
from typing import Dict, List

import ray

import sandman_ray as sandman

import image_burst
from burst import clients_burst, summary
from common import ROOT, provider, run_alone, states, wait_for

TASK_CLIENT = textwrap.dedent("""
    import asyncio, json, os, sys, time, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    n = int(sys.argv[4])
    sandman.prepare(sys.argv[2])
    print("go", flush=True)
    start = float(sys.stdin.readline())
    async def one(i):
        task = "%d-%d" % (os.getpid(), i)
        spec = {"image": sys.argv[3], "env": {"TASK_ID": task}, "workdir": "/work/" + task}
        h = await sandman.acquire_async(spec, pool=sys.argv[2], timeout=600)
        r = await h.exec_async("echo $TASK_ID; pwd")
        assert r.stdout.decode().split() == [task, "/work/" + task], r
        return time.time(), h
    async def main():
        while time.time() < start:
            await asyncio.sleep(0.001)
        return await asyncio.gather(*[one(i) for i in range(n)])
    results = asyncio.run(main())
    print("usable " + json.dumps([[t, h.sandbox] for t, h in results]), flush=True)
    sys.stdin.readline()
    for _, h in results:
        sandman.release(h)
""")

KINDS = ("late bind", "today's keys")


def task_burst(kind: str, address: str, n: int, clients: int, image: str) -> dict:
    """One burst of ``n`` per-task acquires on a new pool of ``n`` warm sandboxes: the
    times to 50 % and 100 % usable, and the share served by a sandbox that was warm
    before it began."""
    pool = "bench-tasks-%s" % uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: n}, max_sandboxes=2 * n + 8,
                        late_bind=kind == "late bind")
    try:
        wait_for(lambda: states(pool)["ready"] >= n, "%d warm sandboxes" % n)
        actor = sandman.get_pool(pool)
        warm = {s["sandbox_id"] for s in ray.get(actor.list_sandboxes.remote())
                if s["state"] == "ready"}
        start, usable = clients_burst(TASK_CLIENT, address, pool, image, n, clients)
        out = summary(start, usable)
        out["served_warm"] = sum(1 for _, sid in usable if sid in warm) / len(usable)
        out["bound"] = ray.get(actor.status.remote())["stats"]["bound"]
        return out
    finally:
        sandman.shutdown_pool(pool)


def late_binding(n: int, clients: int, image: str, rounds: int = 1) -> dict:
    address = ray.get_runtime_context().gcs_address
    runs: Dict[str, List[dict]] = {kind: [] for kind in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            runs[kind].append(task_burst(kind, address, n, clients, image))
    out: Dict[str, dict] = {}
    for kind, done in runs.items():
        done.sort(key=lambda r: r["usable_100_s"])
        out[kind] = dict(done[len(done) // 2], rounds_100_s=[r["usable_100_s"] for r in done])
    out["sooner_100"] = out["today's keys"]["usable_100_s"] / out["late bind"]["usable_100_s"]
    out["n"], out["clients"] = n, clients
    return out


def images(n: int = 200, clients: int = 4, image: str = "", rounds: int = 1,
           count: int = 100, many: int = 500, base_mb: int = 200) -> dict:
    out = {"per_task": late_binding(n, clients, image, rounds)}
    if count:
        out["many"] = image_burst.many_images(count, many, clients, base_mb)
    return out


def rows(result: dict) -> List[tuple]:
    part = result["per_task"]
    out = []
    for kind in KINDS:
        r = part[kind]
        out.append(("images", "per-task env+workdir, %s: %d from %d clients, 50 %% / 100 %% "
                    "usable" % (kind, part["n"], part["clients"]),
                    "%.2f s / %.2f s" % (r["usable_50_s"], r["usable_100_s"]),
                    "%.0f %% served warm" % (100 * r["served_warm"])))
    out.append(("images", "per-task burst, late bind vs today's keys, 100 % usable",
                "%.2fx sooner" % part["sooner_100"], "target >= 3x, >= 90 % served warm"))
    if "many" in result:
        out += image_burst.rows(result["many"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--images", type=int, default=100,
                        help="the many-images burst: images (0: none)")
    parser.add_argument("--many", type=int, default=500, help="its acquires")
    parser.add_argument("--base-mb", type=int, default=200, help="its images' shared base")
    args = parser.parse_args(argv)
    from local import busybox_rootfs
    # the pools' providers (here and in the client processes) trust its directory
    os.environ.setdefault("SANDMAN_IMAGE_ROOTS", str(ROOT / ".cache" / "images"))
    image = "dir:%s" % busybox_rootfs()
    return run_alone(lambda: images(args.n, args.clients, image, args.rounds, args.images,
                                    args.many, args.base_mb), rows, "images")


if __name__ == "__main__":
    sys.exit(main())
