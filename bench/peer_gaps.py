"""What a peer that is ahead of our comparable level does without, in figures of the
same run (bench/peers.py; our levels taken apart by bench/stages.py and
bench/anatomy.py), and ours less it.

Per peer, figure -> [(what, amount)], the figure one of peers.FIGURES' ``group.key``
or ``pss_kb_per_sandbox`` (amounts in its unit: ms, s or KiB). A burst's figures are
charged a part's CPU (n x its CPU a sandbox / cores) only where the burst kept the
machine's cores busy (BUSY_ENOUGH of them): where it did not, CPU does not say what its
time was, and the row says so instead.
"""

import os
from typing import Dict, List

from stages import DAEMON, span_ms

BUSY_ENOUGH = 0.9  # of the cores' time, during our burst
BURSTS = (("create_burst.usable_50_s", 2), ("create_burst.usable_100_s", 1))  # (n / this)


def _bursts(mine: dict, parts: List[tuple]) -> Dict[str, List[tuple]]:
    """Each burst figure charged ``parts`` ((what, CPU ms a sandbox), ...)."""
    cores, n = os.cpu_count() or 1, mine["create_burst"]["n"]
    busy = mine["anatomy"]["burst_busy_share"]
    out = {}
    for figure, part in BURSTS:
        if busy < BUSY_ENOUGH:
            out[figure] = [("nothing attributable: our burst kept %.0f %% of the cores busy"
                            % (busy * 100), 0.0)]
            continue
        out[figure] = [("%s (its CPU, %d at once on %d cores)" % (what, n // part, cores),
                        cpu_ms * (n // part) / cores / 1e3) for what, cpu_ms in parts]
    return out


def _daemon_memory(mine: dict, s: dict, peer: dict, theirs: str) -> tuple:
    """Our daemon's PSS less that of the peer's own process that stands where it does
    (``theirs``, by name: a sleep; None: all of the peer's, a shell that is all it
    runs)."""
    ours = mine["anatomy"]["pss_kb_by_process"].get(DAEMON)
    if ours is None:
        return ("our daemon's PSS: not measured", 0.0)
    kept = peer.get("pss_kb_by_process", {}).get(theirs, 0.0) if theirs else \
        peer.get("pss_kb_per_sandbox", 0.0)
    theirs = theirs or "own process"
    floor = s["kernel"].get("interpreter_pss_kb")
    return ("a daemon (its PSS %.2f MB, of which a Python interpreter alone %s; less their "
            "%s's %.2f MB)" % (ours / 1024, "%.2f MB" % (floor / 1024) if floor else "?",
                               theirs, kept / 1024), ours - kept)


def _starts(mine: dict, where: str) -> List[tuple]:
    anatomy = mine["anatomy"]
    return [("a daemon (its start %s)" % where, anatomy["daemon_start_ms"]),
            ("a create's check that a command runs (an exec)", mine["exec_true"]["p50_ms"])]


def podman(mine: dict, s: dict, peer: dict) -> Dict[str, List[tuple]]:
    return {"pss_kb_per_sandbox": [_daemon_memory(mine, s, peer, "sleep")]}


def sandlock(mine: dict, s: dict, peer: dict) -> Dict[str, List[tuple]]:
    out = {"create_sequential.p50_ms": _starts(mine, "in our sandbox")}
    binds = span_ms(mine.get("create_stages", {}), "exec bwrap", "exec " + DAEMON)
    if binds is not None:
        out["create_sequential.p50_ms"].append(
            ("bwrap: pid, network, ipc and uts namespaces and binds (its part of a create)",
             binds))
    move = s["kernel"].get("cgroup_v1_move_ms")
    if move:
        out["create_sequential.p50_ms"].append(
            ("cgroups (the launch moved into one v1 group and back)", move))
    parts = [("a daemon's start", mine["anatomy"]["daemon_start_cpu_ms"])]
    if s["kernel"].get("namespaces_cpu_ms"):
        parts.append(("namespaces and binds", s["kernel"]["namespaces_cpu_ms"]))
    out.update(_bursts(mine, parts))
    out["pss_kb_per_sandbox"] = [_daemon_memory(mine, s, peer, None),  # (its shell)
                                 ("bwrap's processes (its namespaces' keepers)",
                                  mine["anatomy"]["pss_kb_by_process"].get("bwrap", 0.0))]
    return out


def gvisor(mine: dict, s: dict, peer: dict) -> Dict[str, List[tuple]]:
    out = {"create_sequential.p50_ms": _starts(mine, "under gVisor")}
    out.update(_bursts(mine, [("a daemon's start", mine["anatomy"]["daemon_start_cpu_ms"])]))
    memory = [("runsc's process, which our launch keeps in the foreground",
               mine["anatomy"]["pss_kb_by_process"].get("runsc", 0.0))]
    # gVisor's /proc has no PSS: the same program's, where the host can read it
    local = s["ours"].get("local", {}).get("anatomy", {}).get("pss_kb_by_process", {})
    if DAEMON in local:
        memory.append(("a daemon, whose memory its sentry holds (the same program's PSS "
                       "at our local level)", local[DAEMON]))
    out["pss_kb_per_sandbox"] = memory
    return out


DOES_WITHOUT = {"podman": podman, "sandlock": sandlock, "gvisor": gvisor}


def less_row(figure_unit: str, ours: float, theirs: float, items: List[tuple]) -> tuple:
    """The row of ours less what the peer does without (``items`` in the figure's own
    unit; KiB for MB figures)."""
    scale = 1 / 1024 if figure_unit == "MB" else 1
    less = ours - sum(amount for _, amount in items) * scale
    said = "; ".join("%s %.2f %s" % (what, amount * scale, figure_unit) if amount else what
                     for what, amount in items)
    if less <= 0:
        note = "not a figure: the parts overlap what they are taken from; without: " + said
    else:
        note = "%.2fx theirs; without: %s" % (less / theirs, said)
    return ("peers", "  ours less what it does without", "%.2f %s" % (less, figure_unit), note)
