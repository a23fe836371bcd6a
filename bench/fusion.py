"""SandboxFusion's ``/run_code`` on the service beside the machine's limit, in one run.

A python program that prints (``print("hello")``), posted to ``sandman serve``'s
``/fusion/<key>/run_code`` (service/fusion.py: each request a sandbox of builtin:code
lent for it alone, then renewed: service/fusion_leases.py) one at a time (p50) and 64 at once (requests a second),
beside the same program run by a plain ``subprocess`` on the host, with no sandbox, at
the same concurrency: what the machine can do at all. Issue 50's target: ``/run_code``
at 64 at once >= 0.8x that limit. Beside them, the floors: of a served design (the
same requests to a minimal HTTP server that runs each program on the host, with no
sandbox: ``http_floor.c``, native, and ``http_floor.py``, asyncio), of the HTTP client
(its CPU a request), and of a fresh sandbox per request (the program in namespaces
bwrap makes for it alone, nothing else of a sandbox; the CPU of one renew of ours).

    python bench/fusion.py [--n 200] [--burst 1280]     (or make bench: its service section)
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterator, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import (  # noqa: E402
    CACHE, cpu_ticks, pct, process_cpu_s, provider, run_alone, ticks_ms)

PROGRAM = 'print("hello")'
AT_ONCE = 64
ROUNDS = 5  # of the rates at 64, each way in turn (its median is reported)


def poster(endpoint: str) -> Callable[[], None]:
    body = json.dumps({"code": PROGRAM, "language": "python", "run_timeout": 10}).encode()

    def call() -> None:
        request = urllib.request.Request(endpoint + "/run_code", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            verdict = json.loads(answer.read())
        if verdict["status"] != "Success" or verdict["run_result"]["stdout"] != "hello\n":
            raise RuntimeError("run_code: %r" % verdict)
    return call


def on_host() -> None:
    ran = subprocess.run(["/usr/bin/python3", "-c", PROGRAM], capture_output=True,
                         timeout=60)  # the interpreter the sandbox runs: Debian's
    if ran.stdout != b"hello\n":
        raise RuntimeError("python on the host: %r" % (ran,))


@contextlib.contextmanager
def http_floor(native: bool = False) -> Iterator[str]:
    """A minimal server of /run_code with no sandbox, in processes of its own: its URL.
    bench/http_floor.py (asyncio), or with ``native`` bench/http_floor.c (compiled
    here with gcc: prefork workers, posix_spawn, nothing else)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="sandman-http-floor-") as work:
        if native:
            binary = os.path.join(work, "http_floor")
            subprocess.run(["gcc", "-O2", "-o", binary, str(Path(__file__).parent /
                                                           "http_floor.c")], check=True)
            argv = [binary, str(port), work]
        else:
            argv = [sys.executable, str(Path(__file__).parent / "http_floor.py"), str(port)]
        server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("%s did not start" % argv[0])
            yield "http://127.0.0.1:%d" % port
        finally:
            server.kill()  # (the native server's workers die with it)
            server.wait()


def in_fresh_namespaces() -> Callable[[], None]:
    """The same program in namespaces made for it alone by bwrap and gone with it (user,
    mount, pid, ipc, uts, network; builtin:code's files read-only, a tmpfs /tmp): the
    cheapest fresh sandbox per request there is, with no writable layer, seccomp
    filter, cgroup, daemon or HTTP in its path, which every sandbox of ours has."""
    from sandman_ray.images import ImageCache
    rootfs = ImageCache(Path(CACHE) / "images").prepare("builtin:code").rootfs
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--",
            "python3", "-c", PROGRAM]

    def call() -> None:
        ran = subprocess.run(argv, capture_output=True, timeout=60)
        if ran.stdout != b"hello\n":
            raise RuntimeError("python in bwrap: %r" % (ran,))
    return call


def one_at_a_time(call: Callable[[], None], n: int) -> List[float]:
    for _ in range(10):
        call()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        out.append(time.perf_counter() - started)
    return out


