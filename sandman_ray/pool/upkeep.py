"""The pool's upkeep: the watchdog, which ends leases that no live host holds or that
outlived their TTL or idle timeout, forgets the sandboxes of dead Ray nodes and
deletes the provider's sandboxes of this pool that no record knows and the idle ones
that died; and the recovery of a restarted pool from the provider's inventory and the
leases its live hosts hold.
"""

import logging
from typing import List, Optional, Set

from sandman_ray.pool.lending import Lending
from sandman_ray.pool.shared import PoolState
from sandman_ray.pool.snapshots import SnapshotOps
from sandman_ray.pool.states import Sandbox, State
from sandman_ray.pool.supply import Supply
from sandman_ray.providers.base import POOL_LABEL, Provider

logger = logging.getLogger(__name__)


class Upkeep:
    """The watchdog, the inventory and a restarted pool's recovery.

    Reads and writes of the pool's state (``PoolState``): records (adds recovered
    ones; ends leases through ``lending``, deletes through ``supply``), stats,
    events; reads config. Asks ``cluster`` which hosts live, which nodes are alive and
    what leases hosts hold; ``provider`` for its inventory. Recovers the snapshots
    through ``snapshot_ops``. Its own: the hosts seen alive that live or hold a lease
    (``hosts_seen``): once gone, every lease they hold ends at the next sweep."""

    def __init__(self, state: PoolState, provider: Provider, cluster, metrics,
                 lending: Lending, supply: Supply, snapshot_ops: SnapshotOps):
        self.state, self.provider, self.cluster, self.metrics = state, provider, cluster, metrics
        self.lending, self.supply, self.snapshot_ops = lending, supply, snapshot_ops
        self.hosts_seen: Set[str] = set()

    # ------------------------------------------------------------------ watchdog
    async def sweep(self) -> None:
        leased = self.state.records.walk(State.LEASED)
        if not leased:
            return
        taken = self.state.clock.monotonic()
        # asked before the list: a host that answered an offer had its name before the
        # list was taken, so it is on it while it lives
        answered = await self.cluster.answered_hosts()
        names = await self.cluster.live_hosts()
        self.hosts_seen |= answered | (names & self.state.records.holders())
        now = self.state.clock.monotonic()
        for rec in leased:
            if rec.state is not State.LEASED or rec.registered_at >= taken:
                continue  # ended meanwhile, or registered by a host the list may predate
            why = self._orphaned(rec, names, now) or self._expired(rec, now)
            if why:
                self.state.stats["reclaimed"] += 1
                self.lending.end_lease(rec, "reclaimed: " + why)
        # a host is remembered while it lives or holds a lease (its death ends them)
        self.hosts_seen &= names | self.state.records.holders()

    async def drop_dead_nodes(self) -> None:
        """Forget the sandboxes on Ray nodes that have died (with them): their holders
        get SandboxLost from their handles, and warm capacity is created elsewhere."""
        placed = self.state.records.nodes()
        if not placed:
            return
        alive = await self.cluster.alive_nodes()
        for node in [n for n in placed if n not in alive]:
            for rec in self.state.records.on_node(node):
                if rec.state not in (State.DELETING, State.GONE):
                    self.state.stats["lost"] += 1
                    self.supply.delete_soon(rec, "lost: Ray node %s died" % node[:12])

    def _orphaned(self, rec: Sandbox, names: set, now: float) -> Optional[str]:
        """Why no live host holds the leased ``rec`` (None: one does, or its host may
        still be starting). ``names``: the live hosts' names. A host seen alive once,
        or that answered an offer, is seen for every lease it holds, however new: its
        death ends them all at the next sweep; the grace is only for a host that
        never appeared. A lease kept alive by its caller (``keepalive_s``) lasts while
        it is kept, whatever its host: a restart of the host costs it nothing."""
        if rec.keepalive_s:
            if now - rec.kept_at > rec.keepalive_s:
                return "no call or keepalive for %g s" % rec.keepalive_s
            return None
        alive = rec.holder is not None and rec.holder in names
        rec.holder_seen = rec.holder_seen or alive or rec.holder in self.hosts_seen
        if not alive and rec.holder_seen:
            return "host %s is gone" % rec.holder
        if not alive and now - rec.leased_at > self.state.config.lease_grace_s:
            return "no host within %.0f s" % self.state.config.lease_grace_s
        return None

    def _expired(self, rec: Sandbox, now: float) -> Optional[str]:
        """Why the lease of ``rec`` is over by its TTL or idle timeout (None: it is not)."""
        ttl = rec.spec.ttl_s or self.state.config.sandbox_ttl_s  # the spec's, else the pool's
        idle = rec.spec.idle_timeout_s or self.state.config.idle_timeout_s
        if ttl and now - rec.leased_at > ttl:
            return "the lease outlived its TTL of %g s" % ttl
        if idle and now - rec.last_used > idle and not rec.paused:
            return "the lease was idle for %g s" % idle
        return None

    async def gc(self, dry_run: bool = True) -> List[dict]:
        """Sandboxes that no live host holds: leases whose host is gone (or never came
        within the grace) and sandboxes of this pool that the provider has but no
        record knows. Deleted unless ``dry_run``; returned either way."""
        names = await self.cluster.live_hosts()
        now = self.state.clock.monotonic()
        found = []
        for rec in self.state.records.walk(State.LEASED):
            why = self._orphaned(rec, names, now)
            if why:
                found.append({"sandbox_id": rec.sandbox_id, "state": rec.state.value,
                              "client": rec.client, "why": why})
                if not dry_run:
                    await self.supply.delete(rec, "gc: %s" % why)
        for info in await self.strays():
            found.append({"sandbox_id": info.sandbox_id, "state": "unknown", "client": None,
                          "why": "no record of this pool knows it"})
            if not dry_run:
                await self._delete_stray(info)
        return found

    async def strays(self) -> list:
        """Sandboxes of this pool that the provider has and no record knows."""
        return [info for info in await self.provider.list({POOL_LABEL: self.state.name})
                if info.sandbox_id not in self.state.records]

    async def _delete_stray(self, info) -> None:
        logger.warning("pool %s: deleting %s, which no record knows", self.state.name,
                       info.sandbox_id)
        self.state.stats["deletes"] += 1
        self.metrics.deleted("stray")
        await self.supply.provider_delete(info.sandbox_id)

    async def check_inventory(self) -> None:
        """The provider's sandboxes of this pool against the records: one no record
        knows is deleted (a stray), and a READY one that died while idle (its daemon
        killed, its process gone) is deleted, so that no acquire is lent it and the
        warm target makes another."""
        for info in await self.provider.list({POOL_LABEL: self.state.name}):
            rec = self.state.records.get(info.sandbox_id)
            if rec is None:
                await self._delete_stray(info)
            elif not info.alive and rec.state is State.READY:
                self.state.stats["lost"] += 1
                self.supply.delete_soon(rec, "lost: it died while idle")

    # ------------------------------------------------------------------ recovery
    async def recover(self) -> None:
        """After a restart: adopt the provider's sandboxes of this pool. The leases that
        live hosts hold go on (the hosts are the pool's record of them); every other
        sandbox is started afresh (a new token) before anyone is lent it, since it may
        have served a lease no host had taken yet."""
        try:
            await self.snapshot_ops.recover()
        except Exception as exc:  # noqa: BLE001 - listed again by the next call that needs them
            logger.warning("pool %s: its snapshots could not be listed: %s", self.state.name, exc)
        infos = await self.provider.list({POOL_LABEL: self.state.name})
        if not infos:
            return
        held = await self.cluster.held_leases(self.state.name)
        now_wall, now = self.state.clock.time(), self.state.clock.monotonic()
        for info in infos:
            if not info.alive or info.spec is None:  # died while we were down, or unknown
                await self.supply.provider_delete(info.sandbox_id)
                continue
            # its spec as the pool keys it; a lease's settings bound late, beside it
            slot = self.state.config.slot(info.spec)
            rec = Sandbox(info.sandbox_id, slot, State.RELEASING, now, info=info)
            lease, holder = held.get(info.sandbox_id, (None, None))
            if lease is not None and lease.token != info.token:
                lease = None  # started afresh since: that lease is over
            if lease is None:
                self.state.records.add(rec)
            else:
                rec.state = State.LEASED
                rec.task = info.spec if info.spec != slot else None
                self.state.records.add(rec)
                self.state.records.lend(rec, lease, lease.client, holder)
                rec.holder_seen = True
                rec.registered_at = now
                rec.leased_at = rec.last_used = now - max(now_wall - lease.leased_wall, 0.0)
                # kept alive by its caller: a restart of the pool grants it one period
                rec.keepalive_s, rec.kept_at = lease.keepalive_s, now
            self.state.event(rec, "recovered as %s" % rec.state.value)
        logger.info("pool %s: recovered %d sandboxes", self.state.name, len(infos))
