"""Where one create's time goes, and what a sandbox's memory is, stage by stage.

Used by bench/peers.py to say, with figures of the same run, what a peer that is ahead
of one of our levels does without:

  create_stages   one create at a time, then its first ``exec true``: the moments the
                  kernel saw each program of the sandbox's launch start (its tracepoints
                  ``sched_process_exec`` and ``sched_process_fork``, read from a tracefs
                  instance of our own, clocked by CLOCK_MONOTONIC like the caller): the
                  median of each moment from the create's call, over --creates
  cgroup_move_ms  what the kernel takes to move a thread into a cgroup v1 group and back
                  (a launch's first process starts in the sandbox's groups that way)
  interpreter     the daemon bundle's interpreter doing nothing, 20 at once: its PSS
                  (KiB), the floor of any daemon written in Python
"""

import asyncio
import os
import re
import statistics
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

TRACEFS = Path("/sys/kernel/tracing")
DAEMON = "sandmand"  # the name the daemon runs as
INTERPRETER, LAUNCHER = "/.sandman/bin/python3", "/.sandman/bin/sandmand"  # in a sandbox
EVENTS = ("sched/sched_process_exec", "sched/sched_process_fork")
_LINE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[\d+\]\s+\S+\s+(?P<ts>[\d.]+): "
                   r"(?P<event>sched_process_\w+): (?P<rest>.*)$")


class ExecTrace:
    """A tracefs instance that records every exec and fork on the machine, its clock
    CLOCK_MONOTONIC; ``events()``: (seconds, event, pid, fields) in order."""

    def __init__(self):
        self.dir = TRACEFS / "instances" / ("sandman-bench-%d" % os.getpid())

    def __enter__(self) -> "ExecTrace":
        if not (TRACEFS / "instances").is_dir():
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=True,
                           capture_output=True)
        self.dir.mkdir()
        (self.dir / "trace_clock").write_text("mono")
        (self.dir / "buffer_size_kb").write_text("4096")
        for event in EVENTS:
            (self.dir / "events" / event / "enable").write_text("1")
        (self.dir / "tracing_on").write_text("1")
        return self

    def __exit__(self, *exc) -> None:
        (self.dir / "tracing_on").write_text("0")
        self.dir.rmdir()  # (the kernel frees the instance and its buffer)

    def events(self) -> List[Tuple[float, str, int, Dict[str, str]]]:
        out = []
        for line in (self.dir / "trace").read_text().splitlines():
            m = _LINE.match(line)
            if m:
                fields = dict(kv.split("=", 1) for kv in m.group("rest").split() if "=" in kv)
                out.append((float(m.group("ts")), m.group("event"), int(m.group("pid")), fields))
        return out


def _moments(events, start: float, end: float, root: int) -> Dict[str, float]:
    """The moments (s from ``start``) the launch rooted at pid ``root`` started each of
    its programs (the first exec of each name) and its daemon its first command."""
    tree, names, out = {root}, {}, {}
    for ts, event, pid, fields in events:
        if not start <= ts <= end:
            continue
        if event == "sched_process_fork":
            parent = int(fields.get("pid", pid))
            if parent in tree:
                tree.add(int(fields["child_pid"]))
                names[int(fields["child_pid"])] = names.get(parent)
                if names.get(parent) == DAEMON:
                    out.setdefault("%s's first command" % DAEMON, ts - start)
        elif event == "sched_process_exec" and pid in tree:
            names[pid] = os.path.basename(fields.get("filename", "?"))
            out.setdefault("exec " + names[pid], ts - start)
    return out


async def create_stages(provider, spec, n: int, chain_pid) -> dict:
    """``n`` creates of ``spec`` one at a time, each then its first ``exec true``: the
    median moment of each stage (ms from the create's call), in order, and the median
    of the whole. ``chain_pid(info)``: the pid the launch ran as (its daemon's parent
    or itself)."""
    from local import create_and_exec  # noqa: E402  (bench/local.py)
    windows = []
    sandbox_id, _, _ = await create_and_exec(provider, spec)  # warm: image, bundle, agent
    await provider.delete(sandbox_id)
    with ExecTrace() as trace:
        for _ in range(n):
            started = time.monotonic()
            sandbox_id, info, _ = await create_and_exec(provider, spec)
            ended = time.monotonic()
            windows.append((started, ended, chain_pid(info)))
            await provider.delete(sandbox_id)
        events = trace.events()
    seen: Dict[str, List[float]] = {}
    for started, ended, root in windows:
        for name, at in _moments(events, started, ended, root).items():
            seen.setdefault(name, []).append(at)
    # a stage every create had, at its median moment, in order
    stages = sorted(((name, statistics.median(ats) * 1e3) for name, ats in seen.items()
                     if len(ats) == len(windows)), key=lambda kv: kv[1])
    total = statistics.median(ended - started for started, ended, _ in windows) * 1e3
    return {"stages_ms": stages + [("first exec answered", total)], "samples": n}


