"""Shared fixtures: real daemons as subprocesses, the real bundle, real bwrap."""

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sandman_ray import DaemonClient

ROOT = Path(__file__).resolve().parent.parent
# the daemon package, run as a directory (``python -I -S sandman_ray/daemon/sandmand`` works too)
DAEMON = ROOT / "sandman_ray" / "daemon" / "sandmand"
CACHE = ROOT / ".cache"
TOKEN = "test-token-0123456789"
# The project's own test images (busybox, debootstrap's rootfs) are the dir: images the
# tests' LocalProviders trust: LocalProvider(image_roots=None) takes them from here
TEST_IMAGE_ROOT = str(CACHE / "images")
os.environ.setdefault("SANDMAN_IMAGE_ROOTS", TEST_IMAGE_ROOT)


class DaemonProcess:
    """A sandmand started as a subprocess of the test run."""

    def __init__(self, listen, python=sys.executable, extra=(), python_flags=(), env=None,
                 cwd=None):
        ready_r, ready_w = os.pipe()
        self.proc = subprocess.Popen(
            [python, *python_flags, str(DAEMON), "--listen", listen, "--ready-fd", str(ready_w),
             *extra],
            pass_fds=(ready_w,), env=dict(env or os.environ, SANDMAN_TOKEN=TOKEN), cwd=cwd,
            stderr=subprocess.PIPE)
        os.close(ready_w)
        with os.fdopen(ready_r) as fh:
            self.address = fh.readline().strip()
        if not self.address:
            _, err = self.proc.communicate(timeout=10)
            raise RuntimeError("daemon did not start: %s" % err.decode())
        self.token = TOKEN

    @property
    def pid(self):
        return self.proc.pid

    def client(self, **kw):
        return DaemonClient(self.address, self.token, default_timeout=60, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess("unix:%s/d.sock" % tmp_path_factory.mktemp("daemon"),
                      extra=("--hello-timeout", "1"))
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


def processes_matching(marker):
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % name, "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if marker.encode() in cmdline.replace(b"\0", b" ") and int(name) != os.getpid():
            found.append(int(name))
    return found


def unique_pool(provider, prefix: str, **config) -> str:
    """Create a pool with a fresh name on ``provider``, its watchdog quick (tests wait
    for what it reclaims); ``config`` takes PoolConfig fields."""
    import uuid
    import sandman_ray as sandman
    name = "%s-%s" % (prefix, uuid.uuid4().hex[:8])
    config.setdefault("sweep_interval_s", 0.2)
    config.setdefault("lease_grace_s", 3.0)
    sandman.create_pool(name, provider=provider, **config)
    return name


def leased(pool: str) -> int:
    """How many sandboxes of ``pool`` are leased, by the pool's own status."""
    import ray
    import sandman_ray as sandman
    return ray.get(sandman.get_pool(pool).status.remote())["states"]["leased"]


@contextlib.contextmanager
def own_pool(state_root: str, prefix: str, **config):
    """A LocalProvider pool of the test's own (so that its counts are the test's), shut
    down at the end; ``config`` takes PoolConfig fields."""
    import sandman_ray as sandman
    name = unique_pool(sandman.LocalProvider(state_root=state_root,
                                             cache_root=str(CACHE / "provider")),
                       prefix, **config)
    try:
        yield name
    finally:
        sandman.shutdown_pool(name)


def restart_keeps_specs(pool: str, spec) -> None:
    """Lease a sandbox of ``spec`` from ``pool``, kill the PoolActor (Ray restarts it)
    and check that the new one recovered the sandbox with its whole spec (limits, env,
    TTL, labels) and that the lease still serves."""
    import ray
    import sandman_ray as sandman
    actor = sandman.get_pool(pool)
    with sandman.sandbox(spec, pool=pool, timeout=120) as sb:
        sandbox_id = ray.get(sb.sandbox_id.remote())
        before = ray.get(actor.status.remote())["pid"]
        wanted = [s["spec"] for s in ray.get(actor.list_sandboxes.remote())
                  if s["sandbox_id"] == sandbox_id]
        ray.kill(actor, no_restart=False)

        def recovered():
            try:
                status = ray.get(actor.status.remote(), timeout=5)
            except (ray.exceptions.RayError, sandman.SandmanError):
                return None  # restarting
            if status["pid"] == before:
                return None
            return [s for s in ray.get(actor.list_sandboxes.remote()) if s["sandbox_id"] == sandbox_id]
        found = wait_until(recovered, timeout=60, what="the pool to come back with the sandbox")
        assert found[0]["state"] == "leased" and [found[0]["spec"]] == wanted
        assert wanted[0]["env"] == dict(spec.env) and wanted[0]["ttl_s"] == spec.ttl_s
        assert ray.get(sb.exec.remote("echo $SPEC_CHECK")).stdout == b"kept\n"


def free_port() -> int:
    """A TCP port nobody listens on now (for a server a test starts)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def freezer_state(pool, sandbox_id):
    """The sandbox's freezer state as the host's cgroup files say it (v1 freezer.state,
    v2 cgroup.events)."""
    for path in glob.glob("/sys/fs/cgroup/freezer/sandman/%s-*/%s/freezer.state"
                          % (pool, sandbox_id)):
        return open(path).read().strip()
    for path in glob.glob("/sys/fs/cgroup/sandman/%s-*/%s/cgroup.events" % (pool, sandbox_id)):
        return "FROZEN" if "frozen 1" in open(path).read() else "THAWED"
    raise AssertionError("sandbox %s of pool %s has no freezer group" % (sandbox_id, pool))


def wait_until(predicate, timeout=10.0, what="condition"):
    """Poll ``predicate`` until it holds (for effects outside our control: another
    process's exit), failing with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))
        time.sleep(0.02)


def exercise_handle(sb):
    """Every kind of operation once through a SandboxHandle: exec, a session that
    keeps cwd and variables, files, a background process (left running)."""
    import ray
    assert ray.get(sb.exec.remote("echo hi")).stdout == b"hi\n"
    ray.get(sb.run.remote("cd /tmp && export A=1"))
    assert ray.get(sb.run.remote("echo $A $(pwd)")).stdout == b"1 /tmp\n"
    ray.get(sb.write_file.remote("/work/x", b"data"))
    assert ray.get(sb.read_file.remote("/work/x")) == b"data"
    pid = ray.get(sb.spawn.remote("sleep 100"))
    assert ray.get(sb.proc_status.remote(pid)).running


HOLDING_DRIVER = """
import sys, ray, sandman_ray as sandman
ray.init(address=sys.argv[1], namespace=sys.argv[2])
handles = [sandman.acquire(sys.argv[4], pool=sys.argv[3], timeout=120)
           for _ in range(int(sys.argv[5]))]
ray.get([h.exec.remote("true") for h in handles])
print("holding", flush=True)
sys.stdin.read()
"""


def holding_driver(cluster, namespace, pool, image, count):
    """A driver process of its own that leases ``count`` sandboxes and holds them
    until it is killed; returned once it holds them."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDING_DRIVER, cluster, namespace, pool,
                             image, str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=str(ROOT))
    for line in proc.stdout:  # Ray's own log lines may come first
        if line.strip() == "holding":
            return proc
    raise AssertionError("the driver exited before holding its sandboxes")


@pytest.fixture(scope="session")
def bundle():
    from sandman_ray.bundle import ensure_bundle
    return ensure_bundle(CACHE / "bundle")


@pytest.fixture(scope="session")
def busybox_rootfs():
    from sandman_ray.image_builders import build_busybox_rootfs
    return build_busybox_rootfs(CACHE / "images" / "busybox")


@pytest.fixture(scope="session")
def busybox_image(busybox_rootfs):
    """The busybox rootfs as an image reference."""
    return "dir:%s" % busybox_rootfs


# The test session's Ray: one local Ray of 2 CPUs that the modules share (each started
# its own before: ray.init ~4 s and its shutdown ~1-2 s, per module). A module that
# needs a Ray of another shape (a dashboard, several nodes) stops it with own_ray(), and
# the next module that asks starts it again.
RAY_NAMESPACE = "sandman-tests"
_shared_ray = {"up": False}


def shared_ray() -> str:
    """The session's shared local Ray, started if it is not up; its GCS address."""
    import ray
    if _shared_ray["up"] and ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    require_bwrap()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE)
    _shared_ray["up"] = True
    return ray.get_runtime_context().gcs_address


def own_ray(**init_kwargs) -> None:
    """``ray.init(**init_kwargs)`` for a module whose Ray has a shape of its own: the
    shared one is stopped first (and started again by the next module that asks)."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    _shared_ray["up"] = False
    ray.init(**init_kwargs)


def local_ray(namespace: str = RAY_NAMESPACE):
    """The body of a module's ``cluster`` fixture (``yield from local_ray()``): the
    session's shared Ray; yields its GCS address. (Its namespace is the session's.)"""
    yield shared_ray()


@pytest.fixture(scope="session", autouse=True)
def _ray_ends_with_the_session():
    yield
    import ray
    if ray.is_initialized():
        ray.shutdown()


LOCAL_STATE = "/tmp/sandman-ray-test/state"
LOCAL_CACHE = str(ROOT / ".cache" / "provider")


def run(coro):
    return asyncio.run(coro)


def new_id():
    return "sb-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def local_provider():
    """A LocalProvider of the test module's own, on the session's Ray."""
    from sandman_ray.providers.local import LocalProvider
    shared_ray()
    p = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE).bind(
        "test-%s" % uuid.uuid4().hex[:6])
    yield p
    run(p.shutdown())


class Sandbox:
    """A provider's sandbox, with a daemon client, for the length of a ``with`` block."""

    def __init__(self, provider, spec):
        from sandman_ray.spec import SandboxSpec
        self.provider, self.spec, self.id = provider, SandboxSpec.of(spec), new_id()

    def __enter__(self):
        self.info = run(self.provider.create(self.id, self.spec, {"test": "yes"}))
        self.client = DaemonClient(self.info.address, self.info.token, default_timeout=60)
        return self

    def __exit__(self, *exc):
        self.client.close()
        run(self.provider.delete(self.id))


def require_bwrap():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: make test installs it (apt-get install bubblewrap)")
