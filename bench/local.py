"""LocalProvider and DockerProvider (a private Podman API service) side by side on a
local Ray, one after the other in one run:

  create -> first exec answered   p50 / p99: one at a time (--creates of them), and
                                   all answering at 1, 50 and 200 at once
  reset  -> ready (daemon answers) p50 / p99
  delete                           p50
  memory                           PSS per idle sandbox (daemon + bwrap, or daemon +
                                   conmon), from smaps_rollup

Prints a table and one JSON line.

    python bench/local.py [--providers local,local-host-root,local-network,local-gvisor,docker] [--image dir:/path]
                          [--docker-image REF] [--bursts 1,50,200] [--resets 50]
                          [--creates 20] [--execs 500]
"""

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Dict, Optional

import ray

from sandman_ray import AsyncDaemonClient
from sandman_ray.daemon.sandmand.spawn import descendants
from sandman_ray.image_builders import build_busybox_rootfs
from sandman_ray.providers.local import LocalProvider
from sandman_ray.spec import SandboxSpec

import progress  # bench/progress.py

ROOT = Path(__file__).resolve().parent.parent


def busybox_rootfs() -> Path:
    """The benches' smallest image: a busybox rootfs under .cache/images, built once."""
    return build_busybox_rootfs(ROOT / ".cache" / "images" / "busybox")


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def pss_kb(pid: int) -> int:
    """PSS of ``pid`` and all its descendants, in KiB."""
    return pss_of([pid] + descendants(pid))


def comm(pid: int) -> str:
    """The name of process ``pid`` ("?" once it is gone)."""
    try:
        return Path("/proc/%d/comm" % pid).read_text().strip()
    except OSError:
        return "?"


