"""``exec true`` of this checkout beside a reference commit's, finely interleaved.

The isolation section's turns (a whole section of REF, then a whole one of this
checkout) are minutes apart, and this machine's speed drifts by a third between them
(the same code's exec p50 from 1.4 to 2.2 ms): a 10 % target cannot be read from them.
Here each side is a process of its own, started from its checkout (its own Ray, its
own agent and daemon bundle), holding one sandbox per LocalProvider level; the driver
has them run batches of ``exec true`` in turn (REF, this; this, REF; ...), so every
slow stretch falls on both.

    python bench/exec_ab.py REF_TREE [--batches 40] [--per 25]

As a side (``--side``) it speaks lines: ``ready`` once its sandboxes answer, then for
each line ``N`` it reads, one JSON object of each level's N durations in ms. It uses
only what every checkout has (LocalProvider, SandboxSpec, DaemonClient), so it runs
against an older tree's package as well.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
LEVELS = {"local-host-root": {"user_namespaces": False}, "local": {},
          "local-network": {"network": True}}


def side(cache_root: str) -> int:
    """Hold one sandbox of each level; run batches of ``exec true`` on command."""
    import ray
    sys.path.insert(0, os.getcwd())  # the checkout this side measures
    from sandman_ray.client import DaemonClient
    from sandman_ray.providers.local import LocalProvider
    from sandman_ray.spec import SandboxSpec
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    held = []
    try:
        for name, options in LEVELS.items():
            provider = LocalProvider(
                state_root="/tmp/sandman-ray-bench/exec-ab", cache_root=cache_root,
                user_namespaces=options.get("user_namespaces", True),
            ).bind("ab-%s-%s" % (name, uuid.uuid4().hex[:6]))
            spec = SandboxSpec(image="builtin:debian", network=options.get("network", False))
            info = asyncio.run(provider.create("ab", spec, {}))
            client = DaemonClient(info.address, info.token)
            for _ in range(20):  # warm
                client.exec("true")
            held.append((name, provider, client))
        print("ready", flush=True)
        for line in sys.stdin:
            out = {}
            for name, _, client in held:
                times = []
                for _ in range(int(line)):
                    started = time.perf_counter()
                    client.exec("true")
                    times.append((time.perf_counter() - started) * 1e3)
                out[name] = times
            print(json.dumps(out), flush=True)
    finally:
        for _, provider, client in held:
            client.close()
            asyncio.run(provider.shutdown())
        ray.shutdown()
    return 0


def _start(tree: Path, name: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--side",
                             str(ROOT / ".cache" / ("exec-ab-" + name))], cwd=str(tree),
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("ready"):
            return proc
    raise RuntimeError("the %s side of the exec comparison did not start" % name)


def compare(ref_tree: Path, batches: int = 40, per: int = 25) -> dict:
    """Each level's exec p50 and p99 on both sides, and this checkout's p50 over REF's."""
    sides = {"baseline": _start(ref_tree, "baseline"), "this": _start(ROOT, "this")}
    ran: Dict[str, Dict[str, List[float]]] = {s: {n: [] for n in LEVELS} for s in sides}
    try:
        for turn in range(batches):
            for name in (("baseline", "this") if turn % 2 == 0 else ("this", "baseline")):
                sides[name].stdin.write("%d\n" % per)
                sides[name].stdin.flush()
                for level, times in json.loads(sides[name].stdout.readline()).items():
                    ran[name][level] += times
    finally:
        for proc in sides.values():
            proc.stdin.close()
            proc.wait(timeout=120)

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]
    out = {s: {n: {"exec_true_p50_ms": statistics.median(v), "exec_true_p99_ms": pct(v, 0.99),
                   "execs": len(v)} for n, v in levels.items()} for s, levels in ran.items()}
    out["ratios"] = {n: out["this"][n]["exec_true_p50_ms"] / out["baseline"][n]["exec_true_p50_ms"]
                     for n in LEVELS}
    out["batches"], out["per_batch"] = batches, per
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", nargs="?", help="the reference checkout")
    parser.add_argument("--side", metavar="CACHE_ROOT", help="run as one side")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--per", type=int, default=25)
    args = parser.parse_args(argv)
    if args.side:
        return side(args.side)
    result = compare(Path(args.tree), args.batches, args.per)
    for name in LEVELS:
        print("%-16s this %.3f ms, baseline %.3f ms: %.2fx" % (
            name, result["this"][name]["exec_true_p50_ms"],
            result["baseline"][name]["exec_true_p50_ms"], result["ratios"][name]))
    print(json.dumps({"bench": "exec_ab", "results": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
