"""The RL rollout example: a policy learns to repair buggy repositories from rewards
measured in sandboxes (``make demo`` runs it).

Each iteration the rollout workers (Ray actors) run a batch of episodes, many at once,
one sandbox per episode from a sandman pool on this Ray cluster; the driver updates the
policy from the rewards and prints the iteration. At the end: a summary table, the
reward of the first and last iterations, and the sandboxes left on this host once the
pool is shut down. Exits 0 only when the reward rose and nothing was left.

    python examples/rl_rollout/train.py [--iterations 12] [--episodes 64] [--plot reward.png]
                                        [--group-size G]

With ``--group-size G`` (GRPO-style): each task is prepared once in a sandbox (its
repository, a set-up standing in for a dependency install, the tests run once), then
forked (``sandman_ray.fork``) into G sandboxes that each try an edit the policy samples;
each reward is weighed against its group's. The summary compares the time this took
with preparing each of the G sandboxes from scratch.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sandman_ray as sandman  # noqa: E402
from sandman_ray.spec import DEFAULT_IMAGE  # noqa: E402
from common import CACHE_ROOT, init_ray, require_positive, sandboxes_left  # noqa: E402
from coderepair import EDITS, FEATURES  # noqa: E402
from policy import LinearPolicy  # noqa: E402

POOL = "rl-rollout"
ROSE_BY = 0.25  # the last iterations' mean reward must beat the first's by this


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--episodes", type=int, default=64, help="episodes per iteration")
    parser.add_argument("--workers", type=int, default=2, help="rollout worker actors")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="episodes in flight per worker (one sandbox each)")
    parser.add_argument("--group-size", type=int, default=1,
                        help="G > 1: prepare each task once and fork G sandboxes from it "
                        "(GRPO-style groups; --episodes counts the G samples of each)")
    parser.add_argument("--learning-rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", default=DEFAULT_IMAGE,
                        help="sandbox image; it needs python3 (default: %(default)s, Debian 12 "
                        "minbase with python3, built on first use)")
    parser.add_argument("--plot", metavar="PNG", help="save reward over iterations (matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the run's figures as JSON")
    parser.add_argument("--policy", choices=("linear", "openai"), default="linear",
                        help="openai: ask an OpenAI-compatible endpoint (no learning)")
    parser.add_argument("--openai-base-url", help="e.g. http://localhost:8000/v1")
    parser.add_argument("--openai-model")
    parser.add_argument("--openai-api-key-env", default="OPENAI_API_KEY")
    parser.add_argument("--state-root", default="/tmp/sandman-ray/state")
    parser.add_argument("--cache-root", default=CACHE_ROOT)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("iterations", "episodes", "workers", "concurrency",
                                    "group_size"))
    if args.episodes % args.group_size:
        parser.error("--episodes (%d) must be a multiple of --group-size (%d)"
                     % (args.episodes, args.group_size))
    if args.group_size > 1 and args.policy != "linear":
        parser.error("--group-size needs --policy linear")
    if args.policy == "openai" and not (args.openai_base_url and args.openai_model):
        parser.error("--policy openai needs --openai-base-url and --openai-model")
    if args.policy == "linear" and args.iterations < 2:
        parser.error("--iterations must be at least 2 to see the reward rise")
    return args


def percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(samples, q)) if len(samples) else float("nan")


def run_iteration(workers, weights, seeds: List[int], label: str,
                  group_size: int = 1) -> List[Dict]:
    """Split ``seeds`` over the workers, wait with a progress bar, return every record
    (``group_size`` records per seed in group mode)."""
    shares = [seeds[i::len(workers)] for i in range(len(workers))]
    refs = [w.rollout_groups.remote(weights, share, group_size) if group_size > 1
            else w.rollout.remote(weights, share)
            for w, share in zip(workers, shares) if share]
    # on a terminal only (disable=None), and gone once the iteration's row is printed;
    # the workers are asked how far they are only while a bar shows it
    with tqdm(total=len(seeds) * group_size, desc=label, unit="episode", leave=False,
              disable=None, dynamic_ncols=True) as bar:
        pending = [] if bar.disable else refs
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            bar.update(sum(ray.get([w.progress.remote() for w in workers])) - bar.n)
    return [record for batch in ray.get(refs) for record in batch]


def train(args) -> Dict:
    from rollout import RemoteRolloutWorker
    spec = sandman.SandboxSpec(image=args.image, memory="512Mi", pids=256,
                               labels={"example": "rl_rollout"})
    in_flight = args.workers * args.concurrency
    warm = in_flight
    if args.group_size > 1:  # a prepared sandbox and its G forks per group in flight
        groups = args.workers * max(1, args.concurrency // args.group_size)
        warm, in_flight = groups, groups * (args.group_size + 1)
    provider = sandman.LocalProvider(state_root=args.state_root, cache_root=args.cache_root)
    sandman.create_pool(POOL, provider=provider, warm={spec: warm},
                        max_sandboxes=in_flight + 4)
    openai = None
    if args.policy == "openai":
        openai = {"base_url": args.openai_base_url, "model": args.openai_model,
                  "api_key_env": args.openai_api_key_env}
    workers = [RemoteRolloutWorker.options(name="rollout-worker-%d" % i).remote(
        i, POOL, spec, args.concurrency, openai, args.seed) for i in range(args.workers)]
    policy = LinearPolicy(len(FEATURES), len(EDITS), args.learning_rate)
    history: List[dict] = []
    errors: List[str] = []
    all_records: List[dict] = []
    print("%4s %8s %6s %10s %12s %12s %10s %10s" % (
        "iter", "reward", "eps/s", "episodes", "acquire p50", "acquire p99", "exec p50",
        "tests p50"))
    started = time.perf_counter()
    tasks = args.episodes // args.group_size
    for iteration in range(args.iterations):
        seeds = list(range(args.seed * 1000003 + iteration * tasks,
                           args.seed * 1000003 + (iteration + 1) * tasks))
        begun = time.perf_counter()
        records = run_iteration(workers, policy.weights.copy(), seeds,
                                "iteration %d/%d" % (iteration + 1, args.iterations),
                                args.group_size)
        elapsed = time.perf_counter() - begun
        good = [r for r in records if "error" not in r]
        errors.extend(r["error"] for r in records if "error" in r)
        all_records.extend(good)
        rewards = [r["reward"] for r in good]
        if args.policy == "linear" and good:
            policy.update([r["decision"] for r in good], rewards,
                          [r["advantage"] for r in good] if args.group_size > 1 else None)
        acquire = [r["acquire_s"] * 1e3 for r in good]
        execs = [s * 1e3 for r in good for s in r["exec_s"]]
        tests = [s * 1e3 for r in good for s in r["test_s"]]
        row = {"iteration": iteration + 1, "reward": float(np.mean(rewards)) if rewards else 0.0,
               "episodes_per_s": len(good) / elapsed, "episodes": len(good),
               "errors": len(records) - len(good),
               "acquire_p50_ms": percentile(acquire, 50), "acquire_p99_ms": percentile(acquire, 99),
               "exec_p50_ms": percentile(execs, 50), "tests_p50_ms": percentile(tests, 50)}
        history.append(row)
        print("%4d %8.2f %6.1f %10d %10.1f ms %9.1f ms %7.2f ms %7.1f ms" % (
            row["iteration"], row["reward"], row["episodes_per_s"], row["episodes"],
            row["acquire_p50_ms"], row["acquire_p99_ms"], row["exec_p50_ms"],
            row["tests_p50_ms"]), flush=True)
    wall = time.perf_counter() - started
    status = ray.get(sandman.get_pool(POOL).status.remote())
    for worker in workers:  # (Ray's stubs type .remote() of an actor class as either)
        ray.kill(worker)  # type: ignore[arg-type]
    sandman.shutdown_pool(POOL)
    return {"history": history, "errors": errors, "records": all_records, "wall_s": wall,
            "pool": status, "policy": policy}


def summarize(args, run: Dict, n_left: int) -> bool:
    history, records = run["history"], run["records"]
    acquire = [r["acquire_s"] * 1e3 for r in records]
    execs = [s * 1e3 for r in records for s in r["exec_s"]]
    episode = [r["episode_s"] * 1e3 for r in records]
    first = history[0]["reward"]
    last = float(np.mean([h["reward"] for h in history[-2 if len(history) >= 4 else -1:]]))
    stats = run["pool"]["stats"]
    print("\nsummary")
    rows = [
        ("iterations", "%d" % len(history)),
        ("episodes (failed)", "%d (%d)" % (len(records), len(run["errors"]))),
        ("wall time", "%.1f s" % run["wall_s"]),
        ("episodes/s", "%.1f" % (len(records) / run["wall_s"])),
        ("sandboxes created / resets", "%d / %d" % (stats.get("creates", 0),
                                                     stats.get("resets", 0))),
        ("acquire p50 / p99", "%.1f / %.1f ms" % (percentile(acquire, 50),
                                                  percentile(acquire, 99))),
        ("exec p50 / p99 (ls, cat)", "%.2f / %.2f ms" % (percentile(execs, 50),
                                                         percentile(execs, 99))),
        ("episode p50 / p99", "%.0f / %.0f ms" % (percentile(episode, 50),
                                                  percentile(episode, 99))),
        ("reward by family", ", ".join(
            "%s %.2f" % (f, np.mean([r["reward"] for r in records[-args.episodes * 2:]
                                     if r["family"] == f]))
            for f in sorted({r["family"] for r in records}))),
    ]
    for name, value in rows:
        print("  %-28s %s" % (name, value))
    groups = group_figures(records)
    if groups:
        print("  %-28s %s" % ("groups (size)", "%d (%d)" % (groups["groups"], groups["size"])))
        print("  %-28s %s" % ("prepare once / fork p50", "%.0f / %.0f ms" % (
            groups["prepare_p50_ms"], groups["fork_p50_ms"])))
        print("  %-28s %s" % ("per group: forked / scratch", "%.0f / %.0f ms" % (
            groups["forked_ms"], groups["scratch_ms"])))
        print("time saved by forking: %.0f ms per group of %d (%.0f%%), %.1f s in all, "
              "against preparing every sandbox from scratch (its measured preparation, "
              "%d times)" % (groups["saved_ms"], groups["size"], groups["saved_pct"],
                             groups["saved_ms"] * groups["groups"] / 1e3, groups["size"]))
    for error in run["errors"][:5]:
        print("  episode error: %s" % error)
    print("reward: first iteration %.2f -> last iterations %.2f" % (first, last))
    leased = run["pool"]["states"]["leased"]
    print("leases open after the last iteration: %d" % leased)
    print("sandboxes left: %d" % n_left)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "history": history, "first_reward": first, "last_reward": last,
            "errors": len(run["errors"]), "sandboxes_left": n_left, "leases_open": leased,
            "wall_s": run["wall_s"], "groups": groups}, indent=1))
    if args.plot:
        plot(history, args.plot)
    ok = n_left == 0 and leased == 0 and not run["errors"]
    if args.policy == "linear":
        rose = last >= first + ROSE_BY
        if not rose:
            print("the reward did not rise by %.2f" % ROSE_BY)
        ok = ok and rose
    return ok


def group_figures(records: List[Dict]) -> Dict:
    """In group mode, per group (medians): the preparation done once (acquire, the
    repository, its set-up, the tests), the fork, and what preparing each of its G
    sandboxes from scratch would take instead: G preparations as measured. {} otherwise."""
    firsts = {r["group"]: r for r in records if "group" in r}
    if not firsts:
        return {}
    prepare = percentile([r["prepare_s"] * 1e3 for r in firsts.values()], 50)
    fork = percentile([r["fork_s"] * 1e3 for r in firsts.values()], 50)
    size = next(iter(firsts.values()))["group_size"]
    forked, scratch = prepare + fork, prepare * size
    return {"groups": len(firsts), "size": size, "prepare_p50_ms": prepare,
            "fork_p50_ms": fork, "forked_ms": forked, "scratch_ms": scratch,
            "saved_ms": scratch - forked, "saved_pct": 100.0 * (scratch - forked) / scratch}


def plot(history: List[Dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["iteration"] for h in history], [h["reward"] for h in history], marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward (tests pass)")
    ax.set_ylim(0, 1.05)
    ax.set_title("code repair: reward over iterations")
    fig.tight_layout()
    fig.savefig(path)
    print("reward plot: %s" % path)


def main(argv=None) -> int:
    args = parse_args(argv)
    init_ray("rl-rollout")
    try:
        run = train(args)
    finally:
        ray.shutdown()
    return 0 if summarize(args, run, sandboxes_left(POOL, args.state_root)) else 1


if __name__ == "__main__":
    sys.exit(main())
