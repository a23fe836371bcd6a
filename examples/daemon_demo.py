"""A tour of the sandbox daemon: a busybox image (no libc, no Python) in a bubblewrap
sandbox, the self-contained daemon bundle inside it, and the client driving it.

Run with ``.venv/bin/python examples/daemon_demo.py``.
"""

import statistics
import tempfile
import time
from pathlib import Path

from sandman_ray import DaemonClient
from sandman_ray.bundle import bundle_size, ensure_bundle
from sandman_ray.image_builders import build_busybox_rootfs
from sandman_ray.providers.local.bwrap import BwrapSandbox

CACHE = Path(__file__).resolve().parent.parent / ".cache"


def timed(fn, n=300):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e3, samples[int(len(samples) * 0.99)] * 1e3


def main() -> None:
    bundle = ensure_bundle(CACHE / "bundle")
    rootfs = build_busybox_rootfs(CACHE / "images" / "busybox")
    print("daemon bundle: %s (%.1f MB)" % (bundle, bundle_size(bundle) / 1e6))
    with tempfile.TemporaryDirectory(prefix="sandman-demo-") as run_dir:
        sandbox = BwrapSandbox(rootfs, bundle, Path(run_dir), hostname="demo")
        started = time.perf_counter()
        address = sandbox.start()
        print("sandbox up, daemon answering at %s after %.0f ms"
              % (address, (time.perf_counter() - started) * 1e3))
        try:
            with DaemonClient(address, sandbox.token, default_timeout=30) as client:
                info = client.info()
                print("inside: %s, daemon python %s, hostname %s"
                      % (info["os_release"].get("NAME"), info["python"], info["hostname"]))
                print("$ ls /        ->", " ".join(client.exec("ls /").text.split()))
                print("$ ps          ->", len(client.exec("ps").text.splitlines()) - 1, "processes")
                client.run("cd /tmp && export GREETING=hello && greet() { echo \"$GREETING $1\"; }")
                print("session       ->", client.run("greet world; pwd").text.split())
                client.write_file("/tmp/work/notes.txt", b"state survives between calls\n")
                print("file          ->", client.read_file("/tmp/work/notes.txt").decode().strip())
                pid = client.spawn("for i in 1 2 3; do echo tick $i; done")
                client.proc_wait(pid, timeout=10)
                print("background    ->", client.proc_output(pid).data.decode().split("\n")[:3])
                slow = client.exec("sleep 30", timeout=0.5)
                print("timeout       -> timed_out=%s exit_code=%s after %.2f s"
                      % (slow.timed_out, slow.exit_code, slow.duration_s))
                ping = timed(client.ping)
                noop = timed(lambda: client.exec("true"))
                sess = timed(lambda: client.run("true"))
                print()
                print("%-22s %9s %9s" % ("round trip (unix)", "p50 ms", "p99 ms"))
                for name, (p50, p99) in (("ping", ping), ("exec true", noop),
                                         ("session run true", sess)):
                    print("%-22s %9.3f %9.3f" % (name, p50, p99))
        finally:
            sandbox.stop()
    print("\nsandbox stopped; nothing left running")
    pool_tour(rootfs)


def pool_tour(rootfs: Path) -> None:
    """The same through the public API: a pool on a local Ray, handles, reset reuse."""
    import asyncio
    import ray
    import sandman_ray as sandman
    from sandman_ray.providers.base import POOL_LABEL

    print("\n-- pool on a local Ray --")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    image = "dir:%s" % rootfs
    provider = sandman.LocalProvider(cache_root=str(CACHE / "provider"),
                                     image_roots=[str(rootfs.parent)])  # dir: images' home
    try:
        sandman.create_pool("demo", provider=provider, warm={image: 2})
        started = time.perf_counter()
        sb = sandman.acquire(image, pool="demo", timeout=60)
        print("first acquire            %6.0f ms" % ((time.perf_counter() - started) * 1e3))
        ray.get(sb.write_file.remote("/root/episode.txt", b"episode 1"))
        print("exec through the handle  ->", ray.get(sb.exec.remote("cat /root/episode.txt")).text)
        sandman.release(sb)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            sb = sandman.acquire(image, pool="demo", timeout=60)
            times.append(time.perf_counter() - started)
            assert ray.get(sb.exec.remote("ls /root/episode.txt")).exit_code != 0  # reset
            sandman.release(sb)
        times.sort()
        print("warm acquire p50         %6.1f ms  (20 episodes, each on a reset sandbox)"
              % (times[10] * 1e3))
        sandman.shutdown_pool("demo")
        left = asyncio.run(sandman.LocalProvider(cache_root=str(CACHE / "provider"))
                           .bind("demo").list({POOL_LABEL: "demo"}))
        print("sandboxes left: %d" % len(left))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
