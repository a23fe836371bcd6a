"""``sandman``: look at and operate the pools of a running Ray cluster.

    sandman status [POOL] [--json]     states, rates, oldest lease, leases per client
    sandman status [POOL] --watch      a live table, refreshed every --interval s
    sandman list [POOL] [--json]       sandboxes: state, image, node, age, lease holder
    sandman events [POOL] [--limit N]  the last state transitions with their reasons
    sandman gc POOL [--dry-run]        delete sandboxes that no live handle holds
    sandman shutdown POOL              delete every sandbox of POOL and stop it
    sandman bench NAME [ARGS...]       run bench/NAME.py of a source checkout
    sandman serve --pool POOL          serve POOL to clients outside Ray (service/)
    sandman keys create|list|revoke    the service's API keys (service/commands.py)
    sandman tenants set|list           the service's tenants, weights and limits

It connects to a running cluster (``--address``, default ``auto``: the one on this
machine, or ``$RAY_ADDRESS``) and never starts one; ``bench``, ``keys`` and ``tenants``
need none.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.errors import SandmanError

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


class CliError(Exception):
    """A problem to print as one line, with exit status 2."""


def _connect(address: str) -> None:
    import ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _reachable(address)
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                 include_dashboard=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise CliError("no Ray cluster at %r (%s); start one with `ray start --head`, or "
                       "pass --address" % (address, str(exc).splitlines()[0])) from None


def _reachable(address: str) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray itself retries for minutes),
    or whose cluster refuses this process (``_admitted``)."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "auto")):
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
    except OSError as exc:
        raise CliError("no Ray cluster at %r: %s" % (address, exc)) from None
    _admitted(address)


def _admitted(address: str) -> None:
    """Fail at once, saying why, on a cluster that refuses this process's credentials:
    one with token authentication, named by its address while this process has
    RAY_AUTH_MODE unset (Ray then sends no token: it takes the token of ~/.ray only for
    a cluster it finds itself, ``auto``), where ``ray.init`` retries for 20 s and then
    reports no cluster at all. The check is one GCS client made (Ray's own, internal),
    refused as soon as it asks the cluster's id."""
    import ray
    try:
        from ray._raylet import GcsClient
    except ImportError:  # pragma: no cover - a Ray without it: ray.init says what it can
        return
    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError:
        raise CliError(
            "the Ray cluster at %r refused this client's credentials: it uses token "
            "authentication; set RAY_AUTH_MODE=token, with the cluster's token in "
            "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (`ray get-auth-token` "
            "prints it on the cluster)" % address) from None
    except Exception:  # noqa: BLE001 - anything else: ray.init's own error says it
        return


def _pool_names() -> List[str]:
    import ray
    from sandman_ray.names import NAMESPACE, pool_actor_name
    prefix = pool_actor_name("")
    return sorted(entry["name"][len(prefix):]
                  for entry in ray.util.list_named_actors(all_namespaces=True)
                  if entry.get("namespace") == NAMESPACE and entry["name"].startswith(prefix))


def _pools(name: Optional[str]) -> List[str]:
    names = _pool_names()
    if name is None:
        return names
    if name not in names:
        raise CliError("no pool named %r on this cluster (pools: %s)"
                       % (name, ", ".join(names) or "none"))
    return [name]


def _call(pool: str, method: str, *args, refresh: bool = False):
    import ray
    import sandman_ray
    actor = sandman_ray.get_pool(pool, refresh=refresh)
    return ray.get(getattr(actor, method).remote(*args), timeout=60)


def _table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header] + rows]
    return "\n".join(lines)


def _age(seconds: float) -> str:
    if seconds < 120:
        return "%.1fs" % seconds
    if seconds < 7200:
        return "%.0fm" % (seconds / 60)
    return "%.1fh" % (seconds / 3600)


