"""Forks against fresh sandboxes (``make bench``'s fork section, or on its own):

    python bench/forks.py [--copies 8] [--rounds 3]

A sandbox of the default image writes 50 MB of new files (200 of 250 KB, random) and
their md5 manifest. Then, in turns for ``--rounds`` rounds:

  fork   ``sandman.fork(sb, copies)``, until every copy answers with the files intact
         (``md5sum -c`` in each, side by side);
  fresh  ``copies`` new sandboxes of the same image (created, not warm: what a fork
         replaces) that each get the same files (``put_archive`` of their tar), until
         every copy answers with them intact.

Each round's copies are released before the next. Reported: the median round of each,
their ratio, the snapshot's size, and the memory-backed disk each way uses while its
copies are leased: for the forks, what the snapshot store's filesystem grew by
(the snapshot, on a tmpfs by default: providers/local/snapshots.py) plus every copy's
own writable layer (a tmpfs each, read from inside: ``stat -f /``); for the fresh
copies, their layers.
"""

import argparse
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sandman_ray as sandman  # noqa: E402
from sandman_ray.providers.local import LocalProvider  # noqa: E402
from sandman_ray.providers.local.provider import DEFAULT_SNAPSHOT_ROOT  # noqa: E402

import progress  # noqa: E402  (bench/progress.py)
from common import run_alone  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILES, FILE_BYTES = 200, 250_000  # 50 MB
WORK = "/work/data"
MAKE_FILES = ("mkdir -p %s && cd %s && for i in $(seq 1 %d); do "
              "head -c %d /dev/urandom > f$i; done && md5sum f* > /work/manifest"
              % (WORK, WORK, FILES, FILE_BYTES))
CHECK = "cd %s && md5sum -c --quiet /work/manifest" % WORK
LAYER_USED = ["stat", "-f", "-c", "%S %b %f", "/"]  # block size, blocks, free: the layer's tmpfs


def fork_vs_fresh(copies: int = 8, rounds: int = 3, state_root: str = "/tmp/sandman-ray/bench-fork",
                  cache_root: str = str(ROOT / ".cache" / "provider")) -> dict:
    pool = "bench-fork-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=LocalProvider(state_root=state_root, cache_root=cache_root),
                        warm={sandman.SandboxSpec(): 1}, max_sandboxes=2 * copies + 4)
    times: Dict[str, List[float]] = {"fork": [], "fresh": [], "fork_leased": [],
                                     "fresh_leased": []}
    sizes: List[int] = []
    disk: Dict[str, List[int]] = {"fork": [], "fresh": []}  # bytes, per round
    try:
        with sandman.sandbox(pool=pool, timeout=120) as parent:
            made = parent.exec(["sh", "-c", MAKE_FILES], timeout=120)
            assert made.exit_code == 0, made
            tar = parent.get_archive(WORK)  # the fresh path's input, read once
            manifest = parent.read_file("/work/manifest")
            # fresh sandboxes ask for what the warm one is not: created for the measure
            fresh_spec = sandman.SandboxSpec(labels={"bench": "fresh"})
            with ThreadPoolExecutor(copies) as threads:
                for _ in progress.steps(range(rounds), "fork rounds"):
                    store = _store_used()
                    _timed(threads, lambda: sandman.fork(parent, copies), times, "fork",
                           lambda handles: _looked_at_forks(pool, handles, store, sizes, disk))
                    _timed(threads, lambda: _fresh(threads, fresh_spec, pool, copies, tar,
                                                   manifest), times, "fresh",
                           lambda handles: disk["fresh"].append(_layers_used(handles)))
    finally:
        sandman.shutdown_pool(pool)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {"copies": copies, "files_mb": FILES * FILE_BYTES / 1e6, "fork_s": median["fork"],
            "fresh_s": median["fresh"], "fresh_over_fork": median["fresh"] / median["fork"],
            "fork_leased_s": median["fork_leased"], "fresh_leased_s": median["fresh_leased"],
            "rounds_s": times, "snapshot_bytes": max(sizes, default=0),
            "fork_disk_bytes": statistics.median(disk["fork"]),
            "fresh_disk_bytes": statistics.median(disk["fresh"]),
            "fork_disk_over_snapshot": statistics.median(disk["fork"]) / max(max(sizes), 1)}


