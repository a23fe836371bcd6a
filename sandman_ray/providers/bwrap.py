"""One bubblewrap sandbox on this host: a rootfs, the daemon bundle at /.sandman, the
daemon's unix socket in a host directory. The LocalProvider's node agent builds on it;
the demo and the tests use it directly."""

import os
import secrets
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.bundle import DEFAULT_MOUNT, daemon_argv
from sandman_ray.errors import SandboxLost

SOCKET_DIR = "/run/sandman"
# host directories a sandbox of the host's root gets fresh (or not at all)
HOST_SKIPPED = {"proc", "dev", "sys", "tmp", "run", ".sandman", "lost+found"}


class BwrapSandbox:
    """A sandbox process tree: ``start()`` returns once the daemon listens."""

    def __init__(self, rootfs: Path, bundle: Path, run_dir: Path, *, network: bool = False,
                 hostname: str = "sandbox", env: Optional[Dict[str, str]] = None,
                 workdir: str = "/"):
        self.rootfs, self.bundle, self.run_dir = Path(rootfs), Path(bundle), Path(run_dir)
        self.network, self.hostname, self.workdir = network, hostname, workdir
        self.env = dict(env or {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                "HOME": "/root"})
        self.token = secrets.token_hex(16)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return "unix:%s" % (self.run_dir / "sock")

    def root_args(self) -> List[str]:
        """The root filesystem: the rootfs read-only; for the host's own root, a tmpfs
        with the host's top-level directories bound read-only into it (the host root
        cannot get /.sandman created in it)."""
        if self.rootfs != Path("/"):
            return ["--ro-bind", str(self.rootfs), "/"]
        args = ["--tmpfs", "/"]
        for entry in sorted(os.listdir("/")):
            if entry in HOST_SKIPPED:
                continue
            path = "/" + entry
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        return args

    def argv(self, ready_fd: int) -> List[str]:
        argv = ["bwrap"] + self.root_args() + [
                "--ro-bind", str(self.bundle), DEFAULT_MOUNT,
                "--bind", str(self.run_dir), SOCKET_DIR,
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", self.hostname, "--die-with-parent", "--new-session",
                "--chdir", self.workdir]
        if not self.network:
            argv.append("--unshare-net")
        return argv + daemon_argv() + ["--listen", "unix:%s/sock" % SOCKET_DIR,
                                       "--workdir", self.workdir, "--ready-fd", str(ready_fd)]

    def start(self, timeout: float = 10.0) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ready_r, ready_w = os.pipe()
        env = dict(self.env, SANDMAN_TOKEN=self.token)
        try:
            self.proc = subprocess.Popen(
                self.argv(ready_w), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(ready_w,))
        finally:
            os.close(ready_w)
        try:
            line = _read_line(ready_r, timeout)
        finally:
            os.close(ready_r)
        if not line:
            err = self.stop()
            raise SandboxLost("sandbox daemon did not start within %.1f s: %s" % (timeout, err))
        return self.address

    def stop(self) -> str:
        """Kill the whole sandbox (bwrap is the pid namespace's init: every process in
        it dies with it). Returns what bwrap printed on stderr."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        _, err = self.proc.communicate()
        self.proc = None
        try:
            (self.run_dir / "sock").unlink()
        except FileNotFoundError:
            pass
        return (err or b"").decode(errors="replace").strip()


def _read_line(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 256)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()
