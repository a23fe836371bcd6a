"""A sandbox made ready for its next lease without starting it again.

A sandbox that can be renewed (a rootfs image, root inside, no network, a range of
its own: ``SandboxProcess.renewable``) is laid out in two parts. bwrap's root is a
read-only *skeleton*: the daemon bundle at ``/.sandman``, the sandbox's ``/proc`` and a
read-only ``/dev``, and two empty slots, ``/.gens/a`` and ``/.gens/b``. The tenant's
files, its *generation*, are an overlay (the image, idmapped to the range, under a
writable layer of its own) in one slot, with copies of the skeleton's ``/proc``,
``/dev`` and ``/.sandman`` and a fresh ``/dev/shm`` below it; the daemon and every
process it starts run in that slot (``chroot``). The first generation is bwrap's
(``/.gens/a``); each renew makes the next in the other slot:

1. made ahead of time, in no namespace (``Layer.prepare``): a detached tmpfs for the
   writable layer, the detached overlay over the image, and a directory of that tmpfs
   for ``/dev/shm`` (within the disk limit);
2. the daemon's ``renew quiet``: no lease token is valid, every connection but the
   agent's is closed, every process but the daemon is killed and reaped;
3. in the sandbox's namespaces (``swap``, from a thread of the agent that entered its
   mount namespace alone, ``unshare(CLONE_FS)``): every SysV IPC object and POSIX
   message queue of its IPC namespace removed, the old generation detached (its
   files are gone once the daemon leaves them), the new one attached in the other
   slot with its mounts; on the first renew, the mounts of the launch's own
   namespace (the first generation's layer) are detached too;
4. the daemon's ``renew enter``: it moves into the new slot and takes a new token.

Code inside that escapes its ``chroot`` (root keeps CAP_SYS_CHROOT) reaches only the
skeleton: read-only, and holding no generation but its own. What a renew does not
carry from one lease to the next: files, processes, connections, the token, IPC
objects, ``/dev/shm``. What stays, as it would in a sandbox started afresh on the same
node: the sandbox's cgroup and its counters (an OOM kill is reported from the
counter's change), its pid namespace (pids go on counting) and its hostname.
"""

import asyncio
import ctypes
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

from sandman_ray.errors import SandboxLost
from sandman_ray.providers import mounts

CLONE_FS, CLONE_NEWNS, CLONE_NEWIPC = 0x200, 0x20000, 0x08000000  # linux/sched.h
_IPC_RMID = 0
SLOTS = ("/.gens/a", "/.gens/b")
MOUNT_POINTS = ("proc", "dev", ".sandman")  # made in each new writable layer

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def skeleton_args(common: List[str], root: str, bundle: str, bundle_at: str,
                  slot_dev: List[str]) -> List[str]:
    """bwrap's mounts for a renewable sandbox: the read-only skeleton (``common``: its
    bundle, /proc and /dev mounts, as every sandbox has them, without /dev/shm) with
    the first generation, the overlay at ``root``, in the first slot, and its own
    mounts below it (``slot_dev``: its /dev, with the generation's /dev/shm)."""
    first = SLOTS[0]
    args = ["--tmpfs", "/", "--dir", SLOTS[1]] + common + ["--bind", root, first]
    for flag, *paths in (("--ro-bind", bundle, bundle_at), ("--proc", "/proc"),
                         ("--ro-bind", "/proc/sys", "/proc/sys")):
        args += [flag] + paths[:-1] + [first + paths[-1]]
    return args + slot_dev + ["--remount-ro", "/"]