# ---------------------------------------------------------------------- commands
def cmd_status(args) -> int:
    if args.watch:
        return _watch(args)
    if args.interval is not None or args.count is not None:
        raise CliError("--interval and --count go with --watch")
    statuses = [_call(p, "status", True) for p in _pools(args.pool)]
    if args.json:
        for s in statuses:
            s.pop("create_starts", None)
        print(json.dumps(statuses, indent=1, sort_keys=True))
        return 0
    if not statuses:
        print("no pools on this cluster")
    for s in statuses:
        states = {k: v for k, v in s["states"].items() if v}
        print("pool %s (actor pid %s)" % (s["pool"], s["pid"]))
        print(_table([[str(v) for v in states.values()]], list(states)) if states
              else "no sandboxes")
        print("waiters %d   create rate %.1f/s   oldest lease %s" % (
            s["waiters"], s["create_rate_per_s"], _age(s["oldest_lease_s"])))
        print("totals  " + ", ".join("%s %d" % kv for kv in sorted(s["stats"].items())))
        for node, cache in sorted((s.get("image_cache") or {}).items()):
            print("images  node %s: %s of %s in %d images; hits %d, misses %d, evictions "
                  "%d" % (node[:12], _size(cache["bytes"]), _size(cache["budget_bytes"]),
                          cache["entries"], cache["hits"], cache["misses"],
                          cache["evictions"]))
        clients = sorted(s["leases_per_client"].items(), key=lambda kv: -kv[1])
        if clients:
            print(_table([[c, str(n)] for c, n in clients], ["client", "leases"]))
        print()
    return 0


# the states of a sandbox in a watched row; "returning" is releasing, resetting or deleting
WATCH_STATES = ("requested", "creating", "ready", "leased", "returning", "failed")
WATCH_HEADER = ["pool"] + list(WATCH_STATES) + [
    "waiters", "creates/s", "leases/s", "pace/s", "throttled", "oldest lease"]


def _watch(args) -> int:
    """Refresh a row per pool every ``--interval`` s until Ctrl-C (or ``--count``
    frames). Rates are the change of the pool's counters since the last frame; pace/s
    is the create rate the pool allows itself now (it drops while the provider
    throttles). With ``--json``, a line of the pools' statuses per frame."""
    interval = 1.0 if args.interval is None else args.interval
    count = args.count or 0
    if interval <= 0 or count < 0:
        raise CliError("--interval must be above 0 and --count at least 0")
    gone = ({"gone": args.pool} if args.json else "pool %s is gone" % args.pool)
    before: Dict[str, Dict] = {}
    last = 0.0
    frames = 0
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            try:
                names = _pools(args.pool)
            except CliError:
                if not frames:
                    raise
                print(json.dumps(gone) if args.json else gone)
                return 0
            statuses = [s for s in (_status_or_none(name) for name in names) if s]
            now = time.monotonic()
            if args.json:
                for s in statuses:
                    s.pop("create_starts", None)
                print(json.dumps({"time": time.time(), "pools": statuses}, sort_keys=True))
            else:
                rows = [_watch_row(s, before.get((s["pool"], s["pid"])), now - last)
                        for s in statuses]
                if clear:
                    sys.stdout.write("\x1b[H\x1b[2J")
                print("sandman status --watch   %s   every %g s, Ctrl-C to stop"
                      % (time.strftime("%H:%M:%S"), interval))
                print(_table(rows, WATCH_HEADER) if rows else "no pools on this cluster")
                print()
            sys.stdout.flush()
            # by pool and actor: a pool created anew starts its counters from zero
            before, last = {(s["pool"], s["pid"]): s for s in statuses}, now
            frames += 1
            if frames == count:
                return 0
            time.sleep(interval)  # the refresh period, not a wait for anything
    except KeyboardInterrupt:
        return 0


