"""One bubblewrap sandbox on this host.

The process chain, per sandbox::

    unshare --mount --propagation private  /bin/sh -c LAUNCH          (host root)
        in the sandbox's cgroups from its first instruction (the agent's thread sits
        in them while it forks the chain: Cgroups.joined_by_this_thread; under v2 the
        launch joins them as its first step)
        mount -a -T state_dir/fstab: attach, in this private mount namespace, the
            mounts the agent made detached (providers/mounts.py):
            - the writable layer, a new size- and inode-limited nosuid,nodev tmpfs
              owned by the sandbox's range, over the state root: it also holds the
              directories below (/dev/shm's among them), and hides every other
              sandbox's state from the setup
            - the overlay (lower: the image, idmapped to the range; upper: that tmpfs)
            - a devpts of the sandbox's own, of at most ``spec.ptys`` terminals
            - the daemon bundle (read-only)
        exec nsenter --user=RANGE'S NAMESPACE        (root inside = the range's first id)
          bwrap --bind ROOT / --ro-bind BUNDLE /.sandman
                --unshare-pid/ipc/uts/cgroup[/net] --as-pid-1 --die-with-parent
                --ro-bind /proc/sys /proc/sys --cap-drop ALL --cap-add (a container's
                default set) --seccomp FD (providers/local/seccomp.py) ...
            /.sandman/bin/sandmand --listen fd:N ...                    (PID 1 inside)

bwrap's arguments, the launch scripts and the mounts are ``chain.py``'s.

The daemon's socket (state_dir/sock, root's, 0600) is bound and listened on by the
agent, which hands the daemon its descriptor: no directory of the host's disk is
writable from inside, and nothing inside can move the socket aside or stand in for it.

Every mount is attached only in that private mount namespace, so it vanishes with the
sandbox: no mount can leak, and the writable layer (a tmpfs) is gone with it. bwrap dies
with its parent (the node agent) and takes the whole pid namespace with it; a kill
(delete, reset, shutdown) then kills by cgroup until it is empty, and a range whose
cgroup did not empty is never lent again (providers/userns.py). A reset renews the sandbox in place where it can
(``renewable``: its root is then a read-only skeleton holding the tenant's generation,
providers/local/renew.py), else starts the chain again: a fresh layer, a fresh daemon,
a new token either way.

The tmpfs goes over the state root because the sandbox's setup runs as the range's
root, which the host's 0700 state and cache roots keep out: it sees this sandbox's
directories at their usual paths, and nothing of the other sandboxes. One ``mount -a``
attaches them all: each exec in the chain costs ~1.3 ms here.

An agent that does not run as root (``unprivileged``) cannot map a range, make
detached mounts or cgroups. Its chain starts in a user namespace of its own uid alone
(``unshare --user --map-root-user``: root inside is the agent's uid, every other id
unmapped), which owns the sandbox's mount (and network) namespace; there the launch
mounts the size-limited tmpfs over the state root, the overlay over the image (which
must be the agent's own files: its caches are) and the bundle, then bwrap runs as
that namespace's root with the same arguments. Limits are prlimit's, set inside that
namespace (RLIMIT_AS per process; RLIMIT_NPROC, which the kernel counts for the
namespace's own processes and, above it, against the agent's own limit), and the
tmpfs's size.
"""

import asyncio
import os
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.errors import ProviderError, SandboxLost
from sandman_ray.images import PreparedImage
from sandman_ray.providers.local import renew
from sandman_ray.providers.local.cgroups import Cgroups
from sandman_ray.providers.local.chain import (
    DEFAULT_PATH, Chain, _close, _filter_pipe, _high, memfd_holding, pipe_holding)
from sandman_ray.providers.network import SandboxNetwork
from sandman_ray.providers.userns import IdRange
from sandman_ray.spec import SandboxSpec


