"""What one LocalProvider sandbox's launch chain runs (providers/local/bwrap.py has the
chain and its lifecycle): its command line (bubblewrap's arguments, the launch
scripts), its mounts (the detached writable layer, overlay, devpts and bundle the launch
attaches) and its environment. ``Chain`` is a part of ``SandboxProcess``; its state is
the sandbox's."""

import fcntl
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from sandman_ray.bundle import DEFAULT_MOUNT, daemon_argv
from sandman_ray.errors import NotSupported
from sandman_ray.image_files import resolve_user
from sandman_ray.providers.local import renew, seccomp
from sandman_ray.providers.local.cgroups import rlimits
from sandman_ray.providers.mounts import (
    detached_devpts, detached_tmpfs, detached_tree, fstab_path, inodes_for)
from sandman_ray.providers.network import DNS, RESOLV_CONF
from sandman_ray.providers.syscalls import kept_capabilities
from sandman_ray.spec import SandboxSpec

SOCKET_DIR = "/run/sandman"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host directories a sandbox of the host's root gets fresh (or not at all).
HOST_SKIPPED = {"proc", "dev", "sys", "tmp", "run", ".sandman", "lost+found"}


def capabilities(spec: SandboxSpec) -> Tuple[str, ...]:
    """The capabilities root inside a sandbox of ``spec`` keeps (the policy of record's:
    providers/syscalls.py)."""
    return kept_capabilities(spec.capabilities)
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
# server, the tmpfs's inodes, the most terminals). Bundle, fstab and rootfs are opened
# before the tmpfs covers the view root, which may hold them.
_LAUNCH_ONE_UID = r"""[ -z "$SANDMAN_NET_FD" ] || echo up > "/proc/self/fd/$SANDMAN_NET_FD"
exec 6<"$3" 7<"$1"
[ -z "$7" ] || exec 8<"$7"
mount -c -t tmpfs -o "size=$5,nr_inodes=$9,mode=0755,nosuid,nodev" sandman-layer "$4" || exit 98
mkdir -p "$2/upper" "$2/work" "$2/root" "$2/bundle" "$2/pts" "$2/shm" &&
    chmod "$6" "$2/upper" && chmod 1777 "$2/shm" || exit 98
mount -c -t devpts -o "newinstance,ptmxmode=0666,mode=0620,max=${10},nosuid,noexec" \
    sandman-pts "$2/pts" || exit 98
[ -z "$SANDMAN_NET_FD" ] || echo "nameserver $8" > "$2/resolv.conf"
mount -c -a -T /proc/self/fd/7 || exit 98
exec </dev/null 6<&- 7<&- 8<&-
shift 10
exec "$@"
"""
# The tty group inside (Debian's and most images'): terminals of the sandbox's devpts
# belong to it
TTY_GID = 5
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


