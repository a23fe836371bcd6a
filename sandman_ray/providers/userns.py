"""User namespaces for LocalProvider sandboxes: root inside is an unprivileged range of
host uids and gids, never host root.

Each live sandbox of a node holds one range of 65536 ids (``IdRange``): uid 0 inside is
``base`` on the host, uid 1000 is ``base + 1000``. One range per sandbox rather than per
pool, so that two sandboxes never share a host uid: a file, a process or a kernel object
that one of them owns (its writable layer, its socket, its share of RLIMIT_NPROC) is
out of the other's reach by the kernel's own permission checks, whichever pool they
belong to. Ranges are claimed across every agent of the host with a lock file each
(``flock``, released by the kernel when the agent dies), and an agent keeps the ranges it
claimed for its next sandboxes.

A range comes with one user namespace, made once by the agent (root writes the maps
itself: no newuidmap, no /etc/subuid) and kept as an open file descriptor. A sandbox
enters it (``nsenter --user``) before bwrap makes the sandbox's other namespaces, which
that namespace then owns. The same namespace gives the idmapped mounts of image
caches: a shared, root-owned rootfs appears to the range as its own (root's files as
``base``), so an overlay over it works and copy-up works, with no copy and no chown of
the cache. Measured here: a range's namespace ~2-4 ms (once per range), an idmapped
mount ~0.1 ms (once per launch).
"""

import ctypes
import errno
import fcntl
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

# Host ids of the ranges: 2^30 and up, far above any real user and the ranges that
# /etc/subuid hands out (100000 and up); 16384 ranges of 65536.
FIRST_ID = 1 << 30
RANGE_SIZE = 65536
RANGES = 16384

# linux/mount.h
_OPEN_TREE = 428
_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_libc = None


def _syscall(number: int, *args) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    result = _libc.syscall(number, *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


class IdRange:
    """One claimed range: host ids ``base`` to ``base + 65535``, and its user namespace
    (``userns_fd``, open in the agent)."""

    def __init__(self, index: int, lock_fd: int, userns_fd: int):
        self.index, self.lock_fd, self.userns_fd = index, lock_fd, userns_fd
        self.base = FIRST_ID + index * RANGE_SIZE

    def host_id(self, inside: int) -> int:
        return self.base + inside

    @property
    def userns_path(self) -> str:
        """The namespace as a path a child of the agent can open."""
        return "/proc/%d/fd/%d" % (os.getpid(), self.userns_fd)

    def idmapped(self, path: Path) -> int:
        """``detached_tree(path)`` in which the files of host uid N appear as
        ``base + N``: the lower layer of an overlay mounted for this range."""
        return detached_tree(path, self.userns_fd)

    def close(self) -> None:
        for fd in (self.userns_fd, self.lock_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def detached_tree(path: Path, userns_fd: Optional[int] = None) -> int:
    """A detached, read-only, nosuid, nodev mount of ``path``, idmapped through the
    user namespace ``userns_fd`` when given. An overlay takes it as its lower layer
    from any mount namespace (a descriptor of a path in another namespace it refuses).
    The caller closes it once the overlay is mounted (the overlay keeps it alive)."""
    fd = _syscall(_OPEN_TREE, _AT_FDCWD, str(path).encode(),
                  _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    flags = _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
    if userns_fd is not None:
        flags |= _MOUNT_ATTR_IDMAP
    attr = _MountAttr(flags, 0, 0, userns_fd if userns_fd is not None else 0)
    try:
        _syscall(_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                 ctypes.sizeof(attr))
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_userns(base: int) -> int:
    """A user namespace mapping 0-65535 to ``base``..., as an open descriptor. A child
    process unshares it and waits; this (root) process writes its maps, opens the
    namespace and lets the child exit: the descriptor keeps the namespace alive."""
    # the child says "in" once unshared, then waits for its maps (the end of its stdin)
    child = subprocess.Popen(["unshare", "--user", "/bin/sh", "-c", "echo in; read _"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, close_fds=True)
    try:
        if child.stdout.readline().strip() != b"in":
            raise OSError(errno.EPERM, "unshare --user failed: %s" % (
                child.stderr.read().decode(errors="replace").strip() or "no output"))
        for name in ("uid_map", "gid_map"):
            with open("/proc/%d/%s" % (child.pid, name), "w") as fh:
                fh.write("0 %d %d\n" % (base, RANGE_SIZE))
        return os.open("/proc/%d/ns/user" % child.pid, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.stdin.close()
        child.wait()
        child.stdout.close()
        child.stderr.close()


class Ranges:
    """The ranges one agent holds: claimed on first need, lent to one sandbox at a
    time, kept for the next (their namespaces are made once)."""

    def __init__(self, lock_dir: Path):
        self.lock_dir = Path(lock_dir)
        self.free: List[IdRange] = []
        self.lent: Dict[str, IdRange] = {}  # sandbox id -> its range

    def take(self, sandbox_id: str) -> IdRange:
        held = self.lent.get(sandbox_id)
        if held is not None:
            return held
        ids = self.free.pop() if self.free else self._claim()
        self.lent[sandbox_id] = ids
        return ids

    def give_back(self, sandbox_id: str) -> None:
        ids = self.lent.pop(sandbox_id, None)
        if ids is not None:
            self.free.append(ids)

    def _claim(self) -> IdRange:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for index in range(RANGES):
            fd = os.open(self.lock_dir / str(index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                return IdRange(index, fd, make_userns(FIRST_ID + index * RANGE_SIZE))
            except BaseException:
                os.close(fd)
                raise
        raise OSError(errno.ENOSPC, "all %d uid ranges of this host are in use" % RANGES)

    def close(self) -> None:
        for ids in self.free + list(self.lent.values()):
            ids.close()
        self.free, self.lent = [], {}


def supported() -> Optional[str]:
    """None when this process can give sandboxes a mapped user namespace, else why
    not."""
    if os.geteuid() != 0:
        return "the node agent does not run as root"
    if not os.path.exists("/proc/self/ns/user"):
        return "the kernel has no user namespaces"
    return None
