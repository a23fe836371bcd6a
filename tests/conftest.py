"""Shared fixtures: real daemons as subprocesses, the real bundle, real bwrap."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandman_ray import DaemonClient

ROOT = Path(__file__).resolve().parent.parent
DAEMON = ROOT / "daemon" / "sandmand.py"
CACHE = ROOT / ".cache"
TOKEN = "test-token-0123456789"


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


@pytest.fixture(scope="session")
def bundle():
    from sandman_ray.bundle import ensure_bundle
    return ensure_bundle(CACHE / "bundle")


@pytest.fixture(scope="session")
def busybox_rootfs():
    from sandman_ray.image_builders import build_busybox_rootfs
    return build_busybox_rootfs(CACHE / "images" / "busybox")


def require_bwrap():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: make test installs it (apt-get install bubblewrap)")
