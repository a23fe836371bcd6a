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
their ratio, and the snapshot's size. The LocalProvider keeps snapshots on a tmpfs by
default (providers/local/snapshots.py).
"""

import argparse
import json
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sandman_ray as sandman  # noqa: E402
from sandman_ray.providers.local import LocalProvider  # noqa: E402

import progress  # noqa: E402  (bench/progress.py)

ROOT = Path(__file__).resolve().parent.parent
FILES, FILE_BYTES = 200, 250_000  # 50 MB
WORK = "/work/data"
MAKE_FILES = ("mkdir -p %s && cd %s && for i in $(seq 1 %d); do "
              "head -c %d /dev/urandom > f$i; done && md5sum f* > /work/manifest"
              % (WORK, WORK, FILES, FILE_BYTES))
CHECK = "cd %s && md5sum -c --quiet /work/manifest" % WORK


def fork_vs_fresh(copies: int = 8, rounds: int = 3, state_root: str = "/tmp/sandman-ray/bench-fork",
                  cache_root: str = str(ROOT / ".cache" / "provider")) -> dict:
    pool = "bench-fork-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=LocalProvider(state_root=state_root, cache_root=cache_root),
                        warm={sandman.SandboxSpec(): 1}, max_sandboxes=2 * copies + 4)
    times: Dict[str, List[float]] = {"fork": [], "fresh": [], "fork_leased": [],
                                     "fresh_leased": []}
    sizes: List[int] = []
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
                    _timed(threads, lambda: sandman.fork(parent, copies), times, "fork",
                           lambda: sizes.extend(s["size_bytes"] for s in sandman.snapshots(pool)))
                    _timed(threads, lambda: _fresh(threads, fresh_spec, pool, copies, tar,
                                                   manifest), times, "fresh")
    finally:
        sandman.shutdown_pool(pool)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {"copies": copies, "files_mb": FILES * FILE_BYTES / 1e6, "fork_s": median["fork"],
            "fresh_s": median["fresh"], "fresh_over_fork": median["fresh"] / median["fork"],
            "fork_leased_s": median["fork_leased"], "fresh_leased_s": median["fresh_leased"],
            "rounds_s": times, "snapshot_bytes": max(sizes, default=0)}


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
    each, side by side, ~0.4 s of it on 2 cores); ``look()`` runs before they are
    released."""
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
        look()
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
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench", log_to_driver=False)
    try:
        result = fork_vs_fresh(args.copies, args.rounds)
    finally:
        ray.shutdown()
    for row in rows(result):
        print("%-6s %-62s %-18s %s" % row)
    print(json.dumps({"bench": "forks", "results": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