class Renewable:
    """What a SandboxProcess (bwrap.py) does to be renewed; it sets ``layer``, ``slot``,
    ``renewed`` and ``admin_token`` at each start, and has ``disk_bytes``."""

    @property
    def renewable(self) -> bool:
        """Whether a reset can renew this sandbox in place: a rootfs image, root
        inside, no network, a range of its own."""
        return (self.ids is not None and not self.unprivileged and
                self.image.rootfs is not None and not self.spec.network and
                self._user() is None)

    def prepare_layer(self) -> None:
        """Make the next generation ahead of time."""
        if self.layer is None and self.renewable:
            self.layer = Layer.prepare(self.image, self.ids, self.disk_bytes())

    def drop_layer(self) -> None:
        if self.layer is not None:
            self.layer.close()
            self.layer = None

    def daemon_pid(self) -> int:
        """The host pid of the daemon, bwrap's one child (PID 1 of the sandbox)."""
        found = children(self.proc.pid)
        if len(found) != 1:
            raise SandboxLost("sandbox %s: bwrap has %d children" % (self.sandbox_id,
                                                                     len(found)))
        return found[0]

    async def renew(self, thread: "NamespaceThread", timeout: float) -> None:
        """Ready the sandbox for its next lease in place: the daemon stops everything
        and forgets it, the prepared layer replaces the tenant's files, and the daemon
        takes a new token; it answers, as READY means, when this returns. Raises when
        any step fails: the caller starts the sandbox afresh instead."""
        from sandman_ray.client import AsyncDaemonClient
        if self.layer is None or not self.alive:
            raise SandboxLost("sandbox %s cannot be renewed" % self.sandbox_id)
        client = await AsyncDaemonClient.connect(self.address, self.admin_token,
                                                 connect_timeout=timeout,
                                                 default_timeout=timeout)
        try:
            quiet = await client.renew("quiet")
            if quiet["left"]:
                raise SandboxLost("sandbox %s: not renewed: %s" % (self.sandbox_id, quiet))
            if self.cgroups is not None and len(self.cgroups.members()) > 2:
                raise SandboxLost("sandbox %s: its cgroup holds more than bwrap and the "
                                  "daemon" % self.sandbox_id)
            layer, self.layer = self.layer, None
            new = 1 - self.slot
            try:
                await asyncio.wrap_future(thread.run(
                    swap, thread, self.proc, self.daemon_pid(), self.renewed == 0,
                    str(self.view_root), SLOTS[self.slot], SLOTS[new], layer))
                self.hold_writable(layer.take_tmpfs(), "upper")
            finally:
                layer.close()
            token, admin = secrets.token_hex(16), secrets.token_hex(16)
            await client.renew("enter", root=SLOTS[new], token=token, admin=admin)
            self.admin_token = admin
            # what READY means (base.check_answers), on this connection: it answers,
            # and runs a command in its new generation
            result = await client.exec("true")
            if result.exit_code != 0:
                raise SandboxLost("sandbox %s: `true` exited %s after its renew"
                                  % (self.sandbox_id, result.exit_code))
        finally:
            client.close()
        self.slot, self.token = new, token
        self.renewed += 1
        self.started_at = time.time()
        await asyncio.get_running_loop().run_in_executor(None, self.prepare_layer)


class Layer:
    """A generation made ahead of time, in no namespace: its overlay and /dev/shm, as
    descriptors of detached mounts."""

    def __init__(self, overlay: int, shm: int, tmpfs: int):
        self.overlay, self.shm, self.tmpfs = overlay, shm, tmpfs

    @classmethod
    def prepare(cls, image, ids, disk: int) -> "Layer":
        """A new writable layer (``disk`` bytes, owned by the range's root) over the
        PreparedImage ``image`` (its rootfs, under its snapshots' layers if any),
        idmapped to the range ``ids``."""
        base = ids.base
        made = []
        layer = None
        try:
            layer = mounts.detached_tmpfs(disk, base, base)
            for sub in ("upper", "work", "shm"):
                os.mkdir(sub, 0o755, dir_fd=layer)
                os.chown(sub, base, base, dir_fd=layer)
            os.chmod("shm", 0o1777, dir_fd=layer)
            for point in MOUNT_POINTS:  # where the generation's own mounts go
                path = os.path.join("upper", point)
                os.mkdir(path, 0o755, dir_fd=layer)
                os.chown(path, base, base, dir_fd=layer)
            upper = os.open("upper", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=layer)
            made.append(upper)
            work = os.open("work", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=layer)
            made.append(work)
            lowers = []
            for path in tuple(image.layers) + (image.rootfs,):  # the upper-most first
                lowers.append(ids.idmapped(path))
                made.append(lowers[-1])
            overlay = mounts.detached_overlay(lowers, upper, work)
            try:
                shm = mounts.clone_tree("shm", dir_fd=layer)
            except BaseException:
                os.close(overlay)
                raise
        except BaseException:
            if layer is not None:
                os.close(layer)
            raise
        finally:
            for fd in made:  # the overlay holds what it needs of them
                os.close(fd)
        return cls(overlay, shm, layer)

    def take_tmpfs(self) -> int:
        """The writable layer's tmpfs, for the sandbox to keep (``hold_writable``)."""
        tmpfs, self.tmpfs = self.tmpfs, None
        return tmpfs

    def close(self) -> None:
        for fd in (self.overlay, self.shm, self.tmpfs):
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass


