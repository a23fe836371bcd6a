"""What each isolation level costs, and what a change costs against a reference commit,
side by side in one run.

    python bench/isolation.py [--creates 30] [--against REF] [--rounds 3]

Each level (``bench/local.py``'s setups) is set up at once, then measured in
interleaved rounds: one create of each level in turn (create -> first exec, one at a
time), then rounds of ``exec true`` through the daemon client on one sandbox of each.
Levels: the LocalProvider with root inside as host root and no network namespace (how
sandboxes ran before user namespaces), with a user namespace (the default), with a
network namespace too, under gVisor, and Podman with runc.

``--against REF`` measures the same section of commit REF too, in turns with this
checkout's (``--rounds`` turns each, REF first): REF's code runs from a git worktree
(``.cache/baseline/REF``, made once) in a process of its own, with its own daemon
bundle. A level's figure of each side is the median of its turns' p50s; the ratios say
what this checkout costs over REF (the target of a hardening that must not cost:
<= 1.10x). The turns are minutes apart, and the machine drifts more than that target
between them, so ``exec true`` of the LocalProvider's levels is also read finely
interleaved (``exec_ab.py``: batches of 25, the two sides in turn).
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline  # noqa: E402  (bench/baseline.py)
from local import SETUPS, create_and_exec, pct  # noqa: E402  (bench/local.py)

LEVELS = (("local-host-root", "LocalProvider, root inside is host root (before)"),
          ("local", "LocalProvider, user namespace (default)"),
          ("local-network", "LocalProvider, user and network namespace"),
          ("local-gvisor", "LocalProvider under gVisor"),
          ("docker", "DockerProvider, Podman with runc, user namespace"))


def isolation(creates: int, execs: int = 300, rounds_of: int = 20) -> dict:
    """Every level set up at once, then measured in interleaved rounds (one create of
    each level in turn, then ``rounds_of`` execs of each in turn), so a slow stretch of
    the machine falls on every level alike."""
    args = argparse.Namespace(image=None, docker_image=None)
    setups, teardowns = [], []
    try:
        for name, _ in LEVELS:
            provider, spec, _, teardown = SETUPS[name](args)
            setups.append((name, provider, spec))
            teardowns.append(teardown)
        return asyncio.run(_isolation(setups, creates, execs, rounds_of))
    finally:
        for teardown in teardowns:
            if teardown:
                teardown()


async def _isolation(setups, creates: int, execs: int, rounds_of: int) -> dict:
    try:
        return await _rounds(setups, creates, execs, rounds_of)
    finally:
        for _, provider, _ in setups:
            await provider.shutdown()


async def _rounds(setups, creates: int, execs: int, rounds_of: int) -> dict:
    from sandman_ray import AsyncDaemonClient
    made = {name: [] for name, _, _ in setups}
    ran = {name: [] for name, _, _ in setups}
    for name, provider, spec in setups:  # warm: agent, bundle, image cache
        sandbox_id, _, _ = await create_and_exec(provider, spec)
        await provider.delete(sandbox_id)
    for _ in range(creates):
        for name, provider, spec in setups:
            sandbox_id, _, elapsed = await create_and_exec(provider, spec)
            made[name].append(elapsed)
            await provider.delete(sandbox_id)
    held = {}
    for name, provider, spec in setups:
        sandbox_id, info, _ = await create_and_exec(provider, spec)
        held[name] = (provider, sandbox_id,
                      await AsyncDaemonClient.connect(info.address, info.token))
    for _ in range(max(1, execs // rounds_of)):
        for name, (_, _, client) in held.items():
            for _ in range(rounds_of):
                started = time.perf_counter()
                await client.exec("true")
                ran[name].append(time.perf_counter() - started)
    for provider, sandbox_id, client in held.values():
        client.close()
        await provider.delete(sandbox_id)
    out = {name: {"create_p50_ms": pct(made[name], 0.5) * 1e3,
                  "create_p99_ms": pct(made[name], 0.99) * 1e3,
                  "exec_true_p50_ms": pct(ran[name], 0.5) * 1e3,
                  "exec_true_p99_ms": pct(ran[name], 0.99) * 1e3,
                  "creates": len(made[name]), "execs": len(ran[name])} for name in made}
    return with_ratios(out)


def with_ratios(out: dict) -> dict:
    """``out`` with each level's p50s over those of before (host root, no user
    namespace)."""
    before = out["local-host-root"]
    out["ratios"] = {name: {"create": out[name]["create_p50_ms"] / before["create_p50_ms"],
                            "exec_true": out[name]["exec_true_p50_ms"]
                            / before["exec_true_p50_ms"]}
                     for name, _ in LEVELS if name != "local-host-root"}
    return out


# ---------------------------------------------------------------- against a commit
def baseline_turn(tree: Path, creates: int) -> dict:
    """REF's isolation section, in a process of its own (its own Ray, its own bundle)."""
    return baseline.run_sections(tree, ["isolation"], ["--creates", str(creates)])["isolation"]