def at_once(call: Callable[[], None], n: int) -> dict:
    """Requests a second, ``n`` of them ``AT_ONCE`` at a time; the machine's busy CPU per
    request and this process's (the caller's: an HTTP client, or the host's spawns)."""
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        list(pool.map(lambda _: call(), range(AT_ONCE)))  # threads and sandboxes warm
        ticks, own, started = cpu_ticks(), process_cpu_s(os.getpid()), time.perf_counter()
        list(pool.map(lambda _: call(), range(n)))
        took = time.perf_counter() - started
        return {"per_s": n / took,
                "cpu_ms": ticks_ms(cpu_ticks() - ticks) / n,
                "caller_cpu_ms": (process_cpu_s(os.getpid()) - own) * 1e3 / n}


def busy_ms_each(call: Callable[[], object], n: int) -> float:
    """The machine's busy CPU (every process's) per call, in ms, over ``n`` calls."""
    before = cpu_ticks()
    call_n = [call() for _ in range(n)]
    del call_n
    return ticks_ms(cpu_ticks() - before) / n


def reset_floor(n: int = 100) -> dict:
    """The floor of a fresh sandbox per request: the machine's CPU of one renew of a
    builtin:code sandbox at its node's agent, asked on its control socket with the
    lease's token as the service asks it after each program (no pool, service or Ray
    call in its path), beside the CPU of the program run on the host."""
    import asyncio
    from local import create_and_exec
    from sandman_ray import control
    from sandman_ray.names import NAMESPACE
    from sandman_ray.spec import SandboxSpec
    prov = provider().bind("bench-fusion-floor-" + uuid.uuid4().hex[:6])

    async def measure():
        import ray
        sandbox_id, info, _ = await create_and_exec(prov, SandboxSpec(image="builtin:code"))
        token = info.token
        try:
            agent = ray.get_actor(prov.controller(info.node_id), namespace=NAMESPACE)
            path = await agent.control_address.remote()

            async def renew() -> None:
                nonlocal token
                renewed = await control.renew_async(path, sandbox_id, token)
                if renewed is None:
                    raise RuntimeError("sandbox %s was not renewed" % sandbox_id)
                token = renewed["token"]
            for _ in range(5):
                await renew()
            before, each = cpu_ticks(), process_ticks()
            for _ in range(n):
                await renew()
            after, each_after = cpu_ticks(), process_ticks()
        finally:
            await prov.delete(sandbox_id)
        by_name: dict = {}
        for pid, (name, ticks) in each_after.items():  # (the children they reaped count)
            if pid in each and pid != "1":  # (the host's init reaps whatever orphans)
                by_name[name] = by_name.get(name, 0) + ticks - each[pid][1]
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
        return ticks_ms(after - before) / n, {name: ticks_ms(ticks) / n for name, ticks in top}
    reset_ms, by_process = asyncio.run(measure())
    program_ms = busy_ms_each(on_host, n)
    return {"reset_cpu_ms": reset_ms, "program_cpu_ms": program_ms,
            "reset_cpu_ms_by_process": by_process,
            "most_over_host": program_ms / (program_ms + reset_ms)}


