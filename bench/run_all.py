"""The benchmark suite: every measure side by side in one run, one table, and
``bench/results/latest.json`` with the machine's description.

    python bench/run_all.py [--n 200] [--clients 4] [--samples 1000]     (make bench)

On a local Ray with the LocalProvider, each section in a module of its own
(``bench/<module>.py``; this file chooses the sections, runs them and prints):

  noop   a no-op command through the public API and the session form, beside the
         floor of our path, the least a daemon can do, the yardstick of ``.remote()``'s
         own shape, the daemon client, the direct calls and SWE-ReX's server
         (``bench/noop_section.py``).
  burst  N acquires from M client processes at once, cold (no sandbox yet) and warm (N
         ready), time to 50 % and 100 % usable (acquired and ``true`` answered, by a direct
         call: ``await sb.exec_async("true")``), with the
         median time each sandbox spent per stage: queued, created, started until it
         answered, ready until lent, lent until usable, and the PoolActor's CPU per
         sandbox (its leases, first calls and releases); for the warm burst, leases per
         second. Beside it, the same N without the pool: each client process starting its
         own sandboxes at once through the provider; and the raw provider burst: N
         created at once through the provider from one process, its node agent
         started at the first create as a provider used directly does, and again with
         the agent started before the clock (``Provider.warm_up``): the provider's own
         pace. The cold, unpooled and raw bursts take turns, in --rounds rounds, and
         each reports its median round. (A pool starts its node agents as it is
         created, and a pooled client calls ``sandman_ray.prepare`` as it starts, before
         the clock starts; the unpooled one binds its provider, whose agent starts at
         its first create.) (``burst``)
  cycle  one client on a warm pool, one lease cycle after another: acquire, a first
         ``exec true`` (a direct call; every other cycle through the host instead), the
         next call on the same path (a steady one: the first call's ratio to it),
         release, and the whole cycle, p50 and p99, also in bare actor calls (timed back
         to back, in rounds between the rounds of cycles), and the PoolActor's CPU per
         cycle. (``cycles``)
  reuse  E episodes on K sandboxes (K at a time; an episode runs one command):
         release and acquire again (a reset) versus a new sandbox per episode.
         (``cycles``)
  stream MB/s of ``cat`` of a 100 MB file through ``sb.exec_stream``, directly and
         through ``.remote()``, and the daemon's RSS growth while a reader stops.
         (``stream``)
  fork   a sandbox with 50 MB of new files forked into 8, until all answer with the
         files intact, beside 8 fresh sandboxes that copy the files in (bench/forks.py).
  cost   memory (PSS) per idle sandbox and per handle host actor; CPU per create.
         (``cost``)
  density  N leased sandboxes of the default image on this node, each with a live
         shell and a sleeper, N = 100, 250, 500, 1000 (--density-ns): per N, acquire,
         ``exec true`` (direct and ``.remote()``), pause and resume p50/p99, PSS per
         sandbox running and paused, free memory, the pool's tick, the threads, fds
         and PSS of the pool, agent and handle host (``density``).
  service  the network service (``sandman serve``) beside the Ray API: data-plane
         ``exec true`` beside the direct path and ``.remote()``, the server's CPU per
         1,000 execs, the lease cycle, 1,000 acquires from 10 tenants' client
         processes beside the same through the Ray API, memory per connected lease,
         and one tenant's p99 while another floods (``bench/service.py``).
  fusion  SandboxFusion's ``/run_code`` on the service, a python print one at a time and
         64 at once, beside the same program run by a plain subprocess on the host
         (``bench/fusion.py``).
  images  per-task settings: N acquires whose specs each set their own env and workdir
         on a pool of N warm sandboxes of one image, bound as lent (PoolConfig.late_bind)
         beside today's keys (each such spec created for); and many task images: 500
         acquires over 100 images that share a 200 MB base, on a cold pool, the time
         to usable and the disk its image cache holds, then under a budget of 40 % of
         that (``bench/images.py``, ``bench/image_burst.py``).
  e2b  E2B's SDK ``commands.run("true")`` through the service beside sandman's client's
         ``exec`` (``bench/e2b_sdk.py``).
  isolation  what each isolation level costs, one after the other in this run
         (``bench/isolation.py``): create -> first exec (one at a time) and
         ``exec true`` through the daemon client, for the LocalProvider with root inside
         as host root and no network namespace (how sandboxes ran before user
         namespaces: the figures of before), with a user namespace (the default), with a
         network namespace too (``network=True``), under gVisor, and Podman with runc
         (a user namespace per container), with the ratios to the figures of before;
         with ``--isolation-against REF`` (make bench: the commit before the system
         call policy), REF's code measured in turns beside this checkout's.
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
# a module per section (bench/<name>.py)
import burst  # noqa: E402
import cost  # noqa: E402
import cycles  # noqa: E402
import density  # noqa: E402
import forks  # noqa: E402
import fusion  # noqa: E402
import images  # noqa: E402
import e2b_sdk  # noqa: E402
import isolation  # noqa: E402
import peers  # noqa: E402
import progress  # noqa: E402
import service  # noqa: E402
import stream  # noqa: E402
from common import ROOT  # noqa: E402  (bench/common.py)
from local import busybox_rootfs  # noqa: E402  (bench/local.py)
from noop_section import noop, noop_rows  # noqa: E402  (bench/noop_section.py)
from reports import write_report  # noqa: E402  (bench/reports.py)

RESULTS = ROOT / "bench" / "results" / "latest.json"


# ---------------------------------------------------------------------- the run
def machine() -> dict:
    model = ""
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as fh:
        mem_kb = int(fh.readline().split()[1])
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_gb": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "os": _os_release(), "python": platform.python_version(),
            "ray": ray.__version__}


def _os_release() -> str:
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def table(results: dict, args) -> List[tuple]:
    rows = []
    if "noop" in results:
        rows += noop_rows(results["noop"])
    if "burst" in results:
        rows += burst.rows(results["burst"], args)
    if "cycle" in results:
        rows += cycles.rows(results["cycle"])
    if "reuse" in results:
        rows += cycles.reuse_rows(results["reuse"], args.k)
    if "fork" in results:
        rows += forks.rows(results["fork"])
    if "stream" in results:
        rows += stream.rows(results["stream"])
    if "isolation" in results:
        rows += isolation.rows(results["isolation"])
    if "cost" in results:
        rows += cost.rows(results["cost"])
    if "density" in results:
        rows += density.rows(results["density"])
    if "service" in results:
        rows += service.rows(results["service"])
    if "fusion" in results:
        rows += fusion.rows(results["fusion"])
    if "e2b" in results:
        rows += e2b_sdk.rows(results["e2b"])
    if "images" in results:
        rows += images.rows(results["images"])
    if "peers" in results:
        rows += peers.rows(results["peers"])
    return rows


# in the order they run; stream last: its 100 MB chunks stay in the host's heap (which
# density measures)
SECTIONS = ("noop", "burst", "cycle", "reuse", "fork", "cost", "isolation", "density",
            "service", "fusion", "e2b", "images", "peers", "stream")


def isolation_section(args) -> dict:
    """The isolation levels; with ``--isolation-against REF``, REF's beside in turns
    (three each, a third of the creates per turn), the figures of this checkout's last
    turn in the table and every turn under ``against``."""
    if not args.isolation_against:
        return isolation.isolation(args.creates)
    per_turn = max(1, args.creates // 3)
    result = isolation.against(args.isolation_against, per_turn, 3,
                               lambda: isolation.isolation(per_turn))
    if "turns" not in result:
        return dict(isolation.isolation(args.creates), against=result)
    return dict(result["turns"]["this"][-1], against=result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="burst size")
    parser.add_argument("--clients", type=int, default=4, help="burst client processes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="burst: rounds of the cold, unpooled and raw bursts, in turn")
    parser.add_argument("--samples", type=int, default=1000, help="no-op samples per row")
    parser.add_argument("--episodes", type=int, default=200, help="reuse: episodes")
    parser.add_argument("--k", type=int, default=4, help="reuse: sandboxes at a time")
    parser.add_argument("--cycles", type=int, default=200, help="cycle: lease cycles")
    parser.add_argument("--sections",
                        default=",".join(SECTIONS))
    parser.add_argument("--creates", type=int, default=30,
                        help="isolation: creates one at a time per level")
    parser.add_argument("--density-ns", default="100,250,500,1000",
                        help="density: the numbers of leased sandboxes, in turn")
    parser.add_argument("--results", default=str(RESULTS),
                        help="where the JSON report goes (default %(default)s)")
    parser.add_argument("--service-n", type=int, default=1000,
                        help="service: acquires in the burst from 10 tenants")
    parser.add_argument("--service-rounds", type=int, default=1,
                        help="service: rounds of the service and Ray API bursts, in turn")
    parser.add_argument("--isolation-against", default=None, metavar="REF",
                        help="isolation: measure commit REF's levels too, in turns "
                             "(bench/isolation.py)")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sorted(sections - set(SECTIONS))
    if unknown:
        parser.error("unknown sections %s (known: %s)" % (unknown, ", ".join(SECTIONS)))
    image = "dir:%s" % busybox_rootfs()
    # the sections' providers (here and in their child processes) trust its directory
    os.environ.setdefault("SANDMAN_IMAGE_ROOTS", str(ROOT / ".cache" / "images"))
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench", log_to_driver=False)
    results: Dict[str, dict] = {}
    runs = {"noop": lambda: noop(args.samples),
            "burst": lambda: burst.burst(args.n, args.clients, image, args.rounds),
            "cycle": lambda: cycles.cycle(args.cycles, image),
            "reuse": lambda: cycles.reuse(args.episodes, args.k, image),
            "fork": forks.fork_vs_fresh,
            "cost": lambda: cost.cost(image),
            "isolation": lambda: isolation_section(args),
            "density": lambda: density.density(density.parse_ns(args.density_ns)),
            "service": lambda: service.service(args.service_n, args.service_rounds),
            "fusion": fusion.fusion,
            "e2b": e2b_sdk.e2b_beside_ours,
            "images": lambda: images.images(args.n, args.clients, image),
            "peers": lambda: peers.peers(list(peers.PEERS)),
            "stream": lambda: stream.stream(image)}
    try:
        with progress.bar(len(sections), "make bench", unit="section") as shown:
            for name in (n for n in SECTIONS if n in sections):
                shown.set_description("make bench: " + name)
                results[name] = runs[name]()
                shown.update()
        description = machine()
    finally:
        ray.shutdown()
    report = {"bench": "run_all", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": description, "args": vars(args),
              "duration_s": round(time.monotonic() - started, 1), "results": results}
    print("%-6s %-62s %-18s %s" % ("", "measure", "result", ""))
    for section, name, value, note in table(results, args):
        print("%-6s %-62s %-18s %s" % (section, name, value, note))
    write_report(report, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