def _status_or_none(pool: str) -> Optional[Dict]:
    """A pool's status, or None when it stopped between the listing and the call (or
    does not answer within a minute). A pool that stopped and was created anew under
    its name is a new actor: it is looked up again."""
    import ray
    for refresh in (False, True):
        try:
            return _call(pool, "status", refresh=refresh)
        except ray.exceptions.RayActorError:
            continue
        except (SandmanError, ray.exceptions.GetTimeoutError):
            return None
    return None


def _watch_row(status: Dict, before: Optional[Dict], elapsed: float) -> List[str]:
    states = dict(status["states"])
    states["returning"] = sum(states.get(k, 0) for k in ("releasing", "resetting", "deleting"))
    stats, old = status["stats"], (before or {}).get("stats")

    def per_s(key: str) -> str:
        if old is None or elapsed <= 0:
            return "-"
        return "%.1f" % ((stats.get(key, 0) - old.get(key, 0)) / elapsed)
    throttled = "%d" % stats.get("throttled", 0)
    if old is not None:
        throttled += " (+%d)" % (stats.get("throttled", 0) - old.get("throttled", 0))
    return ([status["pool"]] + [str(states.get(k, 0)) for k in WATCH_STATES] +
            [str(status["waiters"]), per_s("creates"), per_s("leases"),
             "%.1f" % status["create_rate_per_s"], throttled, _age(status["oldest_lease_s"])])


def _rows(pool: Optional[str], method: str) -> List[Dict]:
    """What ``method`` lists of every pool (or ``pool``), each row with its pool."""
    rows: List[Dict] = []
    for name in _pools(pool):
        for entry in _call(name, method):
            entry["pool"] = name
            rows.append(entry)
    return rows


def cmd_list(args) -> int:
    rows = _rows(args.pool, "list_sandboxes")
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        return 0
    print(_table([[r["pool"], r["sandbox_id"], r["state"], r["image"],
                   (r["node_id"] or "-")[:12], _age(r["age_s"]), r["client"] or "-",
                   r["holder"] or "-"]
                  for r in sorted(rows, key=lambda r: (r["pool"], r["sandbox_id"]))],
                 ["pool", "sandbox", "state", "image", "node", "in state", "lease owner",
                  "host"]))
    return 0


def cmd_events(args) -> int:
    events = []
    for pool in _pools(args.pool):
        events += [(t, pool, sid, what, why) for t, sid, what, why
                   in _call(pool, "recent_events", args.limit)]
    events.sort()
    events = events[-args.limit:]
    if args.json:
        print(json.dumps([{"time": t, "pool": p, "sandbox_id": s, "state": w, "reason": r}
                          for t, p, s, w, r in events], indent=1))
        return 0
    print(_table([[time.strftime("%H:%M:%S", time.localtime(t)) + ".%03d" % (t % 1 * 1000),
                   p, s, w, r] for t, p, s, w, r in events],
                 ["time", "pool", "sandbox", "state", "reason"]))
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("%d %s" if unit == "B" else "%.1f %s") % (n, unit)
        n /= 1024.0
    return str(n)


def cmd_snapshots(args) -> int:
    """List the pools' snapshots; ``--delete NAME`` deletes one of POOL's."""
    if args.delete:
        if not args.pool:
            raise CliError("--delete needs the snapshot's POOL")
        _call(_pools(args.pool)[0], "delete_snapshot", args.delete)
        print("snapshot %s of pool %s deleted" % (args.delete, args.pool))
        return 0
    rows = _rows(args.pool, "snapshots")
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        return 0
    now = time.time()
    print(_table([[r["pool"], r["name"], _size(r["size_bytes"]), r["base"],
                   (r["node_id"] or "-")[:12], str(r["sandboxes"]), str(r["warm"]),
                   "fork" if r["for_fork"] else "named", _age(now - r["created_at"])]
                  for r in sorted(rows, key=lambda r: (r["pool"], r["created_at"]))],
                 ["pool", "snapshot", "size", "base", "node", "sandboxes", "warm", "kind",
                  "age"]))
    print("%d snapshot%s, %s" % (len(rows), "" if len(rows) == 1 else "s",
                                 _size(sum(r["size_bytes"] for r in rows))))
    return 0


