"""One LocalProvider sandbox under gVisor (``LocalProvider(isolation="gvisor")``).

The same daemon, images, pool and handles as the bubblewrap sandboxes, with gVisor's
user-space kernel (Debian's ``runsc``) between the sandbox and the host's::

    /bin/sh -c LAUNCH                           join the sandbox's cgroups
      runsc --root STATE/runsc --network=none --host-uds=all --overlay2=root:memory
            --ignore-cgroups --platform=ptrace run --bundle STATE/oci ID
        /.sandman/bin/sandmand --listen unix:/run/sandman/sock --token-fd 0 --env-fd 0
                               --ready-fd 1

The OCI bundle names the image's rootfs (read-only on the host: writes go to an
overlay in the sandbox's memory, counted against its memory limit), the daemon bundle
read-only at ``/.sandman`` and the run directory at ``/run/sandman``, where the daemon's
socket is a host socket (``--host-uds``). That directory is a 1 MiB tmpfs mounted in
the chain's private mount namespace, so nothing inside can fill the host's disk
through it; the host reaches the socket through ``/proc/<chain>/root``. The token
reaches the daemon on its stdin, the sandbox's environment after it (the daemon's own
is PATH alone), and its address comes back on its stdout: gVisor passes no other
descriptor. Commands run
in the sandbox's daemon, not through ``runsc exec`` per command.

With ``network=True`` the chain starts in a network namespace of its own, which the
agent filters and connects through slirp4netns exactly as for a bubblewrap sandbox
(providers/network.py), and runsc runs with ``--network=host`` in it: the sandbox's
sockets are gVisor's calls on the host kernel's sockets of that namespace, so the
filter's OUTPUT chain sees every connection. (gVisor's own network stack would write
raw frames to the tap device, which no netfilter chain sees: the filter would not
hold.) The price is that the sandbox's network calls reach the host kernel's network
stack, as a bubblewrap sandbox's do.

Measured here (ptrace platform; /dev/kvm does not work in this VM): ready ~260 ms,
``exec true`` ~6 ms. Not supported: the ``host`` image (a view of the host's files
that gVisor's file server would read as host root).
"""

import json
import os
import secrets
import shutil
import subprocess
import time
from typing import List

from sandman_ray.bundle import DEFAULT_MOUNT, daemon_argv
from sandman_ray.errors import ProviderError
from sandman_ray.providers.local.bwrap import SandboxProcess
from sandman_ray.providers.local.chain import (
    DEFAULT_PATH, JOIN_CGROUPS, SOCKET_DIR, _close, capabilities, memfd_holding)
from sandman_ray.providers.network import RESOLV_CONF
from sandman_ray.providers.syscalls import oci_seccomp
from sandman_ray.spec import nofile_limits

# In its private mount namespace the launch puts a small tmpfs on the run directory,
# the one directory the sandbox writes on the host's side (arguments: run dir, uid:gid).
_LAUNCH = JOIN_CGROUPS + r"""[ -z "$SANDMAN_NET_FD" ] || echo up > "/proc/self/fd/$SANDMAN_NET_FD"
mount -c -t tmpfs -o "size=1m,nr_inodes=64,mode=0700,uid=${2%%:*},gid=${2#*:},nosuid,nodev,noexec" \
    sandman-run "$1" || exit 98
shift 2
exec "$@"
"""
PLATFORM = "ptrace"
KILL_WAIT_S = 5.0  # for runsc run to end once its container is killed


