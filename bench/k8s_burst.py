"""A burst of sandbox requests against the SIMULATED Kubernetes API server
(tests/k8s_sim: no real API server runs here), paced by the pool versus unpaced, in one
run on one simulated cluster:

  paced     M client processes ask one pool (KubernetesProvider) for N sandboxes at once;
            the pool creates pods through its token bucket, honours 429 Retry-After,
            and lends a sandbox once its daemon answers a ping and `exec true`.
  unpaced   the same M clients each create their share of pods themselves, all at once
            (64 requests in flight per client, each request retried on a 429 after the
            Retry-After the server gives, with no pacing across requests or clients),
            watch them, and probe each daemon the same way.

Reported for each: time until 50 % and 100 % of the N are usable, the API server's 429
answers, errors surfaced to clients, pods left after the clients are gone (must be 0).

A paced client takes leases without a SandboxHandle actor: 10,000 handle actors (a
process of ~55 MB each) do not fit on this machine; usable still means the daemon
answered the readiness check (ping and `exec true`) that every create ends with. The
simulated daemons answer hello, ping and exec.

    python bench/k8s_burst.py [--n 10000] [--clients 8] [--api-qps 300] [--nodes 100]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from k8s_sim import SimConfig, start_process  # noqa: E402

import progress  # noqa: E402  (bench/progress.py)

IMAGE = "docker.io/library/debian:12"

PACED_CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, uuid, ray
    from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    pool = ray.get_actor(pool_actor_name(sys.argv[2]), namespace=NAMESPACE)
    n, me = int(sys.argv[3]), "client-" + sys.argv[4]
    print("go", flush=True)
    start = float(sys.stdin.readline())
    async def one(i):
        try:
            lease = await pool.lease.remote(%r, me, 900.0, "sandman:bench:%%s-%%d" %% (me, i))
        except Exception as exc:
            return None, "%%s: %%s" %% (type(exc).__name__, str(exc)[:200])
        return (time.time() - start, lease.lease_id), None
    async def main():
        results = await asyncio.gather(*[one(i) for i in range(n)])
        await asyncio.gather(*[pool.release.remote(r[1]) for r, e in results if r])
        return [r[0] for r, e in results if r], [e for r, e in results if e]
    usable, errors = asyncio.run(main())
    print(json.dumps({"usable": usable, "errors": errors}), flush=True)
""" % IMAGE)

UNPACED_CLIENT = textwrap.dedent("""
    import json, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from sandman_ray import DaemonClient
    from sandman_ray.providers.kubernetes import KubernetesProvider
    from sandman_ray.spec import SandboxSpec
    url, port, n, me = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "u" + sys.argv[4]
    provider = KubernetesProvider(host=url, daemon_port=port).bind(me)
    config = client.Configuration(); config.host = url
    config.connection_pool_maxsize = 80
    api = client.CoreV1Api(client.ApiClient(config))
    print("go", flush=True)
    start = float(sys.stdin.readline())
    running, usable, errors = {}, [], []
    lock = threading.Lock()
    def call(fn, *args, **kw):
        while True:  # each request on its own: retried after Retry-After, nothing more
            try:
                return fn(*args, _preload_content=False, **kw)
            except ApiException as exc:
                if exc.status in (429, 500, 503, 0):
                    time.sleep(float((exc.headers or {}).get("Retry-After", 1)))
                    continue
                if exc.status in (404, 409):
                    return None
                raise
    def watch():
        version = "0"
        while len(usable) + len(errors) < n:
            stream = call(api.list_namespaced_pod, "default", watch=True, resource_version=version,
                          label_selector="sandman.pool=" + me, timeout_seconds=60)
            for line in stream:
                event = json.loads(line)
                pod = event["object"]
                version = pod["metadata"]["resourceVersion"]
                ip = (pod.get("status") or {}).get("podIP")
                if ip:
                    with lock:
                        running.setdefault(pod["metadata"]["name"], ip)
                if len(usable) + len(errors) >= n:
                    break
    def one(i):
        info_pod = provider._pod("s%%d" %% i, SandboxSpec(image=%r), {}, "t%%d" %% i)
        name = info_pod["metadata"]["name"]
        try:
            call(api.create_namespaced_pod, "default", info_pod)
            while name not in running:
                time.sleep(0.05)
            c = DaemonClient("tcp:%%s:%%d" %% (running[name], port), "t%%d" %% i)
            c.ping(); c.exec("true"); c.close()
            with lock:
                usable.append(time.time() - start)
        except Exception as exc:
            with lock:
                errors.append("%%s: %%s" %% (type(exc).__name__, str(exc)[:200]))
        return name
    threading.Thread(target=watch, daemon=True).start()
    with ThreadPoolExecutor(64) as pool:
        names = list(pool.map(one, range(n)))
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(lambda name: call(api.delete_namespaced_pod, name, "default",
                                        grace_period_seconds=0), names))
    print(json.dumps({"usable": usable, "errors": errors}), flush=True)
""" % IMAGE)


def sim_get(url, path):
    return json.loads(urllib.request.urlopen(url + path, timeout=60).read())


