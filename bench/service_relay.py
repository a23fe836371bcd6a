"""The service's data plane against the direct path, side by side in one run.

``exec true`` and a 1 MiB ``read_file`` on one LocalProvider sandbox: straight to its
daemon's unix socket (the direct path of a handle), and through the gateway
(sandman_ray/service/relay.py: a process of its own, loopback TCP, the upgrade said
once, then bytes relayed to the daemon), in interleaved batches; and the gateway's CPU
per 1,000 relayed execs. Issue 49's targets: the data plane's no-op exec p50 <= 2.0 ms
and <= 2x the direct path's.

    python bench/service_relay.py [--batches 40] [--per 25]
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# a gateway process given its leases (argv: {"keys": the store, "leases": {id: [tenant,
# address, token]}}): it prints its port, then cuts the lease each line of its standard
# input names (printing how many relays it cut), and stops at its end. (The service's
# control plane, which acquires the leases it holds, is to come.) tests/ use it too.
GATEWAY = r"""
import asyncio, json, sys
from sandman_ray.service.relay import Gateway, Held, admitting
from sandman_ray.service.tenants import KeyStore
config = json.loads(sys.argv[1])
keys = KeyStore(config["keys"])
gateway = Gateway(admitting(keys.verify, {k: Held(*v) for k, v in config["leases"].items()}.get),
                  pending_per_address=config.get("pending_per_address", 1024))

async def main():
    server = await gateway.serve("127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        print(gateway.cut(line.strip()), flush=True)
asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(batches: int, per: int) -> dict:
    import ray
    from sandman_ray.client import DaemonClient
    from sandman_ray.providers.local import LocalProvider
    from sandman_ray.remote.channel import connect_lease
    from sandman_ray.service.tenants import KeyStore
    from sandman_ray.spec import SandboxSpec
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    provider = LocalProvider(state_root="/tmp/sandman-ray-bench/service",
                             cache_root=str(ROOT / ".cache" / "provider")
                             ).bind("relay-%s" % uuid.uuid4().hex[:6])
    work = tempfile.mkdtemp(prefix="sandman-relay-")
    os.chmod(work, 0o700)
    store = KeyStore(Path(work) / "keys" / "keys.db")
    key = store.create_key("bench")
    info = asyncio.run(provider.create("s1", SandboxSpec(image="builtin:debian"), {}))
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY, json.dumps(
        {"keys": str(store.path), "leases": {"L-bench": ["bench", info.address, info.token]}})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = "http://127.0.0.1:%d" % int(proc.stdout.readline())
        paths = {"direct": DaemonClient(info.address, info.token),
                 "service": connect_lease(url, key, "L-bench")}
        paths["direct"].write_file("/tmp/mib", os.urandom(1 << 20))
        ran = {name: {"exec": [], "read": []} for name in paths}
        for client in paths.values():  # warm
            for _ in range(20):
                client.exec("true")
        relayed_cpu = 0.0
        for turn in range(batches):
            for name in (("direct", "service") if turn % 2 == 0 else ("service", "direct")):
                client = paths[name]
                before = cpu_s(proc.pid)
                for _ in range(per):
                    started = time.perf_counter()
                    client.exec("true")
                    ran[name]["exec"].append(time.perf_counter() - started)
                if name == "service":
                    relayed_cpu += cpu_s(proc.pid) - before
                for _ in range(2):
                    started = time.perf_counter()
                    client.read_file("/tmp/mib")
                    ran[name]["read"].append(time.perf_counter() - started)
        for client in paths.values():
            client.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        asyncio.run(provider.shutdown())
        store.close()
        ray.shutdown()
    out = {name: {"exec_true_p50_ms": pct(r["exec"], 0.5) * 1e3,
                  "exec_true_p99_ms": pct(r["exec"], 0.99) * 1e3,
                  "read_1mib_p50_ms": pct(r["read"], 0.5) * 1e3, "execs": len(r["exec"])}
           for name, r in ran.items()}
    out["service_over_direct"] = (out["service"]["exec_true_p50_ms"]
                                  / out["direct"]["exec_true_p50_ms"])
    out["gateway_cpu_s_per_1000_execs"] = relayed_cpu / len(ran["service"]["exec"]) * 1000
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--per", type=int, default=25)
    args = parser.parse_args(argv)
    out = measure(args.batches, args.per)
    for name in ("direct", "service"):
        row = out[name]
        print("%-8s exec true p50 %.3f ms (p99 %.3f ms), read 1 MiB p50 %.2f ms" % (
            name, row["exec_true_p50_ms"], row["exec_true_p99_ms"], row["read_1mib_p50_ms"]))
    print("service / direct, exec true p50: %.2fx (target <= 2.0x, and <= 2.0 ms)"
          % out["service_over_direct"])
    print("gateway CPU per 1,000 relayed execs: %.3f s" % out["gateway_cpu_s_per_1000_execs"])
    print(json.dumps({"bench": "service_relay", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
