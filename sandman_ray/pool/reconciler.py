"""The pool's decisions: plain code over its records, with no Ray in it.

Each tick compares what is wanted (waiters + warm targets per spec) with what exists
and takes the next step: lend READY sandboxes to waiters (clients in turn), start
creates (paced by an adaptive token bucket and a cap on creates in flight), reset or
delete released sandboxes, delete surplus. Every question is answered from the
indexes of ``Records``, so a tick costs what changed since the last one, not the
number of records. State transitions happen only through ``PoolState.to``; side
effects only through the provider; Ray only through ``cluster`` (the actor's
``RayCluster``: live hosts and the leases they hold, alive nodes, handing a host a
lease and telling it one ended); time only through ``clock``. The unit tests drive it
with a fake of each.

This file holds the loop; the state the decisions share is one ``PoolState``
(``sandman_ray.pool.shared``), and the decisions are one class per concern, each
handed that state and what else it uses: lending and the holder's calls
(``lending``: ``sandman_ray.pool.lending``), creates, resets and deletes (``supply``),
snapshots, warm targets and paused leases (``snapshot_ops``), the watchdog and a
restarted pool's recovery (``upkeep``). The pool actor calls the concern that
answers each call.
"""

import asyncio
import logging
import os
from typing import Dict, List

from sandman_ray.errors import AcquireTimeout
from sandman_ray.pool import shares
from sandman_ray.pool.lending import Lending
from sandman_ray.pool.shared import PoolState
from sandman_ray.pool.snapshots import SnapshotOps
from sandman_ray.pool.supply import Supply
from sandman_ray.pool.timings import LoopTimes
from sandman_ray.pool.upkeep import Upkeep
from sandman_ray.pool.states import State
from sandman_ray.providers.base import Provider
from sandman_ray.spec import PoolConfig

logger = logging.getLogger(__name__)

TICK_S = 0.05          # reconcile at least this often while anything is pending
# How often the pool compares the provider's inventory with its records: a create that
# finished after the pool restarted (its request died with the old process) leaves a
# sandbox no record knows, which is deleted; an idle sandbox that died is replaced.
INVENTORY_INTERVAL_S = 5.0
NODE_CHECK_S = 1.0     # how often the pool asks which Ray nodes are alive


class Reconciler:
    def __init__(self, name: str, config: PoolConfig, provider: Provider, cluster, clock,
                 metrics):
        self.name, self.config, self.provider = name, config, provider
        self.clock, self.metrics = clock, metrics
        self.state = state = PoolState(name, config, clock)
        self.lending = Lending(state, provider, cluster, metrics)
        self.supply = Supply(state, provider, self.lending, metrics)
        self.snapshot_ops = SnapshotOps(state, provider, self.lending, self.supply)
        self.supply.on_gone = self.snapshot_ops.forget_fork_snapshot
        self.upkeep = Upkeep(state, provider, cluster, metrics, self.lending, self.supply,
                             self.snapshot_ops)
        self.loop_times = LoopTimes()  # what its ticks and sweeps take (``status``)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Tick whenever something changed (and every TICK_S while anything is
        pending); sweep, check nodes and inventory on their own periods. Forever."""
        state, records = self.state, self.state.records
        state.wake = state.wake or asyncio.Event()
        next_sweep, next_node_check = 0.0, 0.0
        next_inventory = self.clock.monotonic() + INVENTORY_INTERVAL_S
        while True:
            try:
                with self.loop_times.timed("tick"):
                    self.tick()
                if self.metrics.due():
                    self.metrics.refresh(records.counts(), len(state.waiters),
                                         self.supply.bucket.rate, records.per_client)
                now = self.clock.monotonic()
                if now >= next_sweep:
                    next_sweep = now + self.config.sweep_interval_s
                    with self.loop_times.timed("sweep"):
                        await self.upkeep.sweep()
                if now >= next_node_check:
                    next_node_check = now + NODE_CHECK_S
                    await self.upkeep.drop_dead_nodes()
                if now >= next_inventory:
                    next_inventory = now + INVENTORY_INTERVAL_S
                    await self.upkeep.check_inventory()
            except Exception:
                logger.exception("pool %s: reconcile failed", self.name)
            try:
                await asyncio.wait_for(state.wake.wait(), TICK_S if self.busy() else
                                       self.config.sweep_interval_s)
            except asyncio.TimeoutError:
                pass
            state.wake.clear()

    def busy(self) -> bool:
        records = self.state.records
        return bool(self.state.waiters.per_spec) or bool(records.count(State.REQUESTED)) \
            or bool(records.count(State.RELEASING))

    def tick(self) -> None:
        self.lending.lend()
        wanted = self.state.wanted()  # after lending: a waiter served wants nothing more
        self.supply.release_ended(wanted)
        self.supply.create_missing(wanted)
        self.supply.delete_surplus(wanted)
        self.weigh()

    def weigh(self) -> None:
        """Send the provider the CPU weights that changed (pool/shares.py), without
        waiting for it."""
        records = self.state.records
        if not records.reweigh:
            return
        clients, records.reweigh = records.reweigh, set()
        if not self.provider.weighs:
            return
        changed = {}
        for sandbox_id, weight in shares.weights(clients, records.by_client,
                                                 records.client_weight).items():
            rec = records.by_id[sandbox_id]
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

    # ------------------------------------------------------------------ answers
    def status(self) -> dict:
        now, state, records = self.clock.monotonic(), self.state, self.state.records
        leased = records.in_state[State.LEASED].values()
        return {"pool": self.name, "pid": os.getpid(), "states": records.counts(),
                "waiters": len(state.waiters),
                "create_rate_per_s": self.supply.bucket.rate, "stats": dict(state.stats),
                "oldest_lease_s": max((now - r.leased_at for r in leased), default=0.0),
                "leases_per_client": records.per_client,
                "snapshots": len(state.snapshots),
                "snapshot_bytes": sum(i.size_bytes for i in state.snapshots.values()),
                "create_starts": list(self.supply.create_starts)[-1000:],
                "loop_ms": self.loop_times.summary()}

    def sandboxes(self) -> List[dict]:
        now = self.clock.monotonic()
        return [{"sandbox_id": r.sandbox_id, "state": r.state.value, "image": r.spec.image,
                 "spec": (r.task or r.spec).to_dict(), "node_id": getattr(r.info, "node_id", None),
                 "client": r.client, "holder": r.holder, "age_s": now - r.since,
                 "cpu_weight": r.cpu_weight,
                 "leased": r.lease is not None}
                for r in self.state.records.values()]

    async def shutdown(self) -> int:
        """Delete every sandbox of the pool (leases end); returns how many."""
        state = self.state
        state.closing = True  # no create starts from here on
        for waiter in list(state.waiters.waiting()):
            state.forget_waiter(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout("pool %s is shutting down" % self.name))
        recs = list(state.records.values())
        await asyncio.gather(*(self.supply.delete(r, "pool shutdown") for r in recs),
                             return_exceptions=True)
        try:
            await self.provider.shutdown()  # the pool's snapshots with its sandboxes
            state.snapshots.clear()
        finally:
            await self.provider.close()
        return len(recs)