class NamespaceThread:
    """One thread of the agent with filesystem attributes of its own, which enters a
    sandbox's mount and IPC namespaces for a swap and then comes back (the rest of
    the agent never leaves its own)."""

    def __init__(self):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="sandman-renew")
        self.own = None

    def run(self, fn, *args):
        """``fn(*args)`` on the thread (a concurrent Future)."""
        return self.executor.submit(self._in_thread, fn, args)

    def _in_thread(self, fn, args):
        if self.own is None:
            _check(_libc.unshare(CLONE_FS))  # setns to a mount namespace needs it
            self.own = (os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC),
                        os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC))
        return fn(*args)

    def enter(self, pid: int, still_ours) -> None:
        """Into the mount and IPC namespaces of process ``pid`` (on the thread), through
        a pidfd; ``still_ours()``, asked once it is open, says the pid is still the
        process meant (a pid reused meanwhile is never entered)."""
        fd = os.pidfd_open(pid)
        try:
            if not still_ours():
                raise SandboxLost("process %d is gone" % pid)
            _check(_libc.setns(fd, CLONE_NEWIPC | CLONE_NEWNS))
        finally:
            os.close(fd)

    def leave(self) -> None:
        _check(_libc.setns(self.own[0], CLONE_NEWNS))
        _check(_libc.setns(self.own[1], CLONE_NEWIPC))


def children(pid: int) -> List[int]:
    """The children of the single-threaded process ``pid``."""
    with open("/proc/%d/task/%d/children" % (pid, pid)) as fh:
        return [int(child) for child in fh.read().split()]


def swap(thread: NamespaceThread, bwrap, daemon_pid: int, first: bool, view_root: str,
         old: str, new: str, layer: Layer) -> None:
    """Steps 3 of the module's doc, on ``thread``: IPC objects removed, the generation
    in slot ``old`` detached, ``layer`` attached in slot ``new``. ``bwrap``: the
    sandbox's bwrap (a Popen: unreaped, its pid cannot be reused), whose one child is
    ``daemon_pid``. ``first`` (the first renew since the sandbox started): the mounts
    at ``view_root`` of the launch's namespace (bwrap's), which hold the first
    generation, are detached too."""
    if first:
        thread.enter(bwrap.pid, lambda: bwrap.poll() is None)
        try:
            mounts.detach(view_root)
        finally:
            thread.leave()
    thread.enter(daemon_pid, lambda: children(bwrap.pid) == [daemon_pid])
    try:
        remove_ipc_objects()
        mounts.detach(old)
        mounts.attach(layer.overlay, new)
        for point in MOUNT_POINTS:  # the skeleton's, copied (with what is mounted below)
            tree = mounts.clone_tree("/" + point)
            try:
                mounts.attach(tree, "%s/%s" % (new, point))
            finally:
                os.close(tree)
        mounts.attach(layer.shm, new + "/dev/shm")
    finally:
        thread.leave()


def remove_ipc_objects() -> None:
    """Remove every SysV shared memory segment, message queue and semaphore set, and
    every POSIX message queue, of this thread's IPC namespace."""
    for table, remove in (("shm", lambda i: _libc.shmctl(i, _IPC_RMID, None)),
                          ("msg", lambda i: _libc.msgctl(i, _IPC_RMID, None)),
                          ("sem", lambda i: _libc.semctl(i, 0, _IPC_RMID))):
        with open("/proc/sysvipc/" + table) as fh:  # this namespace's, as its own sees
            ids = [int(line.split()[1]) for line in fh.readlines()[1:] if line.strip()]
        for ipc_id in ids:
            _check(remove(ipc_id))
    mount = mounts.detached_fs("mqueue")  # the instance of this IPC namespace
    try:
        queues = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=mount)
    finally:
        os.close(mount)
    try:
        for name in os.listdir(queues):
            os.unlink(name, dir_fd=queues)
    finally:
        os.close(queues)