def pods_left(url):
    return len(sim_get(url, "/api/v1/namespaces/default/pods")["items"])


def run_clients(argvs, script):
    """Start the clients, give them one start time, collect their results."""
    procs = [subprocess.Popen([sys.executable, "-c", script] + argv, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=str(ROOT)) for argv in argvs]
    for proc in procs:
        for line in proc.stdout:
            if line.strip() == "go":
                break
    start = time.time()
    for proc in procs:
        proc.stdin.write("%f\n" % start)
        proc.stdin.flush()
    usable, errors = [], []
    for proc in progress.steps(procs, "burst clients done", unit="client"):
        result = None
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
        proc.wait()
        if result is None:
            errors.append("client exited with %s and no result" % proc.returncode)
            continue
        usable += result["usable"]
        errors += result["errors"]
    return sorted(usable), errors, time.time() - start


def paced(args, url, port):
    import ray
    import sandman_ray as sandman
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-bench",
             log_to_driver=False)
    try:
        provider = sandman.KubernetesProvider(host=url, daemon_port=port, pending_timeout_s=600,
                                              max_api_calls=64)
        sandman.create_pool("k8s-burst", provider=provider, max_sandboxes=args.n,
                            create_rate_per_s=args.create_rate, create_burst=max(1, int(args.create_rate)),
                            max_starting=args.n, ready_timeout_s=600, lease_grace_s=3600,
                            reuse="delete")
        share = args.n // args.clients
        gcs = ray.get_runtime_context().gcs_address
        usable, errors, wall = run_clients(
            [[gcs, "k8s-burst", str(share), str(i)] for i in range(args.clients)], PACED_CLIENT)
        sandman.shutdown_pool("k8s-burst")
    finally:
        ray.shutdown()
    return usable, errors, wall


def unpaced(args, url, port):
    share = args.n // args.clients
    return run_clients([[url, str(port), str(share), str(i)] for i in range(args.clients)],
                       UNPACED_CLIENT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--api-qps", type=float, default=300.0)
    parser.add_argument("--create-rate", type=float, default=100.0,
                        help="the pool's create_rate_per_s")
    parser.add_argument("--modes", default="paced,unpaced")
    args = parser.parse_args()
    from conftest import free_port  # noqa: E402 (tests/ is on the path)
    port = free_port()
    config = SimConfig(nodes=args.nodes, pods_per_node=110, api_qps=args.api_qps,
                       api_burst=int(args.api_qps), schedule_rate_per_s=500.0, pull_s=5.0,
                       start_s=1.0, daemons="simulated", daemon_port=port)
    print("simulated cluster: %s" % json.dumps({k: v for k, v in vars(config).items()
                                                 if k not in ("bad_images", "stuck_nodes")}))
    print("burst: %d sandboxes from %d clients; pool create_rate_per_s=%s"
          % (args.n, args.clients, args.create_rate))
    rows = {}
    for mode in args.modes.split(","):
        url, proc = start_process(config)  # a fresh cluster per mode: cold images, no history
        try:
            before = sim_get(url, "/sim/stats")
            usable, errors, wall = {"paced": paced, "unpaced": unpaced}[mode](args, url, port)
            after = sim_get(url, "/sim/stats")
            deadline = time.monotonic() + 60
            while pods_left(url) and time.monotonic() < deadline:
                time.sleep(0.5)  # deletes the clients sent are still being applied
            left = pods_left(url)
        finally:
            proc.terminate()
            proc.wait(60)
        half = usable[len(usable) // 2 - 1] if len(usable) >= args.n // 2 else None
        full = usable[-1] if len(usable) >= args.n - args.n % args.clients else None
        rows[mode] = {"usable": len(usable), "t50_s": half, "t100_s": full,
                      "throttled_429": after.get("throttled", 0) - before.get("throttled", 0),
                      "requests": after.get("requests", 0) - before.get("requests", 0),
                      "errors": len(errors), "first_errors": errors[:3], "pods_left": left,
                      "wall_s": wall}
        print("%s done: %s" % (mode, json.dumps(rows[mode])), flush=True)
    fmt = "%-10s %9s %9s %9s %10s %8s %10s"
    print(fmt % ("mode", "usable", "50% s", "100% s", "429s", "errors", "pods left"))
    for mode, r in rows.items():
        print(fmt % (mode, r["usable"], "%.1f" % r["t50_s"] if r["t50_s"] else "-",
                     "%.1f" % r["t100_s"] if r["t100_s"] else "-", r["throttled_429"],
                     r["errors"], r["pods_left"]))
    if "paced" in rows and "unpaced" in rows and rows["paced"]["t100_s"] and rows["unpaced"]["t100_s"]:
        print("unpaced / paced, time to 100 %%: %.2fx"
              % (rows["unpaced"]["t100_s"] / rows["paced"]["t100_s"]))
    print(json.dumps({"bench": "k8s_burst", "n": args.n, "clients": args.clients,
                      "simulator": vars(config), "machine": {
                          "cpus": os.cpu_count(), "kernel": platform.release(),
                          "python": platform.python_version()},
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": rows}))


if __name__ == "__main__":
    main()
