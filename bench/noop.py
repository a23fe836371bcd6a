"""No-op latency of the sandbox daemon, side by side with the cost of a bare spawn.

In one run, p50/p99 (ms) of:
  floor        os.posix_spawn("/bin/true") + waitpid, from this process
  captured     the same spawn with what exec needs (session, pipes, pidfd), in-process
  ping         client -> daemon -> client, no work
  exec true    one-shot command through the daemon (spawn, wait, collect output)
  session true ``true`` in a persistent shell session
for each daemon: the daemon as a host process over a unix socket and over TCP loopback,
and the self-contained bundle inside a bubblewrap sandbox of the host's root filesystem
(the same /bin/true as the floor). Beside them, ``exec true`` through the least a
daemon can do (``bench/minimal_daemon.py``: read a frame, spawn, wait, reply, with the
same client): the part of a daemon's cost over the floor that the round trip alone
takes on this machine. The floor and every daemon use the same small
environment, as in a sandbox. Samples are taken in interleaved rounds so that
drift on a busy machine hits every row alike. Prints a table and one JSON line.

    python bench/noop.py [--samples 2000] [--rounds 10]
"""

import argparse
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandman_ray import DaemonClient
from sandman_ray.bundle import ensure_bundle
from sandman_ray.providers.local.bwrap import BwrapSandbox

import minimal_daemon  # bench/minimal_daemon.py
import progress  # bench/progress.py

ROOT = Path(__file__).resolve().parent.parent
DAEMON = ROOT / "sandman_ray" / "daemon" / "sandmand"  # the package, run as a directory
# Every daemon and the floor get the environment a sandbox gets (the size of the
# environment and the length of PATH change the cost of a spawn).
SANDBOX_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "LANG": "C.UTF-8"}


def floor() -> None:
    pid = os.posix_spawn("/bin/true", ["true"], SANDBOX_ENV)
    os.waitpid(pid, 0)


_DEVNULL = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
_EPOLL = select.epoll()


def captured_spawn() -> None:
    """What a daemon's exec must do beyond the floor, in this process and without any
    IPC: a new session, default SIGPIPE, stdout/stderr through pipes, the exit seen
    through a pidfd in an epoll."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.posix_spawnp("true", ["true"], SANDBOX_ENV, setsid=True,
                          setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
                          file_actions=[(os.POSIX_SPAWN_DUP2, _DEVNULL, 0),
                                        (os.POSIX_SPAWN_DUP2, out_w, 1),
                                        (os.POSIX_SPAWN_DUP2, err_w, 2)])
    os.close(out_w)
    os.close(err_w)
    pidfd = os.pidfd_open(pid)
    _EPOLL.register(pidfd, select.EPOLLIN)
    _EPOLL.poll()
    _EPOLL.unregister(pidfd)
    os.close(pidfd)
    os.waitpid(pid, 0)
    os.read(out_r, 65536)
    os.read(err_r, 65536)
    for fd in (out_r, err_r):
        os.close(fd)


def start_host_daemon(listen: str, token: str):
    ready_r, ready_w = os.pipe()
    proc = subprocess.Popen([sys.executable, str(DAEMON), "--listen", listen,
                             "--ready-fd", str(ready_w)], pass_fds=(ready_w,),
                            env=dict(SANDBOX_ENV, SANDMAN_TOKEN=token))
    os.close(ready_w)
    with os.fdopen(ready_r) as fh:
        address = fh.readline().strip()
    if not address:
        raise SystemExit("daemon did not start: %s" % listen)
    return proc, address


def percentile(samples, q):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="per row (default 2000)")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    token = "bench-token"
    tmp = Path(tempfile.mkdtemp(prefix="sandman-bench-"))
    procs, clients = [], {}
    sandbox = minimal = None
    try:
        p, unix_addr = start_host_daemon("unix:%s/host.sock" % tmp, token)
        procs.append(p)
        p, tcp_addr = start_host_daemon("tcp:127.0.0.1:0", token)
        procs.append(p)
        clients["host daemon, unix"] = DaemonClient(unix_addr, token)
        clients["host daemon, tcp"] = DaemonClient(tcp_addr, token)
        bundle = ensure_bundle(ROOT / ".cache" / "bundle")
        sandbox = BwrapSandbox(Path("/"), bundle, tmp / "sbx", hostname="bench",
                               env=SANDBOX_ENV)
        address = sandbox.start()  # with a new token
        clients["bundle in bwrap, unix"] = DaemonClient(address, sandbox.token)
        procs.append(minimal_daemon.start(tmp / "minimal.sock"))
        minimal = DaemonClient("unix:%s" % (tmp / "minimal.sock"), token)

        rows = {("floor", "posix_spawn true"): floor,
                ("in-process", "captured spawn"): captured_spawn,
                ("minimal daemon, unix", "exec true"): lambda: minimal.exec("true")}
        for where, client in clients.items():
            client.run("true")  # open the default session before timing
            rows[(where, "ping")] = client.ping
            rows[(where, "exec true")] = (lambda c: lambda: c.exec("true"))(client)
            rows[(where, "session true")] = (lambda c: lambda: c.run("true"))(client)
        samples = {key: [] for key in rows}
        per_round = max(1, args.samples // args.rounds)
        for fn in rows.values():  # warm up
            for _ in range(50):
                fn()
        for _ in progress.steps(range(args.rounds), "noop rounds"):
            for key, fn in rows.items():
                bucket = samples[key]
                for _ in range(per_round):
                    start = time.perf_counter()
                    fn()
                    bucket.append(time.perf_counter() - start)
        floor_p50 = percentile(samples[("floor", "posix_spawn true")], 0.5)
        print("%-24s %-18s %9s %9s %9s" % ("daemon", "op", "p50 ms", "p99 ms", "x floor"))
        results = []
        for (where, op), values in samples.items():
            p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
            ratio = p50 / floor_p50
            print("%-24s %-18s %9.3f %9.3f %9.2f" % (where, op, p50 * 1e3, p99 * 1e3, ratio))
            results.append({"daemon": where, "op": op, "p50_ms": round(p50 * 1e3, 4),
                            "p99_ms": round(p99 * 1e3, 4), "ratio_to_floor": round(ratio, 3),
                            "samples": len(values)})
        print(json.dumps({"bench": "noop", "machine": {
            "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "results": results}))
    finally:
        for client in list(clients.values()) + ([minimal] if minimal else []):
            client.close()
        if sandbox is not None:
            sandbox.stop()
        for p in procs:
            p.terminate()
            p.wait()
        subprocess.run(["rm", "-rf", str(tmp)])


if __name__ == "__main__":
    main()
