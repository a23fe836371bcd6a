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

import errno
import fcntl
import os
import subprocess
import threading
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.providers.mounts import detached_tree

# Host ids of the ranges: 2^30 and up, far above any real user and the ranges that
# /etc/subuid hands out (100000 and up); 16384 ranges of 65536.
FIRST_ID = 1 << 30
RANGE_SIZE = 65536
HELD = b"held"  # what a range's lock file says while an agent holds it
RANGES = 16384

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
        """A read-only ``detached_tree(path)`` in which the files of host uid N appear
        as ``base + N``: the lower layer of an overlay mounted for this range."""
        return detached_tree(path, readonly=True, userns_fd=self.userns_fd)

    def close(self) -> None:
        for fd in (self.userns_fd, self.lock_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def range_processes(bases) -> List[int]:
    """Pids of live processes whose uid lies in one of the ranges that start at
    ``bases`` (from the owner of /proc/<pid>, which is the process's uid, or the root
    of its user namespace for one that is not dumpable: the daemon's). A zombie is not
    live: it holds nothing and runs nothing, and a killed sandbox's daemon is one until
    the host's init reaps it (1.3-1.7 s here, which every agent's shutdown waited)."""
    bases = sorted(bases)
    if not bases:
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat("/proc/" + name).st_uid
        except OSError:
            continue
        if uid >= FIRST_ID and any(base <= uid < base + RANGE_SIZE for base in bases) \
                and not _dead("/proc/" + name):
            found.append(int(name))
    return found


def _dead(proc_dir: str) -> bool:
    """Whether the process is a zombie, or gone (its state Z or X)."""
    try:
        with open(proc_dir + "/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def make_userns(base: int) -> int:
    """A user namespace mapping 0-65535 to ``base``..., as an open descriptor. A child
    process unshares it and waits; this (root) process writes its maps, opens the
    namespace and lets the child exit: the descriptor keeps the namespace alive."""
    # the child says "in" once unshared, then waits for its maps (the end of its stdin)
    # made by the range's own uid: the kernel charges what the namespace's processes
    # hold (inotify instances, pending signals ...) to its creator, never to host root
    child = subprocess.Popen(["setpriv", "--reuid=%d" % base, "--regid=%d" % base,
                              "--clear-groups", "unshare", "--user", "/bin/sh", "-c",
                              "echo in; read _"],
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
    time, kept for the next (their namespaces are made once). Thread-safe: a new range
    costs a process (~1.5 ms), so agents take them on worker threads."""

    def __init__(self, lock_dir: Path):
        self.lock_dir = Path(lock_dir)
        self.lock = threading.Lock()
        self.free: List[IdRange] = []
        self.lent: Dict[str, IdRange] = {}  # sandbox id -> its range
        self.tainted: List[IdRange] = []  # held, never lent again (give_back)
        # where the next claim starts looking: past the ranges this agent claimed, so a
        # burst of N new ranges tries ~N lock files rather than ~N^2/2
        self.cursor = 0

    def take(self, sandbox_id: str) -> IdRange:
        with self.lock:
            held = self.lent.get(sandbox_id)
            if held is None and self.free:
                held = self.lent[sandbox_id] = self.free.pop()
            if held is not None:
                return held
            index, lock_fd = self._lock_next()
        try:  # outside the lock: other threads take free ranges meanwhile
            ids = IdRange(index, lock_fd, make_userns(FIRST_ID + index * RANGE_SIZE))
        except BaseException:
            os.close(lock_fd)
            raise
        with self.lock:
            self.lent[sandbox_id] = ids
        return ids

    def give_back(self, sandbox_id: str, emptied: bool = True) -> None:
        """The sandbox's range, for the next; a range whose sandbox may still have a
        process (``emptied`` false: its cgroup did not empty) is never lent again, and
        stays locked while this agent lives (its shutdown kills what is left of it)."""
        with self.lock:
            ids = self.lent.pop(sandbox_id, None)
            if ids is not None:
                (self.free if emptied else self.tainted).append(ids)

    def kill_leftovers(self, timeout_s: float = 5.0) -> List[int]:
        """SIGKILL every process whose uid lies in a range this agent holds, until none
        is left or ``timeout_s`` passed; the pids still alive (none, normally). Called
        before the agent lets its ranges go (its locks die with it): a range is free
        for another agent only once no process of it lives."""
        import time
        from sandman_ray.providers.janitor import kill
        with self.lock:
            bases = [r.base for r in self.free + self.tainted + list(self.lent.values())]
        deadline = time.monotonic() + timeout_s
        while True:
            left = range_processes(bases)
            if not left or time.monotonic() > deadline:
                return left
            kill(left)
            time.sleep(0.02)

    def _lock_next(self):
        """(index, lock fd) of a range no agent of this host holds: the first free one
        from the cursor on, wrapping around once."""
        try:
            where = os.open(self.lock_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            where = os.open(self.lock_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for step in range(RANGES):
                index = (self.cursor + step) % RANGES
                fd = os.open(str(index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600,
                             dir_fd=where)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                # a range whose last holder did not say it left it empty (it died) is
                # looked at: a process of it that outlived its agent keeps it from use
                if os.pread(fd, 16, 0).startswith(HELD) and \
                        range_processes([FIRST_ID + index * RANGE_SIZE]):
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, HELD + b" %d\n" % os.getpid(), 0)
                self.cursor = (index + 1) % RANGES
                return index, fd
        finally:
            os.close(where)
        raise OSError(errno.ENOSPC, "all %d uid ranges of this host are in use" % RANGES)

    def close(self, emptied: bool = False) -> None:
        """Let the ranges go; ``emptied``: no process of any of them lives
        (kill_leftovers said so), which their lock files then say for the next holder."""
        with self.lock:
            for ids in self.free + self.tainted + list(self.lent.values()):
                if emptied:
                    try:
                        os.ftruncate(ids.lock_fd, 0)
                    except OSError:
                        pass
                ids.close()
            self.free, self.lent, self.tainted = [], {}, []


def supported() -> Optional[str]:
    """None when this process can give sandboxes a mapped user namespace, else why
    not."""
    if os.geteuid() != 0:
        return "the node agent does not run as root"
    if not os.path.exists("/proc/self/ns/user"):
        return "the kernel has no user namespaces"
    return None


def forbid_nested_user_namespaces(pid: int) -> bool:
    """Allow no new user namespace under the one process ``pid`` runs in (its
    ``user.max_user_namespaces`` set to 0, from inside that namespace, where root of a
    container has no CAP_SYS_RESOURCE to raise it again): a nested namespace would give
    code inside every capability over namespaces of its own, the kernel's widest attack
    surface. False, with nothing changed, if ``pid`` shares this process's namespace
    (a container run as host root): the host's own limit is not ours to change."""
    if os.stat("/proc/%d/ns/user" % pid).st_ino == os.stat("/proc/self/ns/user").st_ino:
        return False
    done = subprocess.run(["nsenter", "--target", str(pid), "--user", "--",
                           "tee", "/proc/sys/user/max_user_namespaces"], input=b"0\n",
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise OSError("cannot close user namespaces under pid %d: %s"
                      % (pid, done.stderr.decode(errors="replace").strip()))
    return True