def parent_pid(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (None once it is gone)."""
    try:
        stat = Path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def pss_by_process(sandboxes) -> Dict[str, float]:
    """The PSS per sandbox (KiB) of each kind of process, by name, over ``sandboxes``
    (each the pids that serve one)."""
    total: Dict[str, float] = {}
    for pids in sandboxes:
        for pid in pids:
            total[comm(pid)] = total.get(comm(pid), 0.0) + pss_of([pid])
    return {name: kb / len(sandboxes) for name, kb in sorted(total.items())}


def serving(pids) -> set:
    """``pids`` and their descendants, each once (a conmon's child may be named too)."""
    return set(pids).union(*(descendants(pid) for pid in pids))


def pss_of(pids, field: str = "Pss") -> int:
    """PSS of the processes ``pids`` (those still there), in KiB; or another line of
    their smaps_rollup (``Anonymous``: their private and copied-on-write memory)."""
    total = 0
    for current in pids:
        try:
            with open("/proc/%d/smaps_rollup" % current) as fh:
                total += next(int(l.split()[1]) for l in fh if l.startswith(field + ":"))
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


async def measure(provider, spec, args, pid_of, shut_down: bool = True):
    """Rows ``{operation: (p50 s, p99 s, all-done s or None)}`` and figures for JSON;
    then ``provider`` is shut down, unless ``shut_down`` is False (its caller goes on)."""
    rows, out = {}, {}
    await burst(provider, spec, 1)  # warm: agent, bundle, image cache
    for sid in [i.sandbox_id for i in await provider.list({"bench": "local"})]:
        await provider.delete(sid)
    single = []
    for _ in progress.steps(range(args.creates), "creates one at a time", unit="create"):
        sandbox_id, _, elapsed = await create_and_exec(provider, spec)
        single.append(elapsed)
        await provider.delete(sandbox_id)
    rows["create -> first exec, one at a time"] = (pct(single, 0.5), pct(single, 0.99), None)
    out["create_sequential"] = {"p50_ms": pct(single, 0.5) * 1e3,
                                "p99_ms": pct(single, 0.99) * 1e3, "samples": len(single)}
    for n in args.bursts:
        results, wall = await burst(provider, spec, n)
        latencies = [r[2] for r in results]
        rows["create -> first exec, %d at once" % n] = (pct(latencies, 0.5),
                                                       pct(latencies, 0.99), wall)
        out["create_%d" % n] = {"p50_ms": pct(latencies, 0.5) * 1e3,
                                "p99_ms": pct(latencies, 0.99) * 1e3, "all_s": wall}
        if n == max(args.bursts):
            await asyncio.sleep(1.0)  # let start-up settle before measuring idle memory
            pss = [pss_of(serving(pid_of(r[1]))) for r in results]
            out["pss_kb_per_sandbox"] = sum(pss) / len(pss)
        ids = [r[0] for r in results]
        if n == 1:
            info = results[0][1]
            client = await AsyncDaemonClient.connect(info.address, info.token)
            execs = []
            for _ in range(args.execs):
                t = time.perf_counter()
                await client.exec("true")
                execs.append(time.perf_counter() - t)
            client.close()
            rows["exec true (daemon client)"] = (pct(execs, 0.5), pct(execs, 0.99), None)
            out["exec_true"] = {"p50_ms": pct(execs, 0.5) * 1e3, "p99_ms": pct(execs, 0.99) * 1e3}
            resets = []
            for _ in range(args.resets):
                t = time.perf_counter()
                info = await provider.reset(ids[0])
                client = await AsyncDaemonClient.connect(info.address, info.token)
                await client.ping()
                resets.append(time.perf_counter() - t)
                client.close()
            rows["reset -> ready (ping)"] = (pct(resets, 0.5), pct(resets, 0.99), None)
            out["reset"] = {"p50_ms": pct(resets, 0.5) * 1e3, "p99_ms": pct(resets, 0.99) * 1e3}
        deletes = []
        for sid in ids:
            t = time.perf_counter()
            await provider.delete(sid)
            deletes.append(time.perf_counter() - t)
        if n == max(args.bursts):
            rows["delete"] = (pct(deletes, 0.5), pct(deletes, 0.99), None)
            out["delete"] = {"p50_ms": pct(deletes, 0.5) * 1e3}
    if shut_down:
        await provider.shutdown()
    return rows, out


def local_setup(args, user_namespaces=True, network=False, isolation="namespaces"):
    name = "bench-local" + ("-network" if network else "") + (
        "" if user_namespaces else "-host-root") + ("-gvisor" if isolation == "gvisor" else "")
    image = args.image or "dir:%s" % busybox_rootfs()
    # dir: images are served only from trusted roots: the project's images, or --image's
    roots = [str(ROOT / ".cache" / "images")] if not args.image or not \
        args.image.startswith("dir:") else [os.path.dirname(args.image[4:].rstrip("/"))]
    provider = LocalProvider(state_root="/tmp/sandman-ray/bench-state",
                             cache_root=str(ROOT / ".cache" / "provider"),
                             user_namespaces=user_namespaces, isolation=isolation,
                             image_roots=roots).bind(name)
    return (provider, SandboxSpec(image=image, network=network),
            lambda info: [info.details["pid"]], None)


def docker_setup(args):
    """A private Podman API service with the busybox rootfs imported as an image."""
    from sandman_ray.providers.docker import DockerProvider
    from sandman_ray.providers.docker.engine import engine_client
    from sandman_ray.providers.docker.podman_service import PodmanService
    service = PodmanService("/tmp/sandman-ray/bench-podman").start()
    image = args.docker_image
    if image is None:
        image = "localhost/sandman-bench/busybox:1"
        service.import_rootfs(busybox_rootfs(), image)
    provider = DockerProvider(base_url=service.base_url, state_root="/tmp/sandman-ray/bench-docker",
                              cache_root=str(ROOT / ".cache" / "provider")).bind("bench-docker")
    engine = engine_client(service.base_url)

    def pids(info):  # the daemon (the container's PID 1) and its conmon
        state = engine.api.inspect_container(info.details["container"])["State"]
        conmon = state.get("ConmonPid")
        if not conmon:  # (Podman's Docker-compatible API leaves it out: its parent)
            parent = parent_pid(state["Pid"])
            conmon = parent if parent is not None and comm(parent) == "conmon" else None
        return [state["Pid"]] + ([conmon] if conmon else [])
    return provider, SandboxSpec(image=image), pids, service.stop


# local: each sandbox in a user namespace of its own (the default); local-host-root:
# LocalProvider(user_namespaces=False), root inside is host root (what the user
# namespace costs, side by side); local-network: SandboxSpec(network=True), a network
# namespace of its own behind slirp4netns and the filter; local-gvisor:
# LocalProvider(isolation="gvisor")
SETUPS = {"local": local_setup, "docker": docker_setup,
          "local-host-root": lambda args: local_setup(args, user_namespaces=False),
          "local-network": lambda args: local_setup(args, network=True),
          "local-gvisor": lambda args: local_setup(args, isolation="gvisor")}


async def main_async(args):
    results = {}
    for name in args.providers:
        provider, spec, pid_of, teardown = SETUPS[name](args)
        try:
            results[name] = await measure(provider, spec, args, pid_of)
        finally:
            if teardown:
                teardown()
    operations = list(results[args.providers[0]][0])
    header = "%-36s" % "operation" + "".join(
        "%16s %9s %9s" % (name + " p50 ms", "p99 ms", "all s") for name in args.providers)
    print(header)
    for op in operations:
        line = "%-36s" % op
        for name in args.providers:
            p50, p99, wall = results[name][0].get(op, (float("nan"),) * 3)
            line += "%16.1f %9.1f %9s" % (p50 * 1e3, p99 * 1e3,
                                           "%.2f" % wall if wall is not None else "")
        print(line)
    print("%-36s" % "PSS per idle sandbox (MB)" + "".join(
        "%16.1f %19s" % (results[name][1]["pss_kb_per_sandbox"] / 1024, "")
        for name in args.providers))
    if "local" in results and "docker" in results:
        ratio = (results["docker"][1]["create_1"]["p50_ms"]
                 / results["local"][1]["create_1"]["p50_ms"])
        print("docker / local, create -> first exec p50 (1 at once): %.1fx" % ratio)
    print(json.dumps({"bench": "local", "providers": args.providers, "machine": {
        "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": {name: out for name, (_, out) in results.items()}}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--providers", default="local,docker",
                        help="comma-separated, measured one after the other in this run")
    parser.add_argument("--image", default=None, help="LocalProvider image (default: busybox rootfs)")
    parser.add_argument("--docker-image", default=None,
                        help="DockerProvider image (default: the busybox rootfs imported)")
    parser.add_argument("--bursts", default="1,50,200")
    parser.add_argument("--resets", type=int, default=50)
    parser.add_argument("--execs", type=int, default=500, help="exec true on one sandbox")
    parser.add_argument("--creates", type=int, default=20,
                        help="creates one at a time (create -> first exec -> delete)")
    args = parser.parse_args()
    args.bursts = [int(b) for b in args.bursts.split(",")]
    args.providers = [p for p in args.providers.split(",") if p]
    unknown = set(args.providers) - set(SETUPS)
    if unknown:
        parser.error("unknown providers: %s (known: %s)" % (", ".join(sorted(unknown)),
                                                            ", ".join(SETUPS)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main_async(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
