"""The stream section of bench/run_all.py: MB/s of ``cat`` of a 100 MB file through
``sb.exec_stream``, directly and through ``.remote()``, and the daemon's RSS growth
while a reader stops."""

import statistics
import time
import uuid
from typing import Dict, List

import ray

import sandman_ray as sandman
from sandman_ray import ExecResult

from common import provider

STREAM_MB = 100


def stream(image: str, rounds: int = 3) -> dict:
    """MB/s of ``cat`` of a 100 MB file in the sandbox through ``sb.exec_stream``,
    directly and through ``.remote()`` (a Ray streaming generator), in turns; and how
    much the daemon's RSS grows while a reader stops reading (on each path: the
    command's writes stall, nothing piles up)."""
    pool = "bench-stream-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: 1})
    rates: Dict[str, List[float]] = {"direct": [], ".remote()": []}
    growth: Dict[str, float] = {}
    try:
        with sandman.sandbox(image, pool=pool, timeout=120) as sb:
            assert sb.exec("head -c %d /dev/zero > /tmp/big" % (STREAM_MB << 20)).ok
            paths = {"direct": lambda: sb.exec_stream("cat /tmp/big"),
                     ".remote()": lambda: (ray.get(ref) for ref in
                                           sb.exec_stream.remote("cat /tmp/big"))}
            for _ in range(rounds):
                for name, start in paths.items():
                    t, got = time.perf_counter(), 0
                    for item in start():
                        if not isinstance(item, ExecResult):
                            got += len(item[1])
                    assert got == STREAM_MB << 20, got
                    rates[name].append(got / 1e6 / (time.perf_counter() - t))
            for name in paths:
                growth[name] = _stalled_growth_mb(sb, name)
    finally:
        sandman.shutdown_pool(pool)
    return {"mb_per_s": {name: statistics.median(v) for name, v in rates.items()},
            "rounds_mb_per_s": rates, "rss_growth_mb_reader_stopped": growth}


def _daemon_rss_kib(sb) -> int:
    """The RSS of the sandbox's daemon (PID 1 in its pid namespace)."""
    status = sb.read_file("/proc/1/status").decode()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _stalled_growth_mb(sb, path: str) -> float:
    """Start a stream on ``path``, read two chunks, stop reading; once ``cat`` writes no
    more (its written bytes unchanged over a second), how much the daemon grew (MB)."""
    before = _daemon_rss_kib(sb)
    if path == "direct":
        items = sb.exec_stream("cat /tmp/big")
        next(items), next(items)
    else:
        items = sb.exec_stream.remote("cat /tmp/big")
        ray.get(next(items)), ray.get(next(items))
    pid = int(sb.exec("pidof cat").stdout.split()[0])
    written, still = -1, 0
    while still < 10:
        now = int(sb.read_file("/proc/%d/io" % pid).split(b"wchar:")[1].split()[0])
        still = still + 1 if now == written else 0
        written = now
        time.sleep(0.1)  # a pace to look at the writer, not a wait for an event
    grown = (_daemon_rss_kib(sb) - before) / 1024
    items.close() if path == "direct" else items.cancel()
    return grown


def rows(st: dict) -> List[tuple]:
    rows = []
    for name, rate in st["mb_per_s"].items():
        rows.append(("stream", "cat of %d MB through exec_stream, %s" % (STREAM_MB, name),
                     "%.0f MB/s" % rate, "target >= %d MB/s; rounds %s" % (
                         200 if name == "direct" else 50,
                         ", ".join("%.0f" % r for r in st["rounds_mb_per_s"][name]))))
    for name, grown in st["rss_growth_mb_reader_stopped"].items():
        rows.append(("stream", "daemon RSS growth while the reader stops, %s" % name,
                     "%.1f MB" % grown, "target < 32 MB"))
    return rows
