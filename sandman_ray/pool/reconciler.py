"""The pool's decisions: plain code over its records, with no Ray in it.

Each tick compares what is wanted (waiters + warm targets per spec) with what exists
and takes the next step: lend READY sandboxes to waiters (clients in turn), start
creates (paced by an adaptive token bucket and a cap on creates in flight), reset or
delete released sandboxes, delete surplus. Every question is answered from the
indexes of ``Records``, so a tick costs what changed since the last one, not the
number of records. State transitions happen only through ``Records.move``; side
effects only through the provider; Ray only through ``cluster`` (the actor's
``RayCluster``: live hosts and the leases they hold, alive nodes, handing a host a
lease and telling it one ended); time only through ``clock``. The unit tests drive it with a fake of each.

This file holds the state and the loop; the decisions are mixins over that state, one
concern each: lending and the holder's calls in ``sandman_ray.pool.lending``, creates,
resets and deletes in ``sandman_ray.pool.supply``, the watchdog and a restarted pool's
recovery in ``sandman_ray.pool.upkeep``, the snapshots, warm targets and paused leases
in ``sandman_ray.pool.snapshots``.
"""

import asyncio
import collections
import logging
import os
from typing import Deque, Dict, List, Optional

from sandman_ray.errors import AcquireTimeout
from sandman_ray.pool import shares
from sandman_ray.pool.lending import Lending
from sandman_ray.pool.pacing import AdaptiveTokenBucket
from sandman_ray.pool.records import Records
from sandman_ray.pool.snapshots import SnapshotOps
from sandman_ray.pool.supply import Supply
from sandman_ray.pool.timings import LoopTimes
from sandman_ray.pool.upkeep import Upkeep
from sandman_ray.pool.states import EndedLeases, Sandbox, State
from sandman_ray.pool.waiters import FairQueue, Waiter
from sandman_ray.providers.base import Provider
from sandman_ray.spec import PoolConfig, SandboxSpec

logger = logging.getLogger(__name__)

TICK_S = 0.05          # reconcile at least this often while anything is pending
EVENT_LOG = 5000       # transitions kept for ``events``
# How often the pool compares the provider's inventory with its records: a create that
# finished after the pool restarted (its request died with the old process) leaves a
# sandbox no record knows, which is deleted; an idle sandbox that died is replaced.
INVENTORY_INTERVAL_S = 5.0
NODE_CHECK_S = 1.0     # how often the pool asks which Ray nodes are alive