def against(ref: str, creates: int, rounds: int, ours) -> dict:
    """Turns of REF's section and of ``ours()`` (this checkout's), REF first; each level's
    median p50 per side, and this checkout's over REF's."""
    tree = baseline.baseline_tree(ref)
    if tree is None:
        return {"against": ref, "skipped": "no worktree of %s" % ref}
    turns: Dict[str, List[dict]] = {"baseline": [], "this": []}
    for _ in range(rounds):
        turns["baseline"].append(baseline_turn(tree, creates))
        turns["this"].append(ours())
    import exec_ab  # the turns are minutes apart: exec true is read interleaved too
    interleaved = exec_ab.compare(tree)
    median = {side: {name: {key: statistics.median(t[name][key] for t in runs)
                            for key in ("create_p50_ms", "exec_true_p50_ms")}
                     for name, _ in LEVELS} for side, runs in turns.items()}
    return {"against": ref, "rounds": rounds, "creates_per_turn": creates, "median": median,
            "ratios": {name: {"create": median["this"][name]["create_p50_ms"]
                              / median["baseline"][name]["create_p50_ms"],
                              "exec_true": median["this"][name]["exec_true_p50_ms"]
                              / median["baseline"][name]["exec_true_p50_ms"]}
                       for name, _ in LEVELS},
            "exec_interleaved": interleaved, "turns": turns}


def rows(iso: dict) -> List[tuple]:
    out = []
    for name, label in LEVELS:
        row = iso[name]
        out.append(("isol", "%s: create -> first exec" % label,
                    "%.1f ms" % row["create_p50_ms"], "p99 %.1f ms" % row["create_p99_ms"]))
        out.append(("isol", "%s: exec true" % label, "%.2f ms" % row["exec_true_p50_ms"],
                    "p99 %.2f ms" % row["exec_true_p99_ms"]))
    for name in ("local", "local-network"):
        r = iso["ratios"][name]
        out.append(("isol", "%s / before: create, exec true (p50)" % name,
                    "%.2fx, %.2fx" % (r["create"], r["exec_true"]), "target <= 1.10x"))
    base = iso.get("against")
    if base and "ratios" in base:
        for name, label in LEVELS:
            r = base["ratios"][name]
            out.append(("isol", "%s: this / %s, create, exec true (median p50)"
                        % (name, base["against"]), "%.2fx, %.2fx" % (r["create"], r["exec_true"]),
                        "target <= 1.10x"))
        mixed = base["exec_interleaved"]
        for name, ratio in mixed["ratios"].items():
            out.append(("isol", "%s: this / %s, exec true, interleaved (p50 of %d each)"
                        % (name, base["against"], mixed["this"][name]["execs"]),
                        "%.2fx" % ratio, "target <= 1.10x"))
    elif base:
        out.append(("isol", "against %s" % base["against"], "skipped", base["skipped"]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=30)
    parser.add_argument("--against", default=None, help="a commit to measure beside")
    parser.add_argument("--rounds", type=int, default=3, help="turns each, with --against")
    args = parser.parse_args(argv)
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if args.against:
            result = against(args.against, max(1, args.creates // args.rounds), args.rounds,
                             lambda: isolation(max(1, args.creates // args.rounds)))
            result = dict(result["turns"]["this"][-1], against=result)
        else:
            result = isolation(args.creates)
    finally:
        ray.shutdown()
    for section, name, value, note in rows(result):
        print("%-6s %-72s %-18s %s" % (section, name, value, note))
    print(json.dumps({"bench": "isolation", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      "results": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