def process_ticks() -> dict:
    """pid -> (its name, CPU ticks of it and of the children it reaped), every process."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (stat[stat.index("(") + 1:stat.rindex(")")],
                    sum(int(v) for v in fields[11:15]))
    return out


def fusion(n: int = 200, burst: int = 1280) -> dict:
    """``n`` one at a time and ``burst`` 64 at once, each way, in ROUNDS turns."""
    import service
    with service.served({"builtin:code": AT_ONCE}, AT_ONCE + 4) as (pool, urls, keys), \
            http_floor() as floor_url, http_floor(native=True) as native_url:
        service.wait_for(lambda: service.states(pool)["ready"] >= AT_ONCE,
                         "%d warm sandboxes" % AT_ONCE)
        ways = {"run_code": poster("%s/fusion/%s" % (urls["url"], keys[0])), "host": on_host,
                "http_floor": poster(floor_url), "native_floor": poster(native_url),
                "fresh_namespaces": in_fresh_namespaces()}
        single = {name: one_at_a_time(call, n) for name, call in ways.items()}
        # short rounds, each way in turn, the order reversed every round: the machine's
        # speed drifts within a minute, and each way's median round meets it alike
        rates: Dict[str, List[dict]] = {name: [] for name in ways}
        order = list(ways)
        for _ in range(ROUNDS):
            for name in order:
                rates[name].append(at_once(ways[name], max(AT_ONCE, burst // ROUNDS)))
            order.reverse()
    best = {name: sorted(runs, key=lambda r: r["per_s"])[len(runs) // 2]
            for name, runs in rates.items()}  # the median round
    out = {name: {"p50_ms": pct(single[name], 0.5) * 1e3, "p99_ms": pct(single[name], 0.99) * 1e3,
                  "per_s_at_64": best[name]["per_s"],
                  "rounds_per_s": [r["per_s"] for r in rates[name]],
                  "cpu_ms_each_at_64": best[name]["cpu_ms"],
                  "caller_cpu_ms_each_at_64": best[name]["caller_cpu_ms"]}
           for name in ways}
    out["run_code_over_host_at_64"] = out["run_code"]["per_s_at_64"] / out["host"]["per_s_at_64"]
    out["fresh_namespaces_over_host_at_64"] = (out["fresh_namespaces"]["per_s_at_64"] /
                                               out["host"]["per_s_at_64"])
    for floor in ("http_floor", "native_floor"):
        out[floor + "_over_host_at_64"] = out[floor]["per_s_at_64"] / out["host"]["per_s_at_64"]
    # a served design pays the client's HTTP where the host's caller spawned: at best
    # the host's CPU less its caller's, plus the client's (a server's own work >= 0)
    host_cpu, spawn = out["host"]["cpu_ms_each_at_64"], out["host"]["caller_cpu_ms_each_at_64"]
    client = out["http_floor"]["caller_cpu_ms_each_at_64"]
    out["served_bound_over_host"] = host_cpu / (host_cpu - spawn + client)
    out["reset_floor"] = reset_floor()
    return out


def rows(s: dict) -> List[tuple]:
    rc, host = s["run_code"], s["host"]
    return [("fusion", "/run_code python print, one at a time: p50 (host's)",
             "%.1f ms" % rc["p50_ms"], "host subprocess %.1f ms" % host["p50_ms"]),
            ("fusion", "/run_code at 64 at once: requests a second",
             "%.0f /s" % rc["per_s_at_64"],
             "%.2fx the host's %.0f /s (target >= 0.8x)" % (s["run_code_over_host_at_64"],
                                                          host["per_s_at_64"]))] + (
        [("fusion", "  the same to a minimal asyncio HTTP server, no sandbox: at 64",
          "%.0f /s" % s["http_floor"]["per_s_at_64"],
          "%.2fx the host's: an asyncio server's floor" % s["http_floor_over_host_at_64"])]
        if "http_floor" in s else []) + (
        [("fusion", "  the same to a minimal native HTTP server, no sandbox: at 64",
          "%.0f /s" % s["native_floor"]["per_s_at_64"],
          "%.2fx the host's: a served design's floor" % s["native_floor_over_host_at_64"])]
        if "native_floor" in s else []) + (
        [("fusion", "  the HTTP client's CPU a request (the host's caller: its spawn)",
          "%.1f ms (%.1f ms)" % (s["http_floor"]["caller_cpu_ms_each_at_64"],
                                 s["host"]["caller_cpu_ms_each_at_64"]),
          "any served design: at most %.2fx the host's" % s["served_bound_over_host"])]
        if "served_bound_over_host" in s else []) + (
        [("fusion", "  the same in namespaces of its own (bwrap, no more): at 64",
          "%.0f /s" % s["fresh_namespaces"]["per_s_at_64"],
          "%.2fx the host's: a fresh sandbox per request's floor"
          % s["fresh_namespaces_over_host_at_64"])] if "fresh_namespaces" in s else []) + (
        [("fusion", "  the floor of a reset per request: CPU of a renew, of the program",
          "%.1f ms, %.1f ms" % (s["reset_floor"]["reset_cpu_ms"],
                                s["reset_floor"]["program_cpu_ms"]),
          "at most %.2fx the host's while a reset costs this"
          % s["reset_floor"]["most_over_host"]),
         ("fusion", "  a renew's CPU by process",
          ", ".join("%s %.1f" % kv for kv in
                    s["reset_floor"].get("reset_cpu_ms_by_process", {}).items()), "ms")]
        if "reset_floor" in s else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--burst", type=int, default=1280)
    args = parser.parse_args()
    return run_alone(lambda: fusion(args.n, args.burst), rows, "fusion")

if __name__ == "__main__":
    sys.exit(main())