def memfd_holding(data: bytes, name: str = "sandman-launch") -> int:
    """A memory file holding ``data`` (any size: a pipe holds 64 KiB until its reader
    starts), open for reading at its start, sealed against change."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK |
                    fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _filter_pipe(spec: SandboxSpec) -> Optional[int]:
    """The read end of a pipe holding the seccomp program for ``spec`` (bwrap reads it
    to the end), or None on a CPU the filter is not written for."""
    code = seccomp.program(frozenset(spec.capabilities))
    return None if code is None else pipe_holding(code)  # a few hundred bytes


class Chain:
    """The sandbox's command line, mounts and environment (a part of SandboxProcess)."""

    def _environment(self) -> Dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root"}
        env.update(self.image.config.env_dict())
        env.update(self.spec.env)
        return env

    def _environ(self) -> bytes:
        """The sandbox's environment as the daemon's --env-fd takes it: NUL-separated
        ``KEY=VALUE`` entries."""
        return b"".join(("%s=%s" % kv).encode("utf-8", "surrogateescape") + b"\0"
                        for kv in sorted(self._environment().items()))

    def _workdir(self) -> str:
        if self.spec.workdir:
            return self.spec.workdir
        if self.image.rootfs is None:
            return "/tmp"
        return self.image.config.workdir or "/"

    def _user(self) -> Optional[str]:
        """``uid:gid`` to run as, None for root: the spec's user (names looked up in the
        image's etc/passwd and etc/group, read below its rootfs and never through a
        link out of it: image_files), else the image's, resolved when it was prepared."""
        if self.spec.user:
            return resolve_user(self.image.rootfs, self.spec.user, self.image.image) or None
        return self.image.run_as or None

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
        """bwrap's mounts: the root, the bundle, /proc and /dev. A host image's root, a
        tmpfs bwrap makes, is read-only once everything is mounted in it."""
        bundle = str(self.state_dir / "bundle")
        # bwrap leaves /proc/sys writable for a root without its own user namespace; in
        # every mode it is the host's, read-only
        common = ["--ro-bind", bundle, DEFAULT_MOUNT, "--proc", "/proc",
                  "--ro-bind", "/proc/sys", "/proc/sys"]
        if not self.renewable:
            host = [] if self.image.rootfs is not None else ["--remount-ro", "/"]
            return self._root_args() + common + self._dev_args(counter) + host
        return renew.skeleton_args(common + self._dev_args(counter, shm=False),
                                   str(self.state_dir / "root"), bundle, DEFAULT_MOUNT,
                                   self._dev_args(counter, renew.SLOTS[0]))

    def _dev_args(self, counter, at: str = "", shm: bool = True) -> List[str]:
        """/dev at ``at``: bwrap's device nodes; the sandbox's own devpts, which holds at
        most ``spec.ptys`` terminals (the host's are every sandbox's); ``/dev/shm`` in
        the writable layer (within the disk limit), when ``shm``; the OOM counter; and
        read-only, so that nothing else can be written there."""
        args = ["--dev", at + "/dev", "--dev-bind", str(self.state_dir / "pts"),
                at + "/dev/pts"]
        if counter is not None:
            args += ["--ro-bind", str(counter), at + OOM_COUNTER]
        if shm:
            args += ["--bind", str(self.state_dir / "shm"), at + "/dev/shm"]
        return args + ["--remount-ro", at + "/dev"]

    def argv(self, ready_fd: int, seccomp_fd: Optional[int] = None,
             token_fd: Optional[int] = None, listen_fd: Optional[int] = None,
             admin_fd: Optional[int] = None, env_fd: Optional[int] = None) -> List[str]:
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
        # The daemon's own environment is PATH alone: the sandbox's (the image's and the
        # spec's: LD_PRELOAD, GCONV_PATH, MALLOC_* ...) reaches only the commands it
        # starts, handed over on env_fd like the token, never to the daemon's loader
        bwrap += ["--clearenv", "--setenv", "PATH", DEFAULT_PATH]
        # the daemon goes to its workdir itself, made when missing (a renewable
        # sandbox's starts in the skeleton and moves into its slot first)
        bwrap += ["--chdir", "/"] + daemon_argv() + [
            "--listen", "fd:%d" % listen_fd, "--workdir", workdir,
            "--ready-fd", str(ready_fd), "--token-fd", str(token_fd),
            "--env-fd", str(env_fd),
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
                     str(self.disk_bytes()), upper_mode, str(self.image.rootfs or ""), DNS,
                     str(inodes_for(self.disk_bytes())), str(self.spec.ptys)] +
                    rlimits(self.spec, self.applied, nproc=True) + bwrap)
        return (rlimits(self.spec, self.applied) +
                ["unshare", "--mount"] + net +
                ["--propagation", "private", "/bin/sh", "-c", _LAUNCH,
                 "sandman-launch", str(self.state_dir / "fstab"),
                 self.ids.userns_path if self.ids else "", str(self.bundle)] + bwrap)

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
            for sub in ("upper", "work", "root", "bundle", "pts", "shm"):
                mode = 0o1777 if sub == "shm" or (sub == "upper" and self.image.rootfs is None) \
                    else 0o755
                os.mkdir(rel / sub, mode, dir_fd=layer)
                os.chmod(rel / sub, mode, dir_fd=layer)  # mkdir's mode passes the umask
                os.chown(rel / sub, base, base, dir_fd=layer)
            made["pts"] = detached_devpts(self.spec.ptys, base + TTY_GID)
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
                                                           fstab_path(self.view_root)),
                     "/proc/self/fd/%d %s/pts none bind 0 0" % (mounts["pts"], st)]
        if "lower" in mounts:  # the launch's stdin, under the snapshots' layers if any
            lowers = ["/proc/self/fd/%d" % mounts["snapshot%d" % i]
                      for i in range(len(self.image.layers))] + ["/proc/self/fd/0"]
            lines.append("overlay %s/root overlay nosuid,nodev,lowerdir=%s,"
                         "upperdir=%s/upper,workdir=%s/work 0 0"
                         % (st, ":".join(lowers), st, st))
        lines.append("/proc/self/fd/6 %s/bundle none bind,ro 0 0" % st)  # the launch's
        return "\n".join(lines) + "\n"

    def disk_bytes(self) -> int:
        """The size of the sandbox's writable layer."""
        return self.spec.disk or DEFAULT_DISK