def secure_root(path: Path) -> Path:
    """``path`` as a state or cache root: made 0700 if missing; one that exists must be
    a directory of this user, whose ancestors no one else may rename it in. One that
    another user made, or a link, is refused: whoever controls it controls the
    sandboxes' layers or images."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ProviderError("state or cache root %s is not a directory (a link?): refused"
                            % path, "fatal")
    if st.st_uid != os.geteuid():
        raise ProviderError("state or cache root %s belongs to uid %d, not to this agent's "
                            "uid %d: refused" % (path, st.st_uid, os.geteuid()), "fatal")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    for ancestor in path.parents:
        link = os.lstat(ancestor)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != 0:
            # another user could point it elsewhere later (/dev/shm and /tmp are
            # everyone's to write in)
            raise ProviderError("state or cache root %s: %s is a link of uid %d: refused"
                                % (path, ancestor, link.st_uid), "fatal")
        mode = os.stat(ancestor)
        if mode.st_uid not in (0, os.geteuid()) or (
                mode.st_mode & 0o022 and not mode.st_mode & stat.S_ISVTX):
            raise ProviderError("state or cache root %s: %s may be changed by another user "
                                "(uid %d, mode %o): refused"
                                % (path, ancestor, mode.st_uid, stat.S_IMODE(mode.st_mode)),
                                "fatal")
    return path


def view_root(state_root: Path) -> Path:
    """Where a sandbox's launch mounts its tmpfs: over the state root, or over the
    highest of its ancestors that others cannot search (the sandbox's setup, as the
    range's root, must reach the paths it is shown)."""
    for ancestor in reversed(Path(state_root).parents):
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return Path(state_root)


class SandboxProcess(Chain, renew.Renewable):
    """A sandbox's process chain and its state directory::

        state_dir/sock         the daemon's socket, bound by the agent (0600, root's)
        state_dir/fstab        what the launch mounts
        state_dir/upper, work  the overlay's writable layer  } on the chain's tmpfs,
        state_dir/root         the overlay's mount point     } seen by nothing else

    ``view_root`` is the state root the chain's tmpfs is mounted over. ``ids`` is the
    sandbox's range of host ids (providers/userns.py); None runs it without a user
    namespace, as host root with a reduced capability set, or, ``unprivileged`` (the
    agent is not root), in a user namespace of the agent's uid alone.

    ``launch`` starts it; ``wait_ready`` (async) or ``wait_ready_blocking`` waits until
    the daemon listens; ``kill`` stops everything, the writable layer with it.
    """

    def __init__(self, sandbox_id: str, image: PreparedImage, bundle: Path, state_dir: Path,
                 spec: SandboxSpec, cgroup_group: Optional[str] = None, hostname: str = "",
                 ids: Optional[IdRange] = None, view_root: Optional[Path] = None,
                 unprivileged: bool = False):
        if unprivileged and (ids is not None or cgroup_group):
            raise ValueError("an unprivileged sandbox has no id range and no cgroups")
        self.sandbox_id, self.image, self.bundle = sandbox_id, image, Path(bundle)
        self.state_dir, self.spec, self.ids = Path(state_dir), spec, ids
        self.unprivileged = unprivileged
        self.view_root = Path(view_root) if view_root is not None else self.state_dir.parent
        self.hostname = hostname or sandbox_id[:63]
        self.cgroups = Cgroups(cgroup_group) if cgroup_group else None
        self.token = secrets.token_hex(16)
        self.proc: Optional[subprocess.Popen] = None
        self.ready_fd: Optional[int] = None
        self.net_fd: Optional[int] = None  # the launch writes to it in its network namespace
        self.neighbours: List[str] = []  # the Ray cluster's node addresses (network=True)
        self.network: Optional[SandboxNetwork] = None
        self.applied: Dict[str, str] = {}
        self.started_at = 0.0
        self.admin_token = ""  # the agent's own token for this start's daemon (renew)
        self.slot = 0  # the slot (renew.SLOTS) of the generation the daemon runs in
        self.layer: Optional[renew.Layer] = None  # the next generation, made ahead
        self.renewed = 0  # renews since this start
        # the current generation's writable layer (a detached tmpfs) and the path of
        # its upper directory in it, kept open for snapshots (providers/local/snapshots.py)
        self.writable: Optional[tuple] = None
        self.keep: set = set()  # host pids of the chain that holds the sandbox (keepers)
        self.emptied = True  # the last kill left no process in the sandbox's cgroups

    @property
    def address(self) -> str:
        return "unix:%s" % (self.state_dir / "sock")

    def launch(self) -> None:
        """Start the chain (from a thread that lives as long as the sandbox should:
        bwrap dies with its parent thread)."""
        if self.unprivileged and self.spec.network and \
                not os.access("/dev/net/tun", os.R_OK | os.W_OK):
            raise ProviderError(
                "network=True for an agent that is not root needs /dev/net/tun that uid %d "
                "may open (Debian's udev makes it 0666; here it is %s)"
                % (os.geteuid(), oct(stat.S_IMODE(os.stat("/dev/net/tun").st_mode))
                   if os.path.exists("/dev/net/tun") else "missing"), "fatal")
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.cgroups is not None and not self.cgroups.dirs:
            self.cgroups.create(self.spec)
        self.applied = dict(self.cgroups.applied) if self.cgroups else {}
        mounts = self._mounts()  # first: they may fail, and nothing else is open yet
        if "layer" in mounts:
            self.hold_writable(os.dup(mounts["layer"]),
                               self.state_dir.relative_to(self.view_root) / "upper")
        try:
            (self.state_dir / "fstab").write_text(self._fstab(mounts))
            self.token = secrets.token_hex(16)  # a new credential for every start
            ready_r, ready_w = os.pipe()
        except BaseException:
            _close(mounts.values())
            raise
        ready_w = _high(ready_w)
        listen_fd = _high(self._listen())
        filter_r = _filter_pipe(self.spec)
        filter_r = _high(filter_r) if filter_r is not None else None
        token_fd = _high(pipe_holding(self.token.encode()))
        env_fd = _high(memfd_holding(self._environ()))
        self.admin_token = secrets.token_hex(16)  # the agent's, for renew
        admin_fd = _high(pipe_holding(self.admin_token.encode())) if self.renewable else None
        self.slot, self.renewed = 0, 0  # the first generation, bwrap's
        # The chain runs as host root until nsenter: nothing of the image's or the spec's
        # environment (PATH, LD_PRELOAD ...) may reach it; bwrap hands that to the daemon.
        env = dict(PATH=DEFAULT_PATH)
        net_w = self._network_pipe(env)
        passed = [fd for fd in (ready_w, listen_fd, filter_r, token_fd, net_w, admin_fd,
                                env_fd) if fd is not None]
        lower = mounts.pop("lower", None)
        try:
            # the lower layer is the chain's stdin until the overlay is mounted; the
            # chain is in the sandbox's cgroups from its first instruction
            with self._joined() as joined:
                env.update(self._cgroup_env(joined))
                self.proc = subprocess.Popen(
                    self.argv(ready_w, filter_r, token_fd, listen_fd, admin_fd, env_fd),
                    env=env,
                    stdin=subprocess.DEVNULL if lower is None else lower,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    pass_fds=passed + list(mounts.values()), start_new_session=True)
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            _close(passed + list(mounts.values()) + ([lower] if lower is not None else []))
        self.ready_fd = ready_r
        self.started_at = time.time()

    def _network_pipe(self, env: Dict[str, str]) -> Optional[int]:
        """With ``network=True``: the write end of the pipe on which the launch says its
        network namespace exists (named in ``env`` as SANDMAN_NET_FD), and the network
        to set up then; else None."""
        if not self.spec.network:
            return None
        self.net_fd, net_w = os.pipe()
        net_w = _high(net_w)
        env["SANDMAN_NET_FD"] = str(net_w)
        self.network = SandboxNetwork(self.sandbox_id, self.spec.network_allow,
                                      self.neighbours)
        return net_w

    def _listen(self) -> int:
        """The daemon's listening socket, new at every start, as a descriptor."""
        path = self.state_dir / "sock"
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            where = os.open(self.state_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # through the directory's descriptor: a unix path holds 107 bytes
                sock.bind("/proc/self/fd/%d/sock" % where)
                # 0600 (only root connects) before it listens, when no one can connect
                # yet; not by the umask, which every launcher thread shares
                os.chmod("/proc/self/fd/%d/sock" % where, 0o600)
            finally:
                os.close(where)
            sock.listen(1024)
            return sock.detach()
        except BaseException:
            sock.close()
            raise

    def _joined(self):
        """A ``with`` block whose fork starts in the sandbox's cgroups (see
        Cgroups.joined_by_this_thread)."""
        import contextlib
        return (self.cgroups.joined_by_this_thread() if self.cgroups
                else contextlib.nullcontext(set()))

    def _cgroup_env(self, joined=()) -> Dict[str, str]:
        """What JOIN_CGROUPS in a launch script reads: the groups it joins (not those
        the forking thread ``joined``, which the launch starts in)."""
        groups = self.cgroups or Cgroups("")
        return {"SANDMAN_CGROUP_PROCS": " ".join(groups.procs_files(False, joined)),
                "SANDMAN_CGROUP_TRACK": " ".join(groups.procs_files(True, joined))}

    def hold_writable(self, tmpfs: int, upper) -> None:
        """Keep ``tmpfs``, the current generation's writable layer, open (the old one
        closed): a snapshot reads ``upper`` in it."""
        self.drop_writable()
        self.writable = (tmpfs, str(upper))

    def drop_writable(self) -> None:
        if self.writable is not None:
            os.close(self.writable[0])
            self.writable = None

    def open_upper(self) -> int:
        """The upper directory of the current generation, open (the caller closes it)."""
        tmpfs, upper = self.writable
        return os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=tmpfs)

    def _take_ready_fd(self) -> int:
        """The ready pipe, owned by the caller from here on: a ``kill`` meanwhile (from
        a delete on another thread) leaves it open, and the caller reads EOF."""
        fd, self.ready_fd = self.ready_fd, None
        if fd is None:
            raise SandboxLost("sandbox %s was stopped before its daemon was ready"
                              % self.sandbox_id)
        return fd

    async def wait_ready(self, timeout: float) -> str:
        """Wait (without blocking the loop) until the daemon listens, and its network,
        if it has one, is up (set up while the daemon starts)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        buf = bytearray()
        fd = self._take_ready_fd()
        network = asyncio.ensure_future(self._network_async(timeout)) \
            if self.network is not None else None

        def readable():
            if done.done():
                return
            try:
                chunk = os.read(fd, 256)
            except OSError:
                chunk = b""
            buf.extend(chunk)
            if not chunk or buf.endswith(b"\n"):
                done.set_result(bool(chunk))
        loop.add_reader(fd, readable)
        try:
            ok = await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            ok = False
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        if not ok:
            if network is not None:
                network.cancel()
            raise SandboxLost("sandbox %s: daemon did not start within %.1f s: %s"
                              % (self.sandbox_id, timeout, self._failure()))
        if network is not None:
            try:
                await network
            except SandboxLost as exc:
                raise SandboxLost("%s (%s)" % (exc, self._failure())) from None
        self._note_keepers()
        return self.address

    async def _network_async(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fd, self.net_fd = self.net_fd, None
        up = loop.create_future()
        loop.add_reader(fd, lambda: up.done() or up.set_result(None))
        try:
            await asyncio.wait_for(up, timeout)
        except asyncio.TimeoutError:
            raise SandboxLost("sandbox %s: its network namespace did not appear within "
                              "%.1f s" % (self.sandbox_id, timeout)) from None
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        await loop.run_in_executor(None, self._start_network)

    def _start_network(self) -> None:
        network, proc = self.network, self.proc
        if network is None or proc is None or proc.poll() is not None:
            raise SandboxLost("sandbox %s stopped before its network was up" % self.sandbox_id)
        network.start(proc.pid, self.cgroups.procs_files() if self.cgroups else (),
                      own_userns=self.unprivileged)

    def wait_ready_blocking(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        buf = b""
        if self.network is not None:  # first the network, then the daemon
            fd, self.net_fd = self.net_fd, None
            try:
                up = select.select([fd], [], [], timeout)[0]
            finally:
                os.close(fd)
            if not up:
                raise SandboxLost("sandbox %s: its network namespace did not appear within "
                                  "%.1f s: %s" % (self.sandbox_id, timeout, self._failure()))
            self._start_network()
        fd = self._take_ready_fd()
        try:
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    break
                chunk = os.read(fd, 256)
                if not chunk:
                    break
                buf += chunk
        finally:
            os.close(fd)
        if not buf.endswith(b"\n"):
            raise SandboxLost("sandbox %s: daemon did not start within %.1f s: %s"
                              % (self.sandbox_id, timeout, self._failure()))
        self._note_keepers()
        return self.address

    def _note_keepers(self) -> None:
        """Note the host pids that hold the sandbox: the chain's (bwrap, and its init
        where the daemon is not PID 1) down to the daemon. Noted once the daemon
        listens, before anything of a tenant runs (later, a tenant's process could
        bear the daemon's name); a kill for the sandbox's budgets spares them."""
        keep, pid = {self.proc.pid}, self.proc.pid
        for _ in range(3):  # bwrap -> (its init ->) the daemon: one child at each step
            try:
                found = renew.children(pid)
                with open("/proc/%d/cmdline" % found[0], "rb") as fh:
                    cmdline = fh.read()
            except (OSError, IndexError):
                break
            pid = found[0]
            keep.add(pid)
            if b"sandmand" in cmdline:
                break
        self.keep = keep

    def keepers(self) -> set:
        return set(self.keep)

    def _failure(self) -> str:
        """Stop a sandbox that did not start and say what it printed."""
        err = ""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            if self.proc.stderr and not self.proc.stderr.closed:
                err = self.proc.stderr.read().decode(errors="replace").strip()
        self.kill()
        return err[-2000:] or "no output"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Stop the sandbox: SIGKILL to bwrap takes its pid namespace (every process of
        the sandbox) and its mount namespace (the overlay) with it. A paused sandbox is
        thawed first (a frozen process does not die)."""
        self.drop_writable()
        if self.cgroups is not None:
            self.cgroups.thaw()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self.cgroups is not None:
            self.emptied = self.cgroups.kill_members()
        if self.proc.stderr:
            self.proc.stderr.close()
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None
        if self.network is not None:
            self.network.stop()
        if self.net_fd is not None:
            os.close(self.net_fd)
            self.net_fd = None

    def remove(self) -> None:
        """Everything the sandbox left on the host: state directory and cgroups."""
        self.drop_layer()
        self.kill()
        if self.cgroups is not None:
            self.cgroups.remove()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.image.release()  # its cache entry may be evicted now


class BwrapSandbox:
    """One sandbox driven synchronously (scripts, the demo, benchmarks): ``start()``
    returns the daemon's address once it listens; ``stop()`` removes everything. Run
    by a user other than root, it is ``unprivileged`` (SandboxProcess)."""

    def __init__(self, rootfs: Path, bundle: Path, run_dir: Path, *, network: bool = False,
                 hostname: str = "sandbox", env: Optional[Dict[str, str]] = None,
                 workdir: Optional[str] = None, unprivileged: Optional[bool] = None):
        image = PreparedImage("host" if Path(rootfs) == Path("/") else "dir:%s" % rootfs,
                              None if Path(rootfs) == Path("/") else Path(rootfs))
        spec = SandboxSpec(image=image.image, env=dict(env or {}), network=network,
                           workdir=workdir)
        self.state_dir = Path(run_dir)
        if unprivileged is None:
            unprivileged = os.geteuid() != 0
        self.process = SandboxProcess(hostname, image, bundle, self.state_dir, spec,
                                      hostname=hostname, unprivileged=unprivileged)

    @property
    def token(self) -> str:
        return self.process.token

    def start(self, timeout: float = 10.0) -> str:
        self.process.launch()
        return self.process.wait_ready_blocking(timeout)

    def stop(self) -> None:
        self.process.remove()