class GvisorProcess(SandboxProcess):
    """A sandbox whose daemon runs under ``runsc``."""

    renewable = False  # a reset starts it afresh

    def check(self) -> None:
        if self.image.rootfs is None:
            raise ProviderError("image host: under gVisor a sandbox needs an image (its file "
                                "server reads as host root); use builtin:debian or a rootfs",
                                "fatal")

    @property
    def address(self) -> str:
        # the run directory's tmpfs is in the chain's mount namespace only
        pid = self.proc.pid if self.proc is not None else 0
        return "unix:/proc/%d/root%s/sock" % (pid, self.state_dir / "run")

    @property
    def container_id(self) -> str:
        return self.sandbox_id

    def _config(self) -> dict:
        user = self._user()
        uid, _, gid = (user or "0:0").partition(":")
        caps = ["CAP_" + cap for cap in capabilities(self.spec)]
        workdir = self._workdir()
        return {
            "ociVersion": "1.0.0",
            "process": {
                "terminal": False, "user": {"uid": int(uid), "gid": int(gid or uid)},
                "args": daemon_argv() + [
                    "--listen", "unix:%s/sock" % SOCKET_DIR, "--workdir", workdir,
                    "--token-fd", "0", "--env-fd", "0", "--ready-fd", "1",
                    "--limits", ",".join("%s=%s" % kv for kv in sorted(self.applied.items()))],
                # the daemon's own: the sandbox's follows the token on its stdin
                "env": ["PATH=" + DEFAULT_PATH],
                "cwd": "/", "noNewPrivileges": True,  # the daemon makes and enters workdir
                # open files per process in gVisor's kernel, as under bubblewrap
                "rlimits": [dict(zip(("type", "soft", "hard"),
                                     ("RLIMIT_NOFILE",) + nofile_limits(self.spec)))],
                "capabilities": {k: caps for k in ("bounding", "effective", "permitted")}},
            "root": {"path": str(self.image.rootfs), "readonly": False},
            "hostname": self.hostname,
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                {"destination": DEFAULT_MOUNT, "type": "bind", "source": str(self.bundle),
                 "options": ["rbind", "ro"]},
                {"destination": SOCKET_DIR, "type": "bind",
                 "source": str(self.state_dir / "run"), "options": ["rbind", "rw"]}] + (
                [{"destination": "/etc/resolv.conf", "type": "bind",
                  "source": str(self.state_dir / "resolv.conf"), "options": ["rbind", "ro"]}]
                if self.spec.network else []),
            # with a network, the one the chain made (runsc --network=host)
            "linux": {"namespaces": [{"type": t} for t in
                                     ("pid", "ipc", "uts", "mount") +
                                     (() if self.spec.network else ("network",))],
                      # the policy of record in gVisor's own kernel (runsc --oci-seccomp)
                      "seccomp": oci_seccomp(frozenset(self.spec.capabilities))}}

    def argv(self, *_unused) -> List[str]:
        network = "--network=host" if self.spec.network else "--network=none"
        chain = ["unshare", "--mount", "--propagation", "private"] + (
            ["--net"] if self.spec.network else [])
        return chain + [
            "/bin/sh", "-c", _LAUNCH, "sandman-launch", str(self.state_dir / "run"),
            self._user() or "0:0",
            "runsc", "--root", str(self.state_dir / "runsc"), network,
            "--host-uds=all", "--overlay2=root:memory", "--ignore-cgroups", "--oci-seccomp",
            "--platform=" + PLATFORM, "run", "--bundle", str(self.state_dir / "oci"),
            self.container_id]

    def launch(self) -> None:
        self.check()
        self._prepare_run_dir()
        if self.cgroups is not None and not self.cgroups.dirs:
            self.cgroups.create(self.spec)
        self.applied = dict(self.cgroups.applied) if self.cgroups else {}
        self._delete_predecessor()
        (self.state_dir / "oci").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "oci" / "config.json").write_text(json.dumps(self._config()))
        self.token = secrets.token_hex(16)  # a new credential for every start
        # the token, then the sandbox's environment (for its commands, not the daemon)
        token_r = memfd_holding(self.token.encode() + b"\n" + self._environ())
        ready_r, ready_w = os.pipe()
        env = dict(PATH=DEFAULT_PATH)
        if self.spec.network:
            (self.state_dir / "resolv.conf").write_text(RESOLV_CONF)
        net_w = self._network_pipe(env)
        try:
            with self._joined() as joined:
                env.update(self._cgroup_env(joined))
                self.proc = subprocess.Popen(self.argv(), env=env, stdin=token_r,
                                             stdout=ready_w, stderr=subprocess.PIPE,
                                             start_new_session=True,
                                             pass_fds=[net_w] if net_w is not None else [])
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            _close([token_r, ready_w] + ([net_w] if net_w is not None else []))
        self.ready_fd = ready_r
        self.started_at = time.time()

    def _delete_predecessor(self) -> None:
        """``runsc delete`` of a container of this id that a reset's predecessor left
        (its state in this sandbox's runsc root); none where that holds nothing, as for
        every new sandbox (a runsc run costs ~35 ms)."""
        root = self.state_dir / "runsc"
        if root.is_dir() and any(root.iterdir()):
            self._runsc("delete", "--force", self.container_id)

    def _runsc(self, *args: str) -> None:
        """``runsc ARGS`` on this sandbox's state. With a network, runsc's control server
        listens on an abstract socket of the chain's network namespace, so the command
        joins it (from the host's, runsc kill was refused and a delete waited
        KILL_WAIT_S)."""
        join = (["nsenter", "--target", str(self.proc.pid), "--net"]
                if self.spec.network and self.proc is not None and self.proc.poll() is None
                else [])
        subprocess.run(join + ["runsc", "--root", str(self.state_dir / "runsc")] + list(args),
                       capture_output=True, stdin=subprocess.DEVNULL)

    def _prepare_run_dir(self) -> None:
        """An empty run directory for the daemon's socket (a reset's too: nothing the
        last tenant left there stays)."""
        run = self.state_dir / "run"
        if run.exists():
            shutil.rmtree(run)
        run.mkdir(mode=0o700, parents=True)  # the mount point of the launch's tmpfs

    def kill(self) -> None:
        """runsc's own kill first, and ``runsc run`` left to reap its sandbox and file
        server: SIGKILLed at once, it would leave them to this host's slow init (a
        delete took ~2 s here instead of ~50 ms)."""
        if self.proc is not None and self.proc.poll() is None:
            self._runsc("kill", self.container_id, "KILL")
            try:
                self.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # SIGKILLed below
        super().kill()
        self._runsc("delete", "--force", self.container_id)
