"""The service's server, chosen by measurement: Ray Serve beside its own, in one run.

Ray Serve is the ecosystem's way to serve HTTP from a Ray cluster: a proxy actor takes
the request and hands it to a replica actor, which answers. The service's control plane
is aiohttp in the ServiceHost actor, and its data plane a byte relay in the same
process (service/relay.py). On this machine, in interleaved turns over keep-alive
connections on loopback:

  no-op   a request that does nothing: Serve's proxy and replica, against the service's
          ``GET /v1/healthz``;
  exec    ``exec true`` on one sandbox: an HTTP request to a Serve replica that holds a
          daemon connection to it, against the service's data plane (one upgraded
          connection, the daemon's frames).

    python bench/service_serve.py [--n 1000]    (or make bench: its service section)
"""

import argparse
import http.client
import json
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import pct, run_alone  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> Callable[[], None]:
    """A call that GETs ``path`` on one keep-alive connection and reads the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call() -> None:
        conn.request("GET", path)
        answer = conn.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise RuntimeError("GET %s: %d %r" % (path, answer.status, body[:200]))
    return call


def turns(ways: Dict[str, Callable[[], None]], n: int) -> Dict[str, dict]:
    for call in ways.values():  # connections made, code paths warm
        for _ in range(50):
            call()
    times: Dict[str, List[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(n):
        for name in names if i % 2 else reversed(names):
            started = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - started)
    return {name: {"p50_ms": pct(t, 0.5) * 1e3, "p99_ms": pct(t, 0.99) * 1e3, "n": len(t)}
            for name, t in times.items()}


def serve_beside_ours(urls: Dict[str, str], key: str, image: str, pool: str,
                      n: int = 1000) -> dict:
    """``urls``: a running service's (bench/service.py ``served``), ``key`` a tenant's
    key of it; ``pool`` its pool, whose handle gives the Serve replica a daemon."""
    import ray
    from ray import serve
    import sandman_ray as sandman
    from sandman_ray.remote import connect

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Sandbox:
        def __init__(self, address: str, token: str):
            from sandman_ray.client import DaemonClient
            self.client = DaemonClient(address, token)

        async def __call__(self, request) -> str:
            if request.url.path.endswith("/exec"):
                return json.dumps({"exit_code": self.client.exec("true").exit_code})
            return "ok"

    port = free_port()
    handle = sandman.acquire(image, pool=pool, timeout=120)
    remote = connect(urls["url"], key)
    sb = remote.acquire(image, timeout=120)
    try:
        direct = handle._direct
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Sandbox.bind(direct.address, direct.token), name="sandman-bench",
                  route_prefix="/sb")
        own_port = int(urls["url"].rsplit(":", 1)[1])
        noop = turns({"ray serve": http_get(port, "/sb/noop"),
                      "service": http_get(own_port, "/v1/healthz")}, n)
        execs = turns({"ray serve": http_get(port, "/sb/exec"),
                       "service": lambda: sb.exec("true")}, n)
    finally:
        serve.shutdown()
        sb.release()
        sandman.release(handle)
    return {"noop": noop, "exec": execs,
            "serve_over_service_noop": noop["ray serve"]["p50_ms"] / noop["service"]["p50_ms"],
            "serve_over_service_exec": execs["ray serve"]["p50_ms"] / execs["service"]["p50_ms"],
            "ray": ray.__version__}


def rows(s: dict) -> List[tuple]:
    no, ex = s["noop"], s["exec"]
    return [("svc", "no-op HTTP request: Ray Serve / service, p50 (p99)",
             "%.2f / %.2f ms" % (no["ray serve"]["p50_ms"], no["service"]["p50_ms"]),
             "%.2fx (p99 %.2f / %.2f ms)" % (s["serve_over_service_noop"],
                                             no["ray serve"]["p99_ms"], no["service"]["p99_ms"])),
            ("svc", "exec true: a Ray Serve replica / the data plane, p50 (p99)",
             "%.2f / %.2f ms" % (ex["ray serve"]["p50_ms"], ex["service"]["p50_ms"]),
             "%.2fx (p99 %.2f / %.2f ms; target <= 2.0 ms)"
             % (s["serve_over_service_exec"], ex["ray serve"]["p99_ms"],
                ex["service"]["p99_ms"]))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    args = parser.parse_args()

    def measure() -> dict:
        import service
        with service.served({service.IMAGE: 2}, 8) as (pool, urls, keys):
            return serve_beside_ours(urls, keys[0], service.IMAGE, pool, args.n)
    return run_alone(measure, rows, "service_serve")

if __name__ == "__main__":
    sys.exit(main())
