"""The CPU weights of a node's leased sandboxes: the pool's, and a client over its share
weighed down while the node is contended.

The pool weighs each leased sandbox at its client's weight over the client's count on
the node (pool/shares.py): every client's sandboxes together weigh its weight. That
shares the CPU fairly over time, but not the latency of a call: a client whose
sandboxes keep the CPU busy (a tenant that floods them with commands) still holds it
for a slice whenever another's sandbox wakes for a short command, and the other's tail
latency grows tenfold (bench/service.py, "flood"). So, once a second, while the node's
sandboxes use more than half its CPU, each client's use is compared with its share
(the node's CPUs times its weight over the weights of the clients using any): a client
over its share weighs the least the kernel takes until it is back under 0.8 of it, and
the others keep their weights. The CPU stays work-conserving: a client alone, or the
only one wanting more, still gets all that is free.
"""

import asyncio
import logging
import os
from typing import Callable, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

LEAST = 2 / 1024  # the least weight: cgroup v1 cpu.shares 2 (v2 cpu.weight 1)
PERIOD_S = 1.0
BUSY = 0.5  # the node's sandboxes use more than this of its CPUs: contended
ACTIVE = 0.05  # CPUs a client uses to count as wanting any
LEAVE = 0.8  # an over-share client is weighed normally again under this of its share


def cpu_seconds(procs: str) -> float:
    """CPU seconds used by the processes of a cgroup (its ``cgroup.procs``) and by the
    children they reaped (a command's ``true`` counts once its daemon waited for it)."""
    total = 0
    try:
        with open(procs) as fh:
            pids = fh.read().split()
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open("/proc/%s/stat" % pid) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


class NodeBusy:
    """How busy the node's CPUs were since the last ask (0 to 1), from /proc/stat."""

    def __init__(self):
        self.last = self._ticks()

    @staticmethod
    def _ticks() -> Tuple[int, int]:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # (busy, all)

    def fraction(self) -> float:
        now = self._ticks()
        busy, total = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        return busy / total if total > 0 else 0.0


class CpuShares:
    """A node's leased sandboxes' weights (``set``, from the pool) and, while the node
    is contended, the demotion of clients over their share (``step``, once a
    second). ``write(sandbox id, weight)`` applies a weight; ``procs(sandbox id)`` is
    the sandbox's cpu group's ``cgroup.procs`` (None: no such group)."""

    def __init__(self, write: Callable[[str, float], None],
                 procs: Callable[[str], Optional[str]], cpus: Optional[int] = None):
        self.write, self.procs = write, procs
        self.cpus = cpus or os.cpu_count() or 1
        self.weights: Dict[str, Tuple[str, float]] = {}  # sandbox id -> (client, weight)
        self.applied: Dict[str, float] = {}  # sandbox id -> the weight written last
        self.used: Dict[str, float] = {}  # sandbox id -> its CPU seconds at the last step
        self.rates: Dict[str, float] = {}  # client -> CPUs it used, smoothed
        self.over: set = set()  # clients weighed down
        self.watch: Optional[asyncio.Task] = None

    def set(self, sandbox_id: str, client: Optional[str], weight: float) -> None:
        """The pool's weight of a leased sandbox of ``client`` (None: not leased any
        more, back at 1)."""
        if client is None:
            self.weights.pop(sandbox_id, None)
            self.used.pop(sandbox_id, None)
            if sandbox_id not in self.applied:
                return  # never weighed: its group is at the default already
        else:
            self.weights[sandbox_id] = (client, weight)
        self._apply(sandbox_id)
        if self.weights and (self.watch is None or self.watch.done()):
            self.watch = asyncio.ensure_future(self._watch())

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is being removed (its group with it): nothing to write."""
        self.weights.pop(sandbox_id, None)
        self.used.pop(sandbox_id, None)
        self.applied.pop(sandbox_id, None)

    def _apply(self, sandbox_id: str) -> None:
        client, weight = self.weights.get(sandbox_id, (None, 1.0))
        weight = LEAST if client in self.over else weight
        if self.applied.get(sandbox_id) != weight:
            try:
                self.write(sandbox_id, weight)
                self.applied[sandbox_id] = weight
            except OSError as exc:  # its group is gone: it is being removed
                logger.debug("sandbox %s not weighed: %s", sandbox_id, exc)
        if sandbox_id not in self.weights:
            self.applied.pop(sandbox_id, None)

    async def _watch(self) -> None:
        """Once a second while any sandbox is leased; the sandboxes' use is read only
        while two clients or more hold some and the node is busy (a read per process
        of each leased sandbox)."""
        loop = asyncio.get_running_loop()
        busy = NodeBusy()
        while self.weights:
            await asyncio.sleep(PERIOD_S)
            try:
                clients = {client for client, _ in self.weights.values()}
                if len(clients) < 2 or busy.fraction() < BUSY:
                    self.used.clear()  # the next reading starts afresh
                    self.rates.clear()
                    self.step({}, PERIOD_S)
                    continue
                used = await loop.run_in_executor(None, self._read)
                self.step(used, PERIOD_S)
            except Exception:  # noqa: BLE001 - weights wait for the next second
                logger.exception("the sandboxes' CPU use could not be read")

    def _read(self) -> Dict[str, float]:
        out = {}
        for sandbox_id in list(self.weights):
            procs = self.procs(sandbox_id)
            if procs is not None:
                out[sandbox_id] = cpu_seconds(procs)
        return out

    def step(self, used: Dict[str, float], elapsed: float) -> None:
        """``used``: each leased sandbox's CPU seconds so far, ``elapsed`` seconds after
        the last step: which clients are over their share now, and their weights."""
        now: Dict[str, float] = {}
        for sandbox_id, seconds in used.items():
            if sandbox_id not in self.weights:
                continue
            before = self.used.get(sandbox_id)
            self.used[sandbox_id] = seconds
            if before is not None:
                client = self.weights[sandbox_id][0]
                now[client] = now.get(client, 0.0) + max(0.0, seconds - before) / elapsed
        weight_of: Dict[str, float] = {}
        for client, weight in self.weights.values():
            weight_of[client] = weight_of.get(client, 0.0) + weight
        self.rates = {c: 0.5 * self.rates.get(c, r) + 0.5 * r for c, r in now.items()}
        active = {c for c, r in self.rates.items() if r >= ACTIVE and c in weight_of}
        contended = sum(self.rates.values()) >= BUSY * self.cpus and len(active) > 1
        over = set()
        if contended:
            total = sum(weight_of[c] for c in active)
            for client in active:
                share = self.cpus * weight_of[client] / total
                limit = LEAVE * share if client in self.over else share
                if self.rates[client] > limit:
                    over.add(client)
        if over != self.over:
            logger.info("CPU weighed down for clients over their share: %s",
                        ", ".join(sorted(over)) or "none")
            self.over = over
            for sandbox_id in list(self.weights):
                self._apply(sandbox_id)