def cgroup_move_ms(reps: int = 20) -> Optional[float]:
    """The median time to move this thread into a new cgroup v1 group of the ``pids``
    controller and back (None where the host has no such hierarchy or refuses)."""
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "tasks").exists():
        return None
    group = root / ("sandman-bench-%s" % uuid.uuid4().hex[:8])
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
                .splitlines() if line.split(":")[1] == "pids"), "/")
    tid = str(threading.get_native_id())
    times = []
    try:
        group.mkdir()
        for _ in range(reps):
            time.sleep(0.05)  # apart, as creates are (a grace period just past is free)
            t = time.perf_counter()
            (group / "tasks").write_text(tid)
            (root / own.lstrip("/") / "tasks").write_text(tid)
            times.append(time.perf_counter() - t)
    except OSError:
        return None
    finally:
        try:
            group.rmdir()
        except OSError:
            pass
    return statistics.median(times) * 1e3


def interpreter_pss_kb(bundle: Path, n: int = 20) -> float:
    """The PSS (KiB) of each of ``n`` idle interpreters of the daemon bundle at once
    (sharing their libraries as the daemons of ``n`` sandboxes do): what any daemon in
    Python holds before its first import."""
    from local import pss_of  # noqa: E402
    argv = [str(bundle / "lib" / "ld-linux-x86-64.so.2"), "--library-path",
            str(bundle / "lib"), str(bundle / "bin" / "python3"), "-IS", "-c",
            "import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()"]
    idle = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for _ in range(n)]
    try:
        for proc in idle:
            proc.stdout.readline()  # started
        return pss_of([proc.pid for proc in idle]) / n
    finally:
        for proc in idle:
            proc.stdin.close()
            proc.wait()


def _comm(pid: int) -> str:
    try:
        return Path("/proc/%d/comm" % pid).read_text().strip()
    except OSError:
        return "?"


def _parent(pid: int) -> Optional[int]:
    try:
        stat = Path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


async def _exec_times(client, name: str, argv: List[str], code: int, n: int = 20):
    """The median time (ms) of ``argv`` run in a sandbox, and the machine's busy CPU
    (ms) a run, over ``n`` runs one after another."""
    from common import cpu_ticks  # noqa: E402  (bench/common.py)
    times = []
    busy = cpu_ticks()
    for _ in range(n):
        t = time.perf_counter()
        ran = await client.exec(argv)
        times.append(time.perf_counter() - t)
        if ran.exit_code != code:
            raise RuntimeError("%s in the sandbox: %r" % (name, ran))
    cpu = (cpu_ticks() - busy) * 1e3 / os.sysconf("SC_CLK_TCK") / n
    return statistics.median(times) * 1e3, cpu


async def anatomy(provider, spec, n: int, pid_of) -> dict:
    """``n`` sandboxes of ``spec`` at once, then idle: the PSS per sandbox (KiB) of
    each kind of process that serves them (``pid_of(info)`` and their descendants, by
    name), and the share of the agent that started them (the parent of a launch that
    a Ray actor started); and, in one of them, the daemon bundle's interpreter's start
    and the daemon's program (its imports, then an exit for want of arguments), each
    less ``true``'s: what a daemon in Python costs to start at this level, in time and
    in the machine's CPU."""
    from local import burst, pss_of, serving  # noqa: E402
    from sandman_ray import AsyncDaemonClient
    results, _ = await burst(provider, spec, n)
    try:
        await asyncio.sleep(1.0)  # start-up settled
        by_name: Dict[str, int] = {}
        agents = set()
        for _, info, _ in results:
            for each in serving(pid_of(info)):
                name = _comm(each)
                by_name[name] = by_name.get(name, 0) + pss_of([each])
            for pid in pid_of(info):
                parent = _parent(pid)
                if parent is not None and _comm(parent).startswith("ray::"):
                    agents.add(parent)
        out = {"pss_kb_by_process": {name: kb / n for name, kb in sorted(by_name.items())},
               "agent_share_kb": sum(pss_of([a]) for a in agents) / n if agents else None}
        info = results[0][1]
        client = await AsyncDaemonClient.connect(info.address, info.token)
        try:
            timed = {}
            # the daemon's program without arguments: it imports all it runs with, then
            # exits 1 saying what it lacks
            for name, argv, code in (("true", ["true"], 0),
                                     ("interpreter", [INTERPRETER, "-IS", "-c", "pass"], 0),
                                     ("daemon", [INTERPRETER, "-IS", LAUNCHER], 1)):
                timed[name] = await _exec_times(client, name, argv, code)
        finally:
            client.close()
        for name in ("interpreter", "daemon"):  # less what running any command costs
            out[name + "_start_ms"] = timed[name][0] - timed["true"][0]
            out[name + "_start_cpu_ms"] = timed[name][1] - timed["true"][1]
        return out
    finally:
        await asyncio.gather(*(provider.delete(r[0]) for r in results))


def namespaces_cpu_ms(rootfs: Path, reps: int = 50) -> float:
    """The machine's busy CPU (ms) of a sandbox's namespaces and mounts alone: ``true``
    run by bwrap in new user, mount, pid, ipc, uts and network namespaces (the image
    read-only, /proc, /dev, a tmpfs /tmp) less ``true`` run plainly, a run each."""
    from common import cpu_ticks  # noqa: E402
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
             "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
             "--tmpfs", "/tmp", "--", "/bin/true"]
    busy = {}
    for name, argv in (("plain", [str(rootfs / "bin" / "true")]), ("bwrap", bwrap)):
        before = cpu_ticks()
        for _ in range(reps):
            subprocess.run(argv, check=True)
        busy[name] = (cpu_ticks() - before) * 1e3 / os.sysconf("SC_CLK_TCK") / reps
    return busy["bwrap"] - busy["plain"]
