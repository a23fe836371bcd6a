"""Where one create's time goes, moment by moment (bench/peers.py's rows of our levels).

``create_stages``: creates one at a time, each then its first ``exec true``; the
moments the kernel saw each program of the sandbox's launch start (its tracepoints
``sched_process_exec`` and ``sched_process_fork``, read from a tracefs instance of our
own, clocked by CLOCK_MONOTONIC like the caller), from the create's call: each
moment's median, and each create's own moments for the spans between them.
"""

import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

TRACEFS = Path("/sys/kernel/tracing")
DAEMON = "sandmand"  # the name the daemon runs as
FIRST_COMMAND = "%s's first command" % DAEMON
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
        for stale in (TRACEFS / "instances").glob("sandman-bench-*"):  # of a killed run
            if not Path("/proc", stale.name.rsplit("-", 1)[1]).exists():
                stale.rmdir()
        self.dir.mkdir()
        try:
            (self.dir / "trace_clock").write_text("mono")
            (self.dir / "buffer_size_kb").write_text("4096")
            for event in EVENTS:
                (self.dir / "events" / event / "enable").write_text("1")
            (self.dir / "tracing_on").write_text("1")
        except BaseException:
            self.dir.rmdir()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            (self.dir / "tracing_on").write_text("0")
        finally:
            self.dir.rmdir()  # (the kernel frees the instance and its buffer)

    def events(self) -> List[Tuple[float, str, int, Dict[str, str]]]:
        """The events so far; an error if the buffer lost any (it wrapped)."""
        for stats in (self.dir / "per_cpu").glob("cpu*/stats"):
            if any(line.startswith("overrun:") and line.split()[1] != "0"
                   for line in stats.read_text().splitlines()):
                raise RuntimeError("tracefs %s: events were lost (%s)" % (self.dir, stats))
        out = []
        for line in (self.dir / "trace").read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m:
                fields = dict(kv.split("=", 1) for kv in m.group("rest").split() if "=" in kv)
                out.append((float(m.group("ts")), m.group("event"), int(m.group("pid")), fields))
        return out


def _moments(events, start: float, end: float, root: int) -> Dict[str, float]:
    """The moments (s from ``start``) the launch rooted at pid ``root`` started each of
    its programs (the first exec of each name), and the daemon its first command (its
    first child that ran a program: not a thread of its own)."""
    tree, names, out = {root}, {}, {}
    forked: Dict[int, float] = {}  # the daemon's children: when each was made
    for ts, event, pid, fields in events:
        if not start <= ts <= end:
            continue
        if event == "sched_process_fork":
            parent, child = int(fields.get("pid", pid)), int(fields["child_pid"])
            if parent in tree:
                tree.add(child)
                names[child] = names.get(parent)
                if names.get(parent) == DAEMON:
                    forked[child] = ts
        elif event == "sched_process_exec" and pid in tree:
            if pid in forked and FIRST_COMMAND not in out:
                out[FIRST_COMMAND] = forked[pid] - start
            names[pid] = os.path.basename(fields.get("filename", "?"))
            out.setdefault("exec " + names[pid], ts - start)
    return out


async def create_stages(provider, spec, n: int, chain_pid) -> dict:
    """``n`` creates of ``spec`` one at a time, each then its first ``exec true``:
    ``stages_ms``, the median moment of each stage (ms from the create's call) that
    every create had, in order, the whole's last; ``each_ms``, every create's own.
    ``chain_pid(info)``: the pid the launch ran as."""
    from local import create_and_exec  # (bench/local.py)
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
    each = []
    for started, ended, root in windows:
        moments = {name: at * 1e3 for name, at in _moments(events, started, ended, root).items()}
        moments["first exec answered"] = (ended - started) * 1e3
        each.append(moments)
    common = [name for name in each[0] if all(name in m for m in each)]
    stages = sorted(((name, statistics.median(m[name] for m in each)) for name in common),
                    key=lambda kv: kv[1])
    return {"stages_ms": stages, "each_ms": each, "samples": n}


def span_ms(stages: dict, first: str, then: str) -> Optional[float]:
    """The median over creates of each one's time from moment ``first`` to ``then``
    (create_stages' output), where every create had both."""
    each = stages.get("each_ms", [])
    spans = [m[then] - m[first] for m in each if first in m and then in m]
    return statistics.median(spans) if each and len(spans) == len(each) else None
