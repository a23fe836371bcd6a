"""The soak: lease cycle after lease cycle on a warm pool, with faults now and then,
and proof that nothing grows.

    python bench/soak.py [--cycles 100000] [--clients 4] [--fault-every 1000]
                         [--sample-every 5000] [--seed 1]

On a local Ray with the LocalProvider (image ``host``), ``--clients`` client actors
each run cycles of: acquire, ``exec`` of a command, write a file and read it back,
release; the pool keeps a sandbox warm per client. Every ``--fault-every`` cycles one
fault, chosen by the seed in turn, strikes during the next batch: a sandbox's daemon
SIGKILLed from the host (its holder must see SandboxLost), a client actor killed while
it holds a lease (a new one takes its place; the pool reclaims what it held), or the
node agent stopped (SIGSTOP) for two seconds. Every ``--sample-every`` cycles: the
RSS, threads and open files of the pool, the agent, the handle hosts and the clients,
the pool's records, and the host's mounts, sandbox cgroups, uid-range locks and
sandbox processes. The result: the slope of every series per 10,000 cycles after the
warm-up (the first fifth of the samples, at least one), the totals at the end, every
fault and whether the cycles after it worked, and what is left once the pool is shut
down (nothing, or the run fails). Prints a table and a JSON line; writes
bench/results/soak.json (``--out``).
"""

import argparse
import glob
import json
import os
import random
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import _cmdline, _pids, sandbox_pids  # noqa: E402  (bench/chaos.py)
from common import CACHE, ROOT, states  # noqa: E402  (bench/common.py)

import sandman_ray as sandman  # noqa: E402
from sandman_ray.errors import SandboxLost  # noqa: E402
from sandman_ray.providers.local import LocalProvider, leftovers  # noqa: E402
from sandman_ray.providers.local.agent import RANGE_LOCKS  # noqa: E402

STATE = "/tmp/sandman-ray/bench-soak"
IMAGE = "host"
FAULTS = ("daemon_killed", "client_killed", "agent_stalled")
STALL_S = 2.0
SETTLE_S = 30.0  # at most, for the pool to be back to its warm sandboxes before a sample
# What counts as drift, per 10,000 cycles after the warm-up: each process's RSS and
# the host's counts. (A series of counts that should not move at all gets 0.5: a
# slope through samples taken while a batch's few leases come and go.)
BOUNDS = {"rss_mb": 1.0, "threads": 0.5, "fds": 0.5, "records": 0.5, "mounts": 0.5,
          "cgroups": 0.5, "uid_locks": 0.5, "sandbox_processes": 0.5}
# process titles of the roles (an agent's is that of the task it runs: asked by pid)
ROLES = {b"ray::PoolActor": "pool", b"ray::_HandleHost": "host", b"ray::SoakClient": "client"}


@ray.remote(num_cpus=0, max_restarts=0)
class SoakClient:
    """Runs lease cycles; counts those done and the errors met, by type."""

    def __init__(self, pool: str):
        self.pool = pool
        self.payload = os.urandom(4096)

    async def cycles(self, n: int) -> dict:
        done, errors = 0, {}
        for i in range(n):
            try:
                sb = await sandman.acquire_async(IMAGE, pool=self.pool, timeout=120)
                try:
                    r = await sb.exec_async(["sh", "-c", "echo $((%d + 1))" % i])
                    await sb.write_file_async("/tmp/soak", self.payload)
                    back = await sb.read_file_async("/tmp/soak")
                    if r.stdout != b"%d\n" % (i + 1) or back != self.payload:
                        raise AssertionError("cycle %d read back something else" % i)
                finally:
                    await sandman.release_async(sb)
                done += 1
            except Exception as exc:  # noqa: BLE001 - counted; a fault may cause a few
                name = type(exc).__name__
                errors[name] = errors.get(name, 0) + 1
        return {"done": done, "errors": errors}


