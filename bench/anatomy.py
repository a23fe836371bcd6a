"""What a sandbox of ours is made of, and what the kernel charges for parts of it
(bench/peers.py: what a peer that is ahead does without, measured in the same run).

  anatomy          n sandboxes at once, then idle: PSS per sandbox by process, the
                   agent's share, the machine's busy share of cores during the burst
                   (how far CPU explains its time); in one of them the bundle's
                   interpreter and the daemon's program started (time and CPU) and the
                   daemon's memory as the sandbox's own kernel reports it
  cgroup_move_ms   a thread moved into one cgroup v1 group and back
  namespaces_cpu_ms  the CPU of new namespaces and binds alone (bwrap running ``true``)
  interpreter_pss_kb  an idle interpreter of the bundle, 20 at once: any Python
                   daemon's floor
"""

import asyncio
import os
import statistics
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from common import cpu_ticks, ticks_ms  # (bench/common.py)
from local import burst, comm, parent_pid, pss_by_process, pss_of, serving  # (bench/local.py)

INTERPRETER, LAUNCHER = "/.sandman/bin/python3", "/.sandman/bin/sandmand"  # in a sandbox
DAEMON_STATUS = ("for s in /proc/[0-9]*/status; do grep -qx 'Name:.sandmand' $s && "
                 "grep '^Vm' $s; done")  # the daemon's memory, by the sandbox's own /proc


async def _started(client, n: int = 20) -> Dict[str, tuple]:
    """``true``, the interpreter doing nothing and the daemon's program (it imports all it
    runs with, then exits 1 for want of arguments), run in a sandbox in turn ``n``
    times: each one's median time and the machine's busy CPU a run (ms)."""
    runs = {"true": (["true"], 0), "interpreter": ([INTERPRETER, "-IS", "-c", "pass"], 0),
            "daemon": ([INTERPRETER, "-IS", LAUNCHER], 1)}
    times: Dict[str, List[float]] = {name: [] for name in runs}
    busy = dict.fromkeys(runs, 0)
    for _ in range(n):
        for name, (argv, code) in runs.items():
            ticks, t = cpu_ticks(), time.perf_counter()
            ran = await client.exec(argv)
            times[name].append(time.perf_counter() - t)
            busy[name] += cpu_ticks() - ticks
            if ran.exit_code != code:
                raise RuntimeError("%s in the sandbox: %r" % (name, ran))
    return {name: (statistics.median(times[name]) * 1e3, ticks_ms(busy[name]) / n) for name in runs}


async def anatomy(provider, spec, n: int, pid_of) -> dict:
    """``n`` sandboxes of ``spec`` at once, then idle: the PSS per sandbox (KiB) of each
    kind of process that serves them (``pid_of(info)`` and their descendants, by name),
    the share of the agent that started them (the Ray actor that is a launch's parent;
    None where none is), and the machine's busy share of its cores while they started;
    in one of them the interpreter's and the daemon's start less ``true``'s (time and
    CPU) and the daemon's memory (KiB: VmRSS, VmData ...) by the sandbox's /proc."""
    cores = os.cpu_count() or 1
    ticks, began = cpu_ticks(), time.perf_counter()
    results, _ = await burst(provider, spec, n)
    busy = ticks_ms(cpu_ticks() - ticks) / 1e3 / (cores * (time.perf_counter() - began))
    try:
        await asyncio.sleep(1.0)  # start-up settled
        agents = {parent for _, info, _ in results for parent in map(parent_pid, pid_of(info))
                  if parent is not None and comm(parent).startswith("ray::")}
        out = {"pss_kb_by_process": pss_by_process([serving(pid_of(info))
                                                    for _, info, _ in results]),
               "agent_share_kb": sum(pss_of([a]) for a in agents) / n if agents else None,
               "burst_busy_share": busy}
        from sandman_ray import AsyncDaemonClient
        info = results[0][1]
        client = await AsyncDaemonClient.connect(info.address, info.token)
        try:
            started = await _started(client)
            status = (await client.exec(["sh", "-c", DAEMON_STATUS])).stdout.decode()
        finally:
            client.close()
        for name in ("interpreter", "daemon"):  # less what running any command costs
            out[name + "_start_ms"] = started[name][0] - started["true"][0]
            out[name + "_start_cpu_ms"] = started[name][1] - started["true"][1]
        out["daemon_kb_inside"] = {line.split(":")[0]: int(line.split()[1])
                                   for line in status.splitlines()
                                   if len(line.split()) == 3 and line.split()[1].isdigit()}
        return out
    finally:
        await asyncio.gather(*(provider.delete(r[0]) for r in results))


def cgroup_move_ms(reps: int = 20) -> Optional[float]:
    """The median time to move this thread into one new cgroup v1 group of the ``pids``
    controller and back (None where the host has no such hierarchy or refuses)."""
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "tasks").exists():
        return None
    group = root / ("sandman-bench-%s" % uuid.uuid4().hex[:8])
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
                .splitlines() if line.split(":")[1] == "pids"), "/")
    home = root / own.lstrip("/") / "tasks"
    tid = str(threading.get_native_id())
    times = []
    try:
        group.mkdir()
        for _ in range(reps):
            time.sleep(0.05)  # apart, as creates are (a grace period just past is free)
            t = time.perf_counter()
            try:
                (group / "tasks").write_text(tid)
            finally:
                home.write_text(tid)
            times.append(time.perf_counter() - t)
    except OSError:
        return None
    finally:
        try:
            group.rmdir()
        except OSError:
            pass
    return statistics.median(times) * 1e3


def namespaces_cpu_ms(rootfs: Path, reps: int = 50) -> float:
    """The machine's busy CPU (ms) of new namespaces and binds alone: ``true`` run by
    bwrap in new user, mount, pid, ipc, uts and network namespaces (the image read-only,
    /proc, /dev, a tmpfs /tmp) less ``true`` run plainly, in turn, a run each."""
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
             "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
             "--tmpfs", "/tmp", "--", "/bin/true"]
    busy = {"plain": 0, "bwrap": 0}
    for _ in range(reps):
        for name, argv in (("plain", [str(rootfs / "bin" / "true")]), ("bwrap", bwrap)):
            ticks = cpu_ticks()
            subprocess.run(argv, check=True)
            busy[name] += cpu_ticks() - ticks
    return ticks_ms(busy["bwrap"] - busy["plain"]) / reps


def interpreter_pss_kb(bundle: Path, n: int = 20) -> float:
    """The PSS (KiB) of each of ``n`` idle interpreters of the daemon bundle at once
    (sharing their libraries as the daemons of ``n`` sandboxes do): what any daemon in
    Python holds before its first import."""
    argv = [str(bundle / "lib" / "ld-linux-x86-64.so.2"), "--library-path",
            str(bundle / "lib"), str(bundle / "bin" / "python3"), "-IS", "-c",
            "import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()"]
    idle: List[subprocess.Popen] = []
    try:
        for _ in range(n):
            idle.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        for proc in idle:
            proc.stdout.readline()  # started
        return pss_of([proc.pid for proc in idle]) / n
    finally:
        for proc in idle:
            proc.kill()
            proc.wait()
