"""The node's tables that every process shares, and what one pool's sandboxes may take
of them.

No cgroup counts some of the kernel's tables, and each is one for the whole node: the
open files (``fs.file-max``: past it every process but root's gets ENFILE), the pids
(``kernel.pid_max``) and the tasks (``kernel.threads-max``: past either, every fork of
the node fails with EAGAIN). A sandbox holds at most ``pids`` processes (its cgroup) of
at most ``nofile`` open files each (its RLIMIT_NOFILE), so the pool's sandboxes on one
node hold at most ``max_sandboxes`` x ``pids`` tasks and ``max_sandboxes`` x ``pids`` x
``nofile`` open files. Measured before these limits: one sandbox of the pool's defaults
(4 GiB, 4,096 pids, nofile inherited from the agent, 20,000) opened 2.46 M eventfds in
5.5 s, this node's whole fs.file-max; eight sandboxes at 4,096 pids take a pid_max of
32,768.

``hold`` runs as a node agent starts: it reads the node's values and, where a table
cannot hold the pool's worst case beside the host's own (``HOST_ROOM``, or twice what
the host uses now), raises it (as root, once per node: a later agent finds it raised)
up to what the kernel allows on 64-bit, and logs it; past that, or where it may not
write, it refuses with the setting, the numbers and what to change. Raising costs
nothing by itself: pid_max and threads-max only bound counts (systemd raises pid_max to
4,194,304 on every 64-bit machine it boots), and a sandbox's open files, task structs and
kernel stacks are charged to its memory cgroup, so its memory limit still bounds what
they take of the node's memory. (Several pools on one node each check their own
worst case: their sum is not held; give a node one pool or tables for all.)

Native AIO's table (``fs.aio-max-nr``) is not budgeted but closed: io_setup and its
kin are refused unless a spec asks for ``AIO`` (providers/syscalls.py). Under gVisor
a sandbox's files and tasks are its own kernel's: the tables here hold its sentry and
gofer only.
"""

import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from sandman_ray.errors import ProviderError
from sandman_ray.spec import PoolConfig

logger = logging.getLogger(__name__)

PROC_SYS = Path("/proc/sys")
LOCK = Path("/run/sandman-ray/host-tables.lock")  # agents of one node raise in turn
# What the host keeps for itself beyond the pools' worst case (or twice what it uses
# as the agent starts, if more): the kernel's own default pid_max (a whole machine's
# processes), and a million open files (this node's Ray and agents used ~3,000).
HOST_ROOM = {"kernel.pid_max": 32768, "kernel.threads-max": 32768, "fs.file-max": 1 << 20}
# The most each may be raised to: 64-bit kernels' PID_MAX_LIMIT (threads-max above it
# would count tasks that cannot have a pid); file-max is an unsigned long.
CEILING = {"kernel.pid_max": 4194304, "kernel.threads-max": 4194304,
           "fs.file-max": (1 << 63) - 1}


@dataclass(frozen=True)
class PoolNeeds:
    """The most one pool's sandboxes may hold on one node: ``max_sandboxes`` of
    ``pids`` processes (None: no limit) of ``nofile`` open files each."""

    max_sandboxes: int
    pids: Optional[int]
    nofile: int

    @classmethod
    def of(cls, config: Optional[PoolConfig]) -> "PoolNeeds":
        """The needs of a pool of ``config`` (None: PoolConfig's defaults, for a
        provider used without a pool)."""
        config = config if config is not None else PoolConfig()
        return cls(config.max_sandboxes, config.default_pids, config.default_nofile)

    def tasks(self) -> int:
        return self.max_sandboxes * self.pids

    def files(self) -> int:
        return self.tasks() * self.nofile


def read(setting: str, root: Path = PROC_SYS) -> int:
    """A /proc/sys setting's first number (``kernel.pid_max``)."""
    return int((root / setting.replace(".", "/")).read_text().split()[0])