def agent_pids(pool: str) -> List[int]:
    """The pids of the pool's node agents (one per alive Ray node)."""
    from sandman_ray.providers.nodes import NAMESPACE, agent_name
    pids = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            agent = ray.get_actor(agent_name(pool, node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue  # none started there
        pids.append(ray.get(agent.__ray_call__.remote(lambda self: os.getpid())))
    return pids


def process_facts(pool: str) -> Dict[str, dict]:
    """Per role (pool, agent, host, client): how many processes, and the RSS (MB),
    threads and open files of each, from the host's /proc."""
    out = {role: [] for role in list(ROLES.values()) + ["agent"]}
    agents = set(agent_pids(pool))
    for pid in _pids():
        title = _cmdline(pid)
        role = "agent" if pid in agents else \
            next((r for prefix, r in ROLES.items() if title.startswith(prefix)), None)
        if role is None:
            continue
        try:
            with open("/proc/%d/status" % pid) as fh:
                status = dict(line.split(":", 1) for line in fh if ":" in line)
            fds = len(os.listdir("/proc/%d/fd" % pid))
        except OSError:
            continue  # gone meanwhile
        out[role].append({"pid": pid, "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
                          "threads": int(status["Threads"]), "fds": fds})
    return out


def held_range_locks() -> int:
    """How many of the host's uid-range lock files are locked (/proc/locks)."""
    if not os.path.isdir(RANGE_LOCKS):
        return 0
    inodes = {os.stat(os.path.join(RANGE_LOCKS, name)).st_ino for name in os.listdir(RANGE_LOCKS)}
    with open("/proc/locks") as fh:
        held = {int(fields[5].rsplit(":", 1)[1]) for fields in (line.split() for line in fh)
                if len(fields) > 5 and fields[1] in ("FLOCK", "POSIX", "OFDLCK")}
    return len(inodes & held)


def host_facts(pool: str) -> Dict[str, int]:
    with open("/proc/self/mountinfo") as fh:
        mounts = len(fh.readlines())
    cgroups = len(glob.glob("/sys/fs/cgroup/*/sandman/*/*")) + \
        len(glob.glob("/sys/fs/cgroup/sandman/*/*"))
    locks = held_range_locks()
    status = ray.get(sandman.get_pool(pool).status.remote())
    return {"mounts": mounts, "cgroups": cgroups, "uid_locks": locks,
            "sandbox_processes": len(leftovers(pool, STATE)["processes"]),
            "records": sum(status["states"].values())}


def settle(pool: str, warm: int, timeout: float = SETTLE_S) -> bool:
    """Wait until the pool holds just its ``warm`` ready sandboxes (the last batch's
    releases reset, a fault's replacement made), so that a sample reads the level of
    each series and not a fault's sandboxes still closing; False if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        now = states(pool)
        if now.get("ready") == warm and sum(now.values()) == warm:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling the pool's own count; no event tells a bench script


def sample(pool: str, cycles: int, warm: int) -> dict:
    settled = settle(pool, warm)
    return {"cycles": cycles, "time": time.time(), "settled": settled,
            "processes": process_facts(pool), **host_facts(pool)}


def slope(points: List[tuple]) -> float:
    """The Theil-Sen slope of (cycles, value) per 10,000 cycles: the median of the
    slopes between every two samples. A series that climbs keeps its climb; one sample
    taken while a fault's process was still closing (an agent with a dozen fds more,
    once) moves it no more than any other sample, where a least-squares line would
    follow it."""
    pairs = [(yj - yi) / (xj - xi) for i, (xi, yi) in enumerate(points)
             for xj, yj in points[i + 1:] if xj != xi]
    return statistics.median(pairs) * 1e4 if pairs else 0.0


def drift(samples: List[dict]) -> Dict[str, float]:
    """The slope of every series after the warm-up (the first fifth of the samples):
    the host's counts, and per role the mean RSS, threads and fds of its processes in
    each sample (a client killed and replaced by a new one, and its handle host, count
    from then on: a process's own slope over the few samples it lives would be noise)."""
    warm = max(1, len(samples) // 5)
    kept = samples[warm:]
    out = {key: slope([(s["cycles"], s[key]) for s in kept])
           for key in ("records", "mounts", "cgroups", "uid_locks", "sandbox_processes")}
    for role in kept[0]["processes"] if kept else ():
        for key in ("rss_mb", "threads", "fds"):
            out["%s_%s" % (role, key)] = slope([
                (s["cycles"], sum(p[key] for p in s["processes"][role])
                 / len(s["processes"][role])) for s in kept if s["processes"][role]])
    return out


def over_bound(slopes: Dict[str, float]) -> Dict[str, float]:
    return {key: value for key, value in slopes.items()
            if value > BOUNDS[next(b for b in BOUNDS if key == b or key.endswith("_" + b))]}


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.pool = "bench-soak-" + uuid.uuid4().hex[:6]
        self.warm = args.clients + 1
        sandman.create_pool(self.pool, provider=LocalProvider(state_root=STATE,
                                                              cache_root=CACHE),
                            warm={IMAGE: self.warm})
        self.clients = [SoakClient.remote(self.pool) for _ in range(args.clients)]
        self.cycles, self.errors, self.faults = 0, {}, []

    def batch(self, n: int, fault=None) -> None:
        """``n`` cycles spread over the clients, ``fault`` striking meanwhile."""
        per = [n // len(self.clients) + (i < n % len(self.clients))
               for i in range(len(self.clients))]
        refs = [c.cycles.remote(k) for c, k in zip(self.clients, per)]
        if fault is not None:
            self.faults.append(fault(refs))
        for i, ref in enumerate(refs):
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError:  # the client the fault killed
                continue
            self.cycles += result["done"]
            for name, count in result["errors"].items():
                self.errors[name] = self.errors.get(name, 0) + count

    # ---- faults: each returns what it did and what its victim saw
    def daemon_killed(self, refs) -> dict:
        sb = sandman.acquire(IMAGE, pool=self.pool, timeout=120)
        daemons = [pid for pid in sandbox_pids(sb.sandbox)[1:] if b"sandmand" in _cmdline(pid)]
        os.kill(daemons[0], signal.SIGKILL)
        try:
            sb.exec("true")
            seen = "no error"
        except SandboxLost as exc:
            seen = type(exc).__name__
        sandman.release(sb)
        return {"fault": "daemon_killed", "at": self.cycles, "ok": seen != "no error",
                "seen": seen}

    def client_killed(self, refs) -> dict:
        victim = self.rng.randrange(len(self.clients))
        # mid-batch, while it holds a lease: a moment into its cycles
        time.sleep(0.2 + self.rng.random() * 0.3)
        ray.kill(self.clients[victim], no_restart=True)
        self.clients[victim] = SoakClient.remote(self.pool)
        return {"fault": "client_killed", "at": self.cycles, "ok": True, "client": victim}

    def agent_stalled(self, refs) -> dict:
        agents = agent_pids(self.pool)
        time.sleep(0.2)
        for pid in agents:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(STALL_S)  # the stall itself
        for pid in agents:
            os.kill(pid, signal.SIGCONT)
        return {"fault": "agent_stalled", "at": self.cycles, "ok": bool(agents),
                "agents": len(agents)}

    def run(self) -> List[dict]:
        args, samples = self.args, [sample(self.pool, 0, self.warm)]
        order = list(FAULTS)
        self.rng.shuffle(order)
        next_sample = args.sample_every
        while self.cycles < args.cycles:
            before = self.cycles
            n = min(args.fault_every, args.cycles - self.cycles)
            fault = None
            if before > 0 and n == args.fault_every:
                fault = getattr(self, order[len(self.faults) % len(order)])
            self.batch(n, fault)
            if fault is not None:  # the cycles after a fault work: the next batch says
                self.faults[-1]["cycles_in_batch"] = self.cycles - before
            if self.cycles >= next_sample or self.cycles >= args.cycles:
                samples.append(sample(self.pool, self.cycles, self.warm))
                next_sample += args.sample_every
                print_sample(samples[-1], self.errors, len(self.faults))
            if self.cycles == before:
                raise RuntimeError("a batch of %d cycles did none: %s" % (n, self.errors))
        return samples


def print_sample(s: dict, errors: dict, faults: int) -> None:
    procs = ", ".join("%s %s MB %s thr %s fds" % (
        role, "/".join("%.0f" % p["rss_mb"] for p in ps), "/".join(str(p["threads"]) for p in ps),
        "/".join(str(p["fds"]) for p in ps)) for role, ps in sorted(s["processes"].items()))
    print("%7d cycles: records %d, mounts %d, cgroups %d, uid locks %d, sandbox processes %d;"
          " %s; %d faults, errors %s%s" % (s["cycles"], s["records"], s["mounts"], s["cgroups"],
                                            s["uid_locks"], s["sandbox_processes"], procs, faults,
                                            errors or "none",
                                            "" if s["settled"] else " (pool not settled)"),
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=100000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-every", type=int, default=1000)
    parser.add_argument("--sample-every", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.clients < 1 or args.fault_every < 1 or args.sample_every < 1:
        parser.error("--cycles, --clients, --fault-every and --sample-every must be >= 1")
    ray.init(num_cpus=2, namespace="sandman-soak", include_dashboard=False,
             log_to_driver=False)
    started = time.monotonic()
    soak = Soak(args)
    try:
        samples = soak.run()
    finally:
        sandman.shutdown_pool(soak.pool)
    left = {k: len(v) for k, v in leftovers(soak.pool, STATE).items()}
    slopes = drift(samples)
    over = over_bound(slopes)
    failed_faults = [f for f in soak.faults if not f["ok"] or not f.get("cycles_in_batch")]
    out = {"bench": "soak", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
           "cycles": soak.cycles, "seconds": time.monotonic() - started,
           "errors": soak.errors, "faults": soak.faults, "bounds_per_10k": BOUNDS,
           "slopes_per_10k": slopes, "over_bound": over, "first": samples[0],
           "last": samples[-1], "samples": len(samples), "left_after_shutdown": left,
           "ok": not over and not failed_faults and not any(left.values())}
    print("\n%-28s %12s %8s" % ("series", "per 10k", "bound"))
    for key, value in sorted(slopes.items()):
        bound = BOUNDS[next(b for b in BOUNDS if key == b or key.endswith("_" + b))]
        print("%-28s %12.3f %8.1f%s" % (key, value, bound, "  OVER" if key in over else ""))
    print("%d cycles in %.0f s, %d faults (%d not recovered), errors %s, left after shutdown %s"
          % (soak.cycles, out["seconds"], len(soak.faults), len(failed_faults),
             soak.errors or "none", left))
    print(json.dumps(out))
    Path(args.out).write_text(json.dumps(dict(out, all_samples=samples), indent=1) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