def _store_used() -> int:
    """Bytes in use on the filesystem of the snapshot store (a tmpfs by default)."""
    st = os.statvfs(DEFAULT_SNAPSHOT_ROOT if os.path.exists(DEFAULT_SNAPSHOT_ROOT)
                    else os.path.dirname(DEFAULT_SNAPSHOT_ROOT))
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _layers_used(handles) -> int:
    """Bytes in use in the copies' own writable layers, each read from inside."""
    total = 0
    for sb in handles:
        size, blocks, free = (int(v) for v in sb.exec(LAYER_USED).stdout.split())
        total += (blocks - free) * size
    return total


def _looked_at_forks(pool: str, handles, store_before: int, sizes: List[int],
                     disk: Dict[str, List[int]]) -> None:
    """The snapshot's size, and the disk the forks use: what the store grew by since
    before the fork, and their layers."""
    sizes.extend(s["size_bytes"] for s in sandman.snapshots(pool))
    disk["fork"].append(max(_store_used() - store_before, 0) + _layers_used(handles))


def _fresh(threads, spec, pool: str, copies: int, tar: bytes, manifest: bytes) -> list:
    def one():
        sb = sandman.acquire(spec, pool=pool, timeout=120)
        sb.put_archive(WORK, tar)
        sb.write_file("/work/manifest", manifest)
        return sb
    return [f.result() for f in [threads.submit(one) for _ in range(copies)]]


def _timed(threads, start, times: Dict[str, List[float]], name: str, look=None) -> None:
    """Seconds until ``start()``'s sandboxes are all leased (``<name>_leased``), and
    until they all answer with the files intact (``name``: ``md5sum -c`` of 50 MB in
    each, side by side, ~0.4 s of it on 2 cores); ``look(handles)`` runs before they
    are released."""
    began = time.perf_counter()
    handles = start()
    leased = time.perf_counter() - began
    checks = [threads.submit(sb.exec, ["sh", "-c", CHECK]) for sb in handles]
    results = [c.result() for c in checks]
    took = time.perf_counter() - began
    assert all(r.exit_code == 0 for r in results), [r.stderr[:200] for r in results]
    times[name].append(took)
    times[name + "_leased"].append(leased)
    if look is not None:
        look(handles)
    for sb in handles:
        sandman.release(sb)


def rows(result: dict) -> List[tuple]:
    """make bench's table rows for this section."""
    n, mb = result["copies"], result["files_mb"]
    return [
        ("fork", "fork of a sandbox with %.0f MB of new files into %d, all answering" % (mb, n),
         "%.3f s" % result["fork_s"], "target < 1 s; rounds %s" % ", ".join(
             "%.2f" % s for s in result["rounds_s"]["fork"])),
        ("fork", "%d fresh sandboxes that copy the same files in, all answering" % n,
         "%.3f s" % result["fresh_s"], "rounds %s" % ", ".join(
             "%.2f" % s for s in result["rounds_s"]["fresh"])),
        ("fork", "fresh / fork", "%.2fx" % result["fresh_over_fork"],
         "snapshot %.1f MB" % (result["snapshot_bytes"] / 1e6)),
        ("fork", "of those, until all %d are leased: fork / fresh" % n,
         "%.3f / %.3f s" % (result["fork_leased_s"], result["fresh_leased_s"]),
         "the rest: md5sum -c of %.0f MB in each" % mb),
        ("fork", "disk used while the %d are leased: forks / snapshot" % n,
         "%.2fx" % result["fork_disk_over_snapshot"],
         "target < 2x; forks %.1f MB (store + layers), fresh copies %.1f MB"
         % (result["fork_disk_bytes"] / 1e6, result["fresh_disk_bytes"] / 1e6)),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    return run_alone(lambda: fork_vs_fresh(args.copies, args.rounds), rows, "forks")


if __name__ == "__main__":
    sys.exit(main())