def cmd_gc(args) -> int:
    found = _call(_pools(args.pool)[0], "gc", args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for entry in found:
        print("%s %s (%s, client %s): %s" % (verb, entry["sandbox_id"], entry["state"],
                                            entry["client"] or "-", entry["why"]))
    print("%d sandbox%s %s" % (len(found), "" if len(found) == 1 else "es", verb))
    return 0


def cmd_shutdown(args) -> int:
    import sandman_ray
    _pools(args.pool)
    snapshots = _call(args.pool, "snapshots")
    print("pool %s shut down, %d sandboxes and %d snapshots (%s) deleted"
          % (args.pool, sandman_ray.shutdown_pool(args.pool), len(snapshots),
             _size(sum(s["size_bytes"] for s in snapshots))))
    return 0


def cmd_bench(args) -> int:
    script = BENCH_DIR / ("%s.py" % args.name.replace("-", "_"))
    if not BENCH_DIR.is_dir():
        raise CliError("the benchmarks ship with the source tree (bench/); this install "
                       "has none")
    # a benchmark is a script of bench/; the modules they share (progress) are not
    runnable = sorted(p.stem for p in BENCH_DIR.glob("*.py")
                      if "if __name__ == \"__main__\":" in p.read_text())
    if args.name.replace("-", "_") not in runnable:
        raise CliError("no benchmark %r (have: %s)" % (args.name, ", ".join(runnable)))
    return subprocess.call([sys.executable, str(script)] + args.args)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sandman", description=__doc__.split("\n\n")[0])
    top.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                     help="the Ray cluster (default: auto, or $RAY_ADDRESS)")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="a table per pool")
    p.add_argument("pool", nargs="?")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true",
                   help="a live table of every pool (or POOL), refreshed until Ctrl-C")
    p.add_argument("--interval", type=float, help="with --watch: seconds between refreshes (1)")
    p.add_argument("--count", type=int, help="with --watch: stop after N refreshes (0: never)")
    p = sub.add_parser("list", help="the sandboxes of every pool (or POOL)")
    p.add_argument("pool", nargs="?")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("events", help="the last transitions with reasons")
    p.add_argument("pool", nargs="?")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("snapshots", help="the snapshots of every pool (or POOL), "
                                         "with sizes; --delete NAME deletes one")
    p.add_argument("pool", nargs="?")
    p.add_argument("--delete", metavar="NAME")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("gc", help="delete sandboxes that no live handle holds")
    p.add_argument("pool")
    p.add_argument("--dry-run", action="store_true", help="list them, delete nothing")
    p = sub.add_parser("shutdown", help="delete every sandbox of POOL and stop it")
    p.add_argument("pool")
    p = sub.add_parser("bench", help="run a benchmark of the source tree")
    p.add_argument("name", help="noop, local, burst, k8s_burst")
    p.add_argument("args", nargs=argparse.REMAINDER)
    from sandman_ray.service import commands as service_commands
    service_commands.add_parsers(sub)
    return top


COMMANDS = {"status": cmd_status, "list": cmd_list, "events": cmd_events, "gc": cmd_gc,
            "snapshots": cmd_snapshots, "shutdown": cmd_shutdown, "bench": cmd_bench}
# the commands that need no Ray cluster (serve checks its arguments, then connects)
OFFLINE = ("bench", "serve", "keys", "tenants")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "limit", 1) < 1:
        print("sandman: --limit must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.command not in OFFLINE:
            _connect(args.address)
        args.connect = lambda: _connect(args.address)
        if args.command in ("serve", "keys", "tenants"):
            from sandman_ray.service.commands import COMMANDS as SERVICE_COMMANDS
            return SERVICE_COMMANDS[args.command](args)
        return COMMANDS[args.command](args)
    except (CliError, ValueError, SandmanError) as exc:
        print("sandman: %s" % exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
