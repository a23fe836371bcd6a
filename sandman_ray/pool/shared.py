"""What the pool's concerns share: one ``PoolState`` that each of them receives.

The pool's decisions are split by concern (lending, supply, snapshots, upkeep), each a
class of its own that is handed this state and the collaborators it needs, so that
what each concern reads and writes is written in its constructor and its docstring.
What only one concern uses (the token bucket of creates, the futures of a delete under
way, the names of snapshots being taken, the hosts seen alive) is that concern's own
and lives on it (the reconciler's ``status`` reads the bucket's rate and when creates
started from the supply).
"""

import asyncio
import collections
from typing import Deque, Dict, Optional, Set

from sandman_ray.pool.records import Records
from sandman_ray.pool.states import EndedLeases, Sandbox, State
from sandman_ray.pool.waiters import FairQueue, Waiter
from sandman_ray.providers.base import SnapshotInfo
from sandman_ray.spec import PoolConfig, SandboxSpec

EVENT_LOG = 5000       # transitions kept for ``events``


class PoolState:
    """The records, the waiters and what the pool remembers of its leases.

    name, config, clock: the pool's (config's warm targets change while it runs).
    records: every sandbox, indexed (``Records``): records move only through ``to``.
    waiters, waiting: the acquires that wait, in fair turn and by lease id, until one
        is served or given up (``forget_waiter`` takes it off both).
    ended: why each recent lease ended, for the hosts that ask.
    last_lent: per spec, when a sandbox of it was last lent (a released one is reset
        while its spec is in use).
    snapshots, fork_snapshots: the pool's snapshots by name; the images of those taken
        for a fork, deleted with their last sandbox.
    stats: counters for ``status``; events: the last transitions, for ``events``.
    closing: the pool is shutting down (no create starts).
    wake: set by ``kick`` when something changed, so the loop ticks soon.
    """

    def __init__(self, name: str, config: PoolConfig, clock):
        self.name, self.config, self.clock = name, config, clock
        self.records = Records()
        self.waiters = FairQueue()
        self.waiting: Dict[str, Waiter] = {}
        self.ended = EndedLeases()
        self.last_lent: Dict[SandboxSpec, float] = {}
        self.snapshots: Dict[str, SnapshotInfo] = {}
        self.fork_snapshots: Set[str] = set()
        self.stats = {"creates": 0, "create_failures": 0, "deletes": 0, "resets": 0,
                      "throttled": 0, "reclaimed": 0, "leases": 0, "lost": 0,
                      "registered": 0,  # leases a host took by a second call
                      "bound": 0}  # leases whose settings a warm sandbox took as lent
        self.events: Deque[tuple] = collections.deque(maxlen=EVENT_LOG)
        self.closing = False
        self.binding = 0  # leases lent whose settings are being bound (lending.py)
        self.wake: Optional[asyncio.Event] = None

    def to(self, rec: Sandbox, state: State, reason: str = "") -> None:
        """Move ``rec`` to ``state`` (its indexes follow) and log the transition."""
        self.records.move(rec, state, self.clock.monotonic())
        self.event(rec, state.value, reason)

    def event(self, rec: Sandbox, what: str, reason: str = "") -> None:
        self.events.append((self.clock.time(), rec.sandbox_id, what, reason))

    def kick(self) -> None:
        """Something changed: the loop ticks soon."""
        if self.wake is not None:
            self.wake.set()

    def forget_waiter(self, waiter: Waiter) -> None:
        self.waiters.remove(waiter)
        self.waiting.pop(waiter.lease_id, None)

    def wanted(self) -> Dict[SandboxSpec, int]:
        """Per spec: the warm target plus the waiters whose clients may get one more."""
        wanted = collections.Counter(self.config.warm)
        wanted.update(self.waiters.per_spec)
        quota = self.config.client_quota
        if quota is not None:
            for client, recs in self.records.by_client.items():
                if len(recs) >= quota:
                    for waiter in self.waiters.of(client):
                        wanted[waiter.spec] -= 1
        return wanted

    def summary(self) -> str:
        return ", ".join("%s %d" % (k, v) for k, v in self.records.counts().items() if v) \
            or "no sandboxes"