class Reconciler(Lending, Supply, SnapshotOps, Upkeep):
    def __init__(self, name: str, config: PoolConfig, provider: Provider, cluster, clock,
                 metrics):
        self.name, self.config, self.provider = name, config, provider
        self.cluster, self.clock, self.metrics = cluster, clock, metrics
        self.records = Records()
        self.closing = False               # shutdown began
        self.waiters = FairQueue()
        self.waiting: Dict[str, Waiter] = {}  # lease id -> its waiter, until it is served
        self.bucket = AdaptiveTokenBucket(config.create_rate_per_s, config.create_burst,
                                          clock=clock.monotonic)
        self.events: Deque[tuple] = collections.deque(maxlen=EVENT_LOG)
        self.stats = {"creates": 0, "create_failures": 0, "deletes": 0, "resets": 0,
                      "throttled": 0, "reclaimed": 0, "leases": 0, "lost": 0,
                      "registered": 0}  # leases a host took by a second call
        self.create_starts: Deque[float] = collections.deque(maxlen=5000)  # wall clock
        # sandbox id -> futures of _delete calls that wait for a delete already under way
        self.delete_waiters: Dict[str, List[asyncio.Future]] = {}
        self.last_lent: Dict[SandboxSpec, float] = {}
        self.ended = EndedLeases()  # for hosts that ask why_ended
        # hosts seen alive (or that answered an offer) that live or hold a lease: once
        # gone, every lease they hold ends at the next sweep (Upkeep.sweep)
        self.hosts_seen: set = set()
        self.wake: Optional[asyncio.Event] = None
        self.loop_times = LoopTimes()  # what its ticks and sweeps take (``status``)
        self._init_snapshots()

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Tick whenever something changed (and every TICK_S while anything is
        pending); sweep, check nodes and inventory on their own periods. Forever."""
        self.wake = self.wake or asyncio.Event()
        next_sweep, next_node_check = 0.0, 0.0
        next_inventory = self.clock.monotonic() + INVENTORY_INTERVAL_S
        while True:
            try:
                with self.loop_times.timed("tick"):
                    self.tick()
                if self.metrics.due():
                    self.metrics.refresh(self.records.counts(), len(self.waiters),
                                         self.bucket.rate, self.records.per_client)
                now = self.clock.monotonic()
                if now >= next_sweep:
                    next_sweep = now + self.config.sweep_interval_s
                    with self.loop_times.timed("sweep"):
                        await self.sweep()
                if now >= next_node_check:
                    next_node_check = now + NODE_CHECK_S
                    await self.drop_dead_nodes()
                if now >= next_inventory:
                    next_inventory = now + INVENTORY_INTERVAL_S
                    await self.check_inventory()
            except Exception:
                logger.exception("pool %s: reconcile failed", self.name)
            try:
                await asyncio.wait_for(self.wake.wait(), TICK_S if self.busy() else
                                       self.config.sweep_interval_s)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()

    def kick(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def busy(self) -> bool:
        return bool(self.waiters.per_spec) or bool(self.records.count(State.REQUESTED)) \
            or bool(self.records.count(State.RELEASING))

    def tick(self) -> None:
        self.lend()
        wanted = self.wanted()  # after lending: a waiter served wants nothing more
        self.release_ended(wanted)
        self.create_missing(wanted)
        self.delete_surplus(wanted)
        self.weigh()

    def weigh(self) -> None:
        """Send the provider the CPU weights that changed (pool/shares.py), without
        waiting for it."""
        if not self.records.reweigh:
            return
        clients, self.records.reweigh = self.records.reweigh, set()
        if not self.provider.weighs:
            return
        changed = {}
        for sandbox_id, weight in shares.weights(clients, self.records.by_client,
                                                 self.records.client_weight).items():
            rec = self.records.by_id[sandbox_id]
            if rec.cpu_weight != weight:
                rec.cpu_weight = weight
                changed[sandbox_id] = (rec.client, weight)
        if changed:
            asyncio.get_running_loop().create_task(self._weighed(changed))

    async def _weighed(self, changed: Dict[str, tuple]) -> None:
        try:
            await self.provider.weigh(changed)
        except Exception as exc:  # noqa: BLE001 - a share of CPU is not worth a lease
            logger.warning("pool %s: CPU weights of %d sandboxes not set: %s", self.name,
                           len(changed), exc)

    def _to(self, rec: Sandbox, state: State, reason: str = "") -> None:
        self.records.move(rec, state, self.clock.monotonic())
        self._event(rec, state.value, reason)

    def _event(self, rec: Sandbox, what: str, reason: str = "") -> None:
        self.events.append((self.clock.time(), rec.sandbox_id, what, reason))

    def summary(self) -> str:
        return ", ".join("%s %d" % (k, v) for k, v in self.records.counts().items() if v) \
            or "no sandboxes"

    # ------------------------------------------------------------------ answers
    def status(self) -> dict:
        now = self.clock.monotonic()
        leased = self.records.in_state[State.LEASED].values()
        return {"pool": self.name, "pid": os.getpid(), "states": self.records.counts(),
                "waiters": len(self.waiters),
                "create_rate_per_s": self.bucket.rate, "stats": dict(self.stats),
                "oldest_lease_s": max((now - r.leased_at for r in leased), default=0.0),
                "leases_per_client": self.records.per_client,
                "snapshots": len(self.snapshots),
                "snapshot_bytes": sum(i.size_bytes for i in self.snapshots.values()),
                "create_starts": list(self.create_starts)[-1000:],
                "loop_ms": self.loop_times.summary()}

    def sandboxes(self) -> List[dict]:
        now = self.clock.monotonic()
        return [{"sandbox_id": r.sandbox_id, "state": r.state.value, "image": r.spec.image,
                 "spec": r.spec.to_dict(), "node_id": getattr(r.info, "node_id", None),
                 "client": r.client, "holder": r.holder, "age_s": now - r.since,
                 "cpu_weight": r.cpu_weight,
                 "leased": r.lease is not None}
                for r in self.records.values()]

    async def shutdown(self) -> int:
        """Delete every sandbox of the pool (leases end); returns how many."""
        self.closing = True  # no create starts from here on
        for waiter in list(self.waiters.waiting()):
            self._forget_waiter(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout("pool %s is shutting down" % self.name))
        recs = list(self.records.values())
        await asyncio.gather(*(self._delete(r, "pool shutdown") for r in recs),
                             return_exceptions=True)
        try:
            await self.provider.shutdown()  # the pool's snapshots with its sandboxes
            self.snapshots.clear()
        finally:
            await self.provider.close()
        return len(recs)