def in_use(root: Path = PROC_SYS) -> Dict[str, int]:
    """What the host holds now of each table: open files (fs.file-nr's first field)
    and tasks (loadavg's count of scheduling entities)."""
    files = read("fs.file-nr", root)
    with open("/proc/loadavg") as fh:
        tasks = int(fh.read().split()[3].split("/")[1])
    return {"kernel.pid_max": tasks, "kernel.threads-max": tasks, "fs.file-max": files}


def wanted(needs: PoolNeeds, used: Dict[str, int]) -> Dict[str, int]:
    """setting -> the least value that holds the pool's worst case beside the host."""
    room = {k: max(v, 2 * used.get(k, 0)) for k, v in HOST_ROOM.items()}
    return {"kernel.pid_max": needs.tasks() + room["kernel.pid_max"],
            "kernel.threads-max": needs.tasks() + room["kernel.threads-max"],
            "fs.file-max": needs.files() + room["fs.file-max"]}


def _why(setting: str, needs: PoolNeeds, want: int, have: int) -> str:
    worst = _worst(setting, needs)
    formula = "max_sandboxes %d x default_pids %d" % (needs.max_sandboxes, needs.pids)
    if setting == "fs.file-max":
        formula += " x default_nofile %d" % needs.nofile
    return ("the node's %s is %d; the pool's sandboxes may hold %s = %d of it and the host "
            "keeps %d: %d is needed" % (setting, have, formula, worst, want - worst, want))


def _worst(setting: str, needs: PoolNeeds) -> int:
    return needs.files() if setting == "fs.file-max" else needs.tasks()


def hold(needs: PoolNeeds, pool: str, root: Path = PROC_SYS, lock: Path = LOCK,
         may_raise: Optional[bool] = None) -> Dict[str, int]:
    """Make the node's tables hold ``needs`` beside the host, raising what falls short
    (``may_raise``: None, where this process is root); the settings raised, old value
    -> new. A fatal ProviderError names the setting and the numbers where a table
    cannot (past its ceiling, or not raised), or where ``nofile`` passes fs.nr_open.
    A pool without a pids limit holds no bound on them: it is said, not refused."""
    nr_open = read("fs.nr_open", root)
    if needs.nofile > nr_open:
        raise ProviderError("pool %s: default_nofile %d is more than the node's fs.nr_open "
                            "(%d), the most open files any process may have: lower "
                            "default_nofile or raise fs.nr_open" % (pool, needs.nofile, nr_open),
                            "fatal")
    if needs.pids is None:
        logger.warning("pool %s: no pids limit (default_pids=None): its sandboxes may take "
                       "the node's whole kernel.pid_max, kernel.threads-max and fs.file-max",
                       pool)
        return {}
    if may_raise is None:
        may_raise = os.geteuid() == 0
    raised = {}
    with _locked(lock if may_raise else None):
        want = wanted(needs, in_use(root))
        for setting, value in want.items():
            have = read(setting, root)
            if have >= value:
                continue
            why = _why(setting, needs, value, have)
            if value > CEILING[setting]:
                raise ProviderError("pool %s: %s, more than the kernel allows (%d): lower "
                                    "max_sandboxes or default_pids" % (
                                        pool, why, CEILING[setting]), "fatal")
            if not may_raise:
                raise ProviderError("pool %s: %s; the agent is not root and may not raise it: "
                                    "set %s = %d (sysctl), or lower max_sandboxes, "
                                    "default_pids or default_nofile" % (
                                        pool, why, setting, value), "fatal")
            (root / setting.replace(".", "/")).write_text(str(value))
            raised[setting] = (have, value)
            logger.warning("pool %s: raised the node's %s from %d to %d: %s", pool, setting,
                           have, value, why)
    return raised


@contextlib.contextmanager
def _locked(path: Optional[Path]):
    """Agents of one node read and raise in turn (two at once could lower each
    other's raise); nothing where this process may not raise."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
