"""One bubblewrap sandbox on this host.

The process chain, per sandbox::

    unshare --mount --propagation private  /bin/sh -c LAUNCH          (host root)
        join the sandbox's cgroups
        mount -a -T state_dir/fstab: attach, in this private mount namespace, the
            mounts the agent made detached (providers/mounts.py):
            - the writable layer, a new size-limited nosuid,nodev tmpfs owned by the
              sandbox's range, over the state root: it also holds the directories
              below, and hides every other sandbox's state from the setup
            - the overlay (lower: the image, idmapped to the range; upper: that tmpfs)
            - the daemon bundle (read-only)
        exec nsenter --user=RANGE'S NAMESPACE        (root inside = the range's first id)
          bwrap --bind ROOT / --ro-bind BUNDLE /.sandman
                --unshare-pid/ipc/uts/cgroup[/net] --as-pid-1 --die-with-parent
                --ro-bind /proc/sys /proc/sys --cap-drop ALL --cap-add (a container's
                default set) --seccomp FD (providers/local/seccomp.py) ...
            /.sandman/bin/sandmand --listen fd:N ...                    (PID 1 inside)

The daemon's socket (state_dir/sock, root's, 0600) is bound and listened on by the
agent, which hands the daemon its descriptor: no directory of the host's disk is
writable from inside, and nothing inside can move the socket aside or stand in for it.

Every mount is attached only in that private mount namespace, so it vanishes with the
sandbox: no mount can leak, and the writable layer (a tmpfs) is gone with it. bwrap dies
with its parent (the node agent) and takes the whole pid namespace with it, so no
process can outlive the agent. A reset renews the sandbox in place where it can
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
import fcntl
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
from typing import Dict, List, Optional, Tuple

from sandman_ray.bundle import DEFAULT_MOUNT, daemon_argv
from sandman_ray.errors import NotSupported, ProviderError, SandboxLost
from sandman_ray.images import PreparedImage
from sandman_ray.providers.local import renew, seccomp
from sandman_ray.providers.local.cgroups import Cgroups, rlimits
from sandman_ray.providers.mounts import detached_tmpfs, detached_tree, fstab_path
from sandman_ray.providers.network import DNS, RESOLV_CONF, SandboxNetwork
from sandman_ray.providers.userns import IdRange
from sandman_ray.spec import SandboxSpec

SOCKET_DIR = "/run/sandman"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host directories a sandbox of the host's root gets fresh (or not at all).
HOST_SKIPPED = {"proc", "dev", "sys", "tmp", "run", ".sandman", "lost+found"}
# What root inside a sandbox may still do: the default set of container engines but
# NET_RAW, which a spec must ask for (SandboxSpec.capabilities). Gone, among others:
# SYS_ADMIN (mount), SYS_PTRACE, SYS_MODULE, NET_ADMIN, NET_RAW, SYS_TIME.
CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "SETGID",
                "SETUID", "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL",
                "AUDIT_WRITE")


def capabilities(spec: SandboxSpec) -> Tuple[str, ...]:
    """The capabilities root inside a sandbox of ``spec`` keeps."""
    return CAPABILITIES + (("NET_RAW",) if "NET_RAW" in spec.capabilities else ())
# The first lines of every launch script: join the sandbox's cgroups (their
# cgroup.procs files in SANDMAN_CGROUP_PROCS, and those that enforce nothing, joined
# where the host allows, in SANDMAN_CGROUP_TRACK).
JOIN_CGROUPS = r"""
for procs in $SANDMAN_CGROUP_PROCS; do echo $$ > "$procs" || exit 97; done
for procs in $SANDMAN_CGROUP_TRACK; do echo $$ 2>/dev/null > "$procs"; done
"""
_LAUNCH = JOIN_CGROUPS + r"""[ -z "$SANDMAN_NET_FD" ] || echo up > "/proc/self/fd/$SANDMAN_NET_FD"
exec 6<"$3"
mount -c -a -T "$1" || exit 98
exec </dev/null 6<&-
userns=$2
shift 3
[ -z "$userns" ] || exec nsenter --user="$userns" "$@"
exec "$@"
"""
# The chain of an agent that is not root: in a user namespace of its uid alone, the
# launch mounts what the agent cannot make detached (arguments: fstab, state dir,
# bundle, view root, tmpfs size, mode of upper, the image's rootfs or "", the DNS
# server). Bundle, fstab and rootfs are opened before the tmpfs covers the view root,
# which may hold them.
_LAUNCH_ONE_UID = r"""[ -z "$SANDMAN_NET_FD" ] || echo up > "/proc/self/fd/$SANDMAN_NET_FD"
exec 6<"$3" 7<"$1"
[ -z "$7" ] || exec 8<"$7"
mount -c -t tmpfs -o "size=$5,mode=0755,nosuid,nodev" sandman-layer "$4" || exit 98
mkdir -p "$2/upper" "$2/work" "$2/root" "$2/bundle" && chmod "$6" "$2/upper" || exit 98
[ -z "$SANDMAN_NET_FD" ] || echo "nameserver $8" > "$2/resolv.conf"
mount -c -a -T /proc/self/fd/7 || exit 98
exec </dev/null 6<&- 7<&- 8<&-
shift 8
exec "$@"
"""
# Where a sandbox sees its memory cgroup's OOM kill count (bound read-only).
OOM_COUNTER = "/dev/.sandman-oom"
# A sandbox's writable layer when neither its spec nor its pool sets a disk limit.
DEFAULT_DISK = 4 * 2 ** 30


def _high(fd: int) -> int:
    """``fd`` moved to 10 or above (the launch's shell has the single digits)."""
    if fd >= 10:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def pipe_holding(data: bytes) -> int:
    """The read end of a pipe holding ``data`` (at most a pipe's buffer: a token, the
    seccomp program), its write end closed: how a secret reaches the daemon in no file,
    no command line and no environment."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read


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


def _filter_pipe(spec: SandboxSpec) -> Optional[int]:
    """The read end of a pipe holding the seccomp program for ``spec`` (bwrap reads it
    to the end), or None on a CPU the filter is not written for."""
    code = seccomp.program(frozenset(spec.capabilities))
    return None if code is None else pipe_holding(code)  # a few hundred bytes


class SandboxProcess(renew.Renewable):
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

    @property
    def address(self) -> str:
        return "unix:%s" % (self.state_dir / "sock")

    def _environment(self) -> Dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root"}
        env.update(self.image.config.env_dict())
        env.update(self.spec.env)
        return env

    def _workdir(self) -> str:
        if self.spec.workdir:
            return self.spec.workdir
        if self.image.rootfs is None:
            return "/tmp"
        return self.image.config.workdir or "/"

    def _user(self) -> Optional[str]:
        """``uid:gid`` to run as, None for root: the spec's user, else the image's
        (names are looked up in the image's /etc/passwd and /etc/group)."""
        user = self.spec.user or self.image.config.user
        if not user:
            return None
        name, _, group = user.partition(":")
        uid = name if name.isdigit() else self._lookup("passwd", name, 2)
        if group:
            gid = group if group.isdigit() else self._lookup("group", group, 2)
        else:
            gid = self._lookup("passwd", name, 3) if not name.isdigit() else uid
        return None if uid == "0" and gid == "0" else "%s:%s" % (uid, gid)

    def _lookup(self, table: str, key: str, column: int) -> str:
        """A field of the image's /etc/passwd or /etc/group; a name the image does not
        know is an error, not a silent run as root."""
        root = self.image.rootfs or Path("/")
        try:
            lines = (root / "etc" / table).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines:
            fields = line.split(":")
            if len(fields) > column and (fields[0] == key or fields[2] == key):
                return fields[column]
        raise ProviderError("image %s has no %s entry for %r (user %r)"
                            % (self.image.image, table, key, self.spec.user or
                               self.image.config.user), "fatal")

    def _root_args(self) -> List[str]:
        if self.image.rootfs is not None:
            return ["--bind", str(self.state_dir / "root"), "/"]
        # host: a tmpfs root with the host's top-level directories bound read-only
        args = ["--tmpfs", "/"]
        for entry in sorted(os.listdir("/")):
            path = "/" + entry
            if entry in HOST_SKIPPED:
                continue
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        return args + ["--bind", str(self.state_dir / "upper"), "/tmp"]


    def _mounts_args(self, counter) -> List[str]:
        """bwrap's mounts: the root, the bundle, /proc and /dev (and the OOM counter
        on /dev)."""
        bundle = str(self.state_dir / "bundle")
        oom = [] if counter is None else ["--ro-bind", str(counter), OOM_COUNTER]
        # bwrap leaves /proc/sys writable for a root without its own user namespace; in
        # every mode it is the host's, read-only
        common = ["--ro-bind", bundle, DEFAULT_MOUNT, "--proc", "/proc",
                  "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"] + oom
        if not self.renewable:
            return self._root_args() + common
        return renew.skeleton_args(common, str(self.state_dir / "root"), bundle, DEFAULT_MOUNT,
                                   counter and str(counter), OOM_COUNTER)

    def argv(self, ready_fd: int, seccomp_fd: Optional[int] = None,
             token_fd: Optional[int] = None, listen_fd: Optional[int] = None,
             admin_fd: Optional[int] = None) -> List[str]:
        counter = self.cgroups.oom_counter() if self.cgroups else None
        bwrap = ["bwrap"] + self._mounts_args(counter) + [
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", self.hostname, "--die-with-parent", "--new-session",
            "--cap-drop", "ALL"]
        user = self._user()
        if not user:
            # the daemon is the sandbox's PID 1 (it reaps orphans). Not when it drops to
            # another uid: changing credentials clears the parent-death signal, and
            # bwrap's own init, which keeps it, must then hold the namespace.
            bwrap.append("--as-pid-1")
        if self.spec.network:  # the launch's namespace, filtered (providers/network.py)
            bwrap += ["--ro-bind", str(self.state_dir / "resolv.conf"), "/etc/resolv.conf"]
        else:
            bwrap.append("--unshare-net")
        for cap in capabilities(self.spec):
            bwrap += ["--cap-add", "CAP_" + cap]
        if seccomp_fd is not None:
            bwrap += ["--seccomp", str(seccomp_fd)]
        workdir = self._workdir()
        bwrap.append("--clearenv")
        for key, value in sorted(self._environment().items()):
            bwrap += ["--setenv", key, value]
        # a renewable sandbox's daemon starts in the skeleton and moves into its slot
        bwrap += ["--chdir", "/" if self.renewable else workdir] + daemon_argv() + [
            "--listen", "fd:%d" % listen_fd, "--workdir", workdir,
            "--ready-fd", str(ready_fd), "--token-fd", str(token_fd),
            "--limits", ",".join("%s=%s" % kv for kv in sorted(self.applied.items()))]
        if self.renewable:
            bwrap += ["--root", renew.SLOTS[0], "--admin-token-fd", str(admin_fd)]
        if counter is not None:
            bwrap += ["--oom-counter", OOM_COUNTER]
        if user:
            bwrap += ["--user", user]
        net = ["--net"] if self.spec.network else []
        if self.unprivileged:
            upper_mode = "1777" if self.image.rootfs is None else "0755"
            # the rlimits inside the new user namespace: RLIMIT_NPROC set before it would
            # also cap, at the level above, every process of the agent's uid
            return (["unshare", "--user", "--map-root-user", "--mount"] + net +
                    ["--propagation", "private", "/bin/sh", "-c", _LAUNCH_ONE_UID,
                     "sandman-launch", str(self.state_dir / "fstab"), str(self.state_dir),
                     str(self.bundle), str(self.view_root),
                     str(self.spec.disk or DEFAULT_DISK), upper_mode,
                     str(self.image.rootfs or ""), DNS] +
                    rlimits(self.spec, self.applied, nproc=True) + bwrap)
        return (rlimits(self.spec, self.applied) +
                ["unshare", "--mount"] + net +
                ["--propagation", "private", "/bin/sh", "-c", _LAUNCH,
                 "sandman-launch", str(self.state_dir / "fstab"),
                 self.ids.userns_path if self.ids else "", str(self.bundle)] + bwrap)

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
        self.admin_token = secrets.token_hex(16)  # the agent's, for renew
        admin_fd = _high(pipe_holding(self.admin_token.encode())) if self.renewable else None
        self.slot, self.renewed = 0, 0  # the first generation, bwrap's
        # The chain runs as host root until nsenter: nothing of the image's or the spec's
        # environment (PATH, LD_PRELOAD ...) may reach it; bwrap hands that to the daemon.
        env = dict(self._cgroup_env(), PATH=DEFAULT_PATH)
        net_w = self._network_pipe(env)
        passed = [fd for fd in (ready_w, listen_fd, filter_r, token_fd, net_w, admin_fd)
                  if fd is not None]
        lower = mounts.pop("lower", None)
        try:
            # the lower layer is the chain's stdin until the overlay is mounted
            self.proc = subprocess.Popen(
                self.argv(ready_w, filter_r, token_fd, listen_fd, admin_fd), env=env,
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

    def _cgroup_env(self) -> Dict[str, str]:
        """What JOIN_CGROUPS in a launch script reads: the groups it joins."""
        groups = self.cgroups or Cgroups("")
        return {"SANDMAN_CGROUP_PROCS": " ".join(groups.procs_files(tracking=False)),
                "SANDMAN_CGROUP_TRACK": " ".join(groups.procs_files(tracking=True))}

    def _mounts(self) -> Dict[str, int]:
        """The sandbox's mounts, made detached for the launch to attach: ``layer`` (a
        new tmpfs holding the sandbox's directories at their paths below the view
        root) and, for a rootfs image, ``lower`` (the rootfs, idmapped to the
        sandbox's range when it has one). Both are descriptors of 10 or more: the
        launch's shell uses 6 for the bundle, which it opens itself (a clone of a
        directory of this namespace would not bind in the launch's)."""
        if self.unprivileged:  # the launch mounts them itself, in its user namespace
            if self.image.layers:
                raise NotSupported("sandbox %s: a snapshot's image needs an agent that runs "
                                   "as root (this one runs as uid %d)"
                                   % (self.sandbox_id, os.geteuid()))
            return {}
        base = self.ids.base if self.ids is not None else 0
        made: Dict[str, int] = {}
        try:
            made["layer"] = layer = _high(detached_tmpfs(self.disk_bytes(),
                                                         base, base))
            rel = self.state_dir.relative_to(self.view_root)
            for depth in range(1, len(rel.parts) + 1):
                os.mkdir(Path(*rel.parts[:depth]), 0o755, dir_fd=layer)
                os.chmod(Path(*rel.parts[:depth]), 0o755, dir_fd=layer)
            for sub in ("upper", "work", "root", "bundle"):
                mode = 0o1777 if sub == "upper" and self.image.rootfs is None else 0o755
                os.mkdir(rel / sub, mode, dir_fd=layer)
                os.chmod(rel / sub, mode, dir_fd=layer)  # mkdir's mode passes the umask
                os.chown(rel / sub, base, base, dir_fd=layer)
            if self.spec.network:
                conf = os.open(rel / "resolv.conf", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC,
                               0o644, dir_fd=layer)
                with os.fdopen(conf, "w") as fh:
                    fh.write(RESOLV_CONF)
            if self.image.rootfs is not None:
                for index, path in enumerate(self.image.layers):  # a snapshot's, above it
                    made["snapshot%d" % index] = self._lower(path)
                made["lower"] = self._lower(self.image.rootfs)
            for name in list(made):
                made[name] = _high(made[name])
        except BaseException:
            _close(made.values())
            raise
        return made

    def _lower(self, path: Path) -> int:
        """A read-only detached mount of ``path``, idmapped to the sandbox's range when
        it has one."""
        return (self.ids.idmapped(path) if self.ids is not None
                else detached_tree(path, readonly=True))

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

    def _fstab(self, mounts: Dict[str, int]) -> str:
        """What the launch attaches, in order (``mount -a -T``)."""
        st = fstab_path(self.state_dir)
        if self.unprivileged:  # the layer is mounted by then; the image is fd 8
            lines = []
            if self.image.rootfs is not None:
                lines.append("overlay %s/root overlay nosuid,nodev,lowerdir=/proc/self/fd/8,"
                             "upperdir=%s/upper,workdir=%s/work 0 0" % (st, st, st))
        else:
            lines = ["/proc/self/fd/%d %s none bind 0 0" % (mounts["layer"],
                                                           fstab_path(self.view_root))]
        if "lower" in mounts:  # the launch's stdin, under the snapshots' layers if any
            lowers = ["/proc/self/fd/%d" % mounts["snapshot%d" % i]
                      for i in range(len(self.image.layers))] + ["/proc/self/fd/0"]
            lines.append("overlay %s/root overlay nosuid,nodev,lowerdir=%s,"
                         "upperdir=%s/upper,workdir=%s/work 0 0"
                         % (st, ":".join(lowers), st, st))
        lines.append("/proc/self/fd/6 %s/bundle none bind,ro 0 0" % st)  # the launch's
        return "\n".join(lines) + "\n"

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
        return self.address

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
            self.cgroups.kill_members()
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

    def disk_bytes(self) -> int:
        """The size of the sandbox's writable layer."""
        return self.spec.disk or DEFAULT_DISK

    def remove(self) -> None:
        """Everything the sandbox left on the host: state directory and cgroups."""
        self.drop_layer()
        self.kill()
        if self.cgroups is not None:
            self.cgroups.remove()
        shutil.rmtree(self.state_dir, ignore_errors=True)


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
