"""The cgroups of LocalProvider sandboxes (v1 controllers, or the v2 hierarchy) and the
rlimits that stand in where no cgroup can enforce a limit."""

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.errors import ProviderError
from sandman_ray.spec import SandboxSpec, nofile_limits

CONTROLLERS = ("memory", "pids", "cpu")
# v1 hierarchies a sandbox's groups live in: the limits' and the freezer's (pause)
HIERARCHIES = CONTROLLERS + ("freezer",)


class Cgroups:
    """The cgroups of one sandbox: v1 controllers (memory, pids, cpu) where writable,
    else the v2 unified hierarchy, else none (rlimits then stand in, see ``rlimits``).
    ``applied`` says what was enforced and how.

    A sandbox without limits still gets a group (v1: pids, with no limit; v2: one with
    no controllers): it holds every process of the sandbox, so that removing the
    sandbox, the janitor and ``leftovers`` find each one, even one that outlived its
    bwrap. Under v1 it gets a cpu group too, with no limit: the scheduler then shares
    the CPU between sandboxes, not between their sessions (outside any cpu group,
    each process a sandbox starts in a session of its own, as every command is, would
    weigh as much as a whole other sandbox: the kernel's autogroups). Such a group is
    made and joined where the host allows (``tracking``): a host whose cgroups look
    writable but refuse it still starts the sandbox."""

    ROOT = Path("/sys/fs/cgroup")  # the v1 controllers' parent, or the v2 hierarchy

    def __init__(self, group: str):
        self.group = group  # e.g. sandman/<pool>-<node>-<agent incarnation>/<sandbox id>
        self.dirs: List[Path] = []
        self.tracking: List[Path] = []  # of those, the groups that enforce nothing
        self.applied: Dict[str, str] = {}

    @classmethod
    def unified(cls) -> bool:
        return (cls.ROOT / "cgroup.controllers").exists()

    @classmethod
    def locations(cls, group: str) -> List[str]:
        """Where ``group`` is (or would be): one directory per v1 controller, or one in
        the v2 hierarchy."""
        if cls.unified():
            return [str(cls.ROOT / group)]
        return [str(cls.ROOT / c / group) for c in HIERARCHIES]

    def create(self, spec: SandboxSpec) -> None:
        wanted = {"memory": spec.memory, "pids": spec.pids, "cpu": spec.cpu}
        if self.unified():
            self._create_v2(wanted)
        else:
            self._create_v1(wanted)

    def _create_v1(self, wanted) -> None:
        for controller, value in wanted.items():
            if (value is None and controller == "memory") \
                    or not os.access(self.ROOT / controller, os.W_OK):
                continue
            path = self.ROOT / controller / self.group
            if value is None:  # a group that only holds the processes
                self._track(path)
                continue
            path.mkdir(parents=True, exist_ok=True)
            self.dirs.append(path)
            if controller == "memory":
                _write(path / "memory.limit_in_bytes", value)
                if (path / "memory.memsw.limit_in_bytes").exists():
                    _write(path / "memory.memsw.limit_in_bytes", value)
                _limit_socket_buffers_v1(path, value)
            elif controller == "pids":
                _write(path / "pids.max", value)
            else:
                _write(path / "cpu.cfs_period_us", 100000)
                _write(path / "cpu.cfs_quota_us", int(value * 100000))
            self.applied[controller] = "cgroup-v1"
        self._freezer_v1()

    def _freezer_v1(self) -> None:
        """The freezer group that ``freeze`` uses (v1; enforces nothing)."""
        if os.access(self.ROOT / "freezer", os.W_OK):
            self._track(self.ROOT / "freezer" / self.group)

    def _create_v2(self, wanted) -> None:
        root = self.ROOT
        if not os.access(root, os.W_OK):
            return
        available = (root / "cgroup.controllers").read_text().split()
        usable = [c for c, v in wanted.items() if v is not None and c in available]
        if not usable:
            self._track(root / self.group)
            return
        path, parts = root, self.group.split("/")
        for part in parts:  # enable the controllers down to the leaf's parent
            _write(path / "cgroup.subtree_control", " ".join("+" + c for c in usable))
            path = path / part
            path.mkdir(exist_ok=True)
        self.dirs.append(path)
        for controller in usable:
            value = wanted[controller]
            if controller == "memory":
                _write(path / "memory.max", value)
                if (path / "memory.swap.max").exists():  # no swapping past the limit
                    _write(path / "memory.swap.max", 0)
            elif controller == "pids":
                _write(path / "pids.max", value)
            else:
                _write(path / "cpu.max", "%d 100000" % int(value * 100000))
            self.applied[controller] = "cgroup-v2"

    def weigh(self, weight: float) -> None:
        """The sandbox's share of the node's CPU when it is contended: ``weight`` times
        a group's default (v1 cpu.shares 1024, v2 cpu.weight 100), within what the
        kernel takes. Nothing where the sandbox has no cpu group."""
        found = self._cpu_file()
        if found is not None:
            _write_existing(found, max(2, min(262144, round(1024 * weight)))
                            if found.name == "cpu.shares"
                            else max(1, min(10000, round(100 * weight))))

    def cpu_procs(self) -> Optional[str]:
        """The ``cgroup.procs`` of the sandbox's cpu group (None: it has none)."""
        found = self._cpu_file()
        return None if found is None else str(found.parent / "cgroup.procs")

    def _cpu_file(self) -> Optional[Path]:
        """The weight file of the sandbox's cpu group: v1 cpu.shares, v2 cpu.weight."""
        for path in self.dirs:
            for name in ("cpu.shares", "cpu.weight"):
                if (path / name).exists():
                    return path / name
        return None

    def _track(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            return
        self.dirs.append(path)
        self.tracking.append(path)

    # ---- pause: the freezer (v1 freezer.state, v2 cgroup.freeze)
    def _freezer(self) -> Optional[Path]:
        """The group ``freeze`` writes: v1's freezer group, or the v2 group."""
        for path in self.dirs:
            if path.relative_to(self.ROOT).parts[0] == "freezer" or \
                    (path / "cgroup.freeze").exists():
                return path
        return None

    @property
    def can_freeze(self) -> bool:
        return self._freezer() is not None

    def freeze(self, timeout_s: float = 10.0) -> None:
        """Stop every process of the sandbox where it is (its memory stays); returns once
        the kernel says all are frozen. OSError where the host has no freezer."""
        path = self._freezer()
        if path is None:
            raise OSError(errno.ENOTSUP, "no freezer cgroup for %s" % self.group)
        if (path / "cgroup.freeze").exists():
            _write(path / "cgroup.freeze", 1)
            self._until(lambda: "frozen 1" in (path / "cgroup.events").read_text(), timeout_s)
        else:
            _write(path / "freezer.state", "FROZEN")
            self._until(lambda: (path / "freezer.state").read_text().strip() == "FROZEN",
                        timeout_s)

    def thaw(self) -> None:
        """Let a frozen sandbox run again (nothing where it is not frozen)."""
        path = self._freezer()
        if path is None:
            return
        try:
            if (path / "cgroup.freeze").exists():
                _write(path / "cgroup.freeze", 0)
            else:
                _write(path / "freezer.state", "THAWED")
        except OSError:
            pass  # removed meanwhile

    def frozen(self) -> bool:
        path = self._freezer()
        if path is None:
            return False
        try:
            if (path / "cgroup.freeze").exists():
                return (path / "cgroup.freeze").read_text().strip() == "1"
            return (path / "freezer.state").read_text().strip() != "THAWED"
        except OSError:
            return False

    @staticmethod
    def _until(done, timeout_s: float) -> None:
        """Poll the kernel's word (FREEZING becomes FROZEN once every task stopped)."""
        import time
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while not done():
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, "the freezer did not settle in %.0f s" % timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def reclaim(self) -> int:
        """Push out what of the sandbox's memory the kernel can: file pages dropped,
        anonymous ones written to swap where the node has some (v2 ``memory.reclaim``
        with swap allowed while it runs, v1 ``memory.force_empty``). For a frozen
        sandbox, whose next run brings back only what it touches. The bytes its memory
        group holds less afterwards (0 without a memory group)."""
        if self.applied.get("memory") == "cgroup-v2":
            path, usage = self.ROOT / self.group, "memory.current"
        elif self.applied.get("memory") == "cgroup-v1":
            path, usage = self.ROOT / "memory" / self.group, "memory.usage_in_bytes"
        else:
            return 0
        before = int((path / usage).read_text())
        if usage == "memory.current":
            swap = path / "memory.swap.max"
            kept = swap.read_text().strip() if swap.exists() else None
            try:
                if kept is not None:
                    _write(swap, "max")
                _write(path / "memory.reclaim", before)
            except OSError as exc:  # EAGAIN: less than asked could go
                if exc.errno != errno.EAGAIN:
                    raise
            finally:
                if kept is not None:
                    _write(swap, kept)  # what is out stays out; no more goes
        else:
            try:
                _write(path / "memory.force_empty", 0)
            except OSError as exc:  # EBUSY: what is left could not go
                if exc.errno not in (errno.EBUSY, errno.EINTR):
                    raise
        return max(before - int((path / usage).read_text()), 0)

    def oom_counter(self) -> Optional[Path]:
        """The file holding the OOM kill count of the sandbox's memory group, if it has
        one (v2 memory.events, v1 memory.oom_control)."""
        if self.applied.get("memory") == "cgroup-v2":
            return self.ROOT / self.group / "memory.events"
        if self.applied.get("memory") == "cgroup-v1":
            return self.ROOT / "memory" / self.group / "memory.oom_control"
        return None

    def memory_dir(self) -> Optional[Path]:
        """The sandbox's v1 memory group, if it has one."""
        if self.applied.get("memory") != "cgroup-v1":
            return None
        return self.ROOT / "memory" / self.group

    def procs_files(self, tracking: Optional[bool] = None, skip=()) -> List[str]:
        """Every group's cgroup.procs; only those that enforce limits (False), or only
        those that do not (True); none of the groups in ``skip``."""
        return [str(d / "cgroup.procs") for d in self.dirs if d not in skip and
                (tracking is None or (d in self.tracking) == tracking)]

    def members(self) -> List[int]:
        """The pids in the sandbox's groups (each counted once)."""
        pids = set()
        for procs in self.procs_files():
            try:
                with open(procs) as fh:
                    pids.update(int(line) for line in fh if line.strip())
            except OSError:
                continue
        return sorted(pids)

    def kill_members(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL whatever is in the sandbox's groups, round after round (a process
        may fork as its siblings die), until they are empty or ``timeout_s`` passed;
        whether they are. The kernel ends a pid namespace with its init (the daemon,
        ``--as-pid-1``), and the daemon dies with bwrap only through bwrap's
        parent-death signal: one daemon was once found alive with its bwrap gone after
        a test run."""
        import time
        from sandman_ray.providers.janitor import kill
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            members = self.members()
            if not members:
                return True
            if time.monotonic() > deadline:
                return False
            kill(members)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @contextlib.contextmanager
    def joined_by_this_thread(self):
        """For a ``with`` block that forks the sandbox's first process: this thread
        (v1 groups hold threads) in the sandbox's groups, so that the child starts in
        them, before its first instruction; back in its own afterwards. It gives the
        groups joined, which the launch need not join again (a v1 move costs a grace
        period of RCU, ~5 ms here, when none ran just before). Nothing under v2 (a
        thread cannot leave its process's group) or where the host refuses: the launch
        then joins them as its first step (JOIN_CGROUPS)."""
        if self.unified() or not self.dirs:
            yield set()
            return
        tid = threading.get_native_id()
        own = _own_groups()
        moved, joined = [], set()
        try:
            for path in self.dirs:
                controller = path.relative_to(self.ROOT).parts[0]
                if controller in own:
                    _write_existing(path / "tasks", tid)
                    moved.append(controller)
                    joined.add(path)
        except OSError:
            pass  # the launch joins what this thread could not
        try:
            yield joined
        finally:
            for controller in moved:
                _write_existing(self.ROOT / controller / own[controller].lstrip("/") / "tasks",
                                tid)

    def remove(self) -> None:
        """Remove the leaf groups (their processes must be gone). Blocking: agents call
        it on a worker thread (``SandboxProcess.remove`` through ``run_in_executor``)."""
        from sandman_ray.providers.janitor import remove_cgroup
        for path in self.dirs:
            try:
                remove_cgroup(str(path))
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
        self.dirs = []


def _limit_socket_buffers_v1(path: Path, value: int) -> None:
    """Charge the group's socket buffers to it, up to ``value``. Under v1, TCP and UDP
    buffer memory is not in memory.usage: without this a sandbox holds buffers of the
    host-wide pool (net.ipv4.tcp_mem) past its limit (651 MiB with a 250 MiB limit was
    measured), and can starve every socket of the node, Ray's too. (v2 charges them to
    memory.max.)"""
    tcp = path / "memory.kmem.tcp.limit_in_bytes"
    if not tcp.exists():
        raise ProviderError(
            "a memory limit under cgroup v1 needs %s, which this kernel lacks (it was "
            "built without CONFIG_MEMCG_KMEM, or cgroup.memory=nokmem is set): socket "
            "buffers would escape the limit. Use cgroup v2, or a kernel with it" % tcp,
            "fatal")
    _write(tcp, value)


def _own_groups() -> Dict[str, str]:
    """v1 controller directory (as under Cgroups.ROOT) -> this thread's group in it."""
    out = {}
    with open("/proc/thread-self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name:
                    out[name] = path
    return out


def _write_existing(path: Path, value) -> None:
    """Write a cgroup file that must exist (a cgroup's, not one this would make)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def _write(path: Path, value) -> None:
    with open(path, "w") as fh:
        fh.write(str(value))


def rlimits(spec: SandboxSpec, applied: Dict[str, str], nproc: bool = False) -> List[str]:
    """prlimit arguments for what cgroups could not enforce, and the open files of
    every sandbox: no cgroup counts descriptors, and without a limit a sandbox's
    processes inherit the agent's (20,000 here: 4,096 processes of one sandbox opened
    2.46 M eventfds in 5.5 s, the node's whole fs.file-max, and every process of the
    host but root's got ENFILE). RLIMIT_NPROC only where the kernel counts it
    (``nproc``: processes of a user namespace's own; else a spec's user other than
    root, which the kernel does not hold to it)."""
    args = ["--nofile=%d:%d" % nofile_limits(spec)]
    if spec.memory is not None and "memory" not in applied:
        args.append("--as=%d" % spec.memory)
        applied["memory"] = "rlimit-as"
    if spec.pids is not None and "pids" not in applied and (spec.user or nproc):
        args.append("--nproc=%d" % spec.pids)
        applied["pids"] = "rlimit-nproc"
    return ["prlimit"] + args + ["--"]
