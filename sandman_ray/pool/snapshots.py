"""The pool's snapshots, warm targets set while it runs, and paused leases.

A pool owns its snapshots: it takes them through its provider for the holder of a
lease (``snapshot``), lists them with their sizes and the sandboxes started from them,
and deletes them (``delete_snapshot``, and all of them with the pool). A snapshot taken
for a fork is the forks' own: it is deleted with the last sandbox started from it.

A paused lease (``pause``) keeps its sandbox, frozen: it is not reclaimed for
idleness, but its TTL still runs; whatever ends the lease thaws the sandbox first
(the provider's reset and delete do).
"""

import asyncio
import collections
import logging
import uuid
from typing import Dict, List, Optional, Set

from sandman_ray.errors import LeaseEnded, LeaseNotHeld, SnapshotInUse
from sandman_ray.pool.lending import Lending
from sandman_ray.pool.shared import PoolState
from sandman_ray.pool.states import Sandbox, State
from sandman_ray.pool.supply import Supply
from sandman_ray.providers.base import Provider, SnapshotInfo
from sandman_ray.spec import SandboxSpec, check_snapshot_name

logger = logging.getLogger(__name__)


class SnapshotOps:
    """Snapshots, warm targets and pauses of leased sandboxes.

    Reads and writes of the pool's state (``PoolState``): snapshots and
    fork_snapshots, config's warm targets, a leased record's ``paused``, events; reads
    records, ended, closing. Checks a lease's holder through ``lending``; deletes the
    sandboxes of a deleted snapshot and a lowered warm target's surplus through
    ``supply``. Its own: the names of snapshots being taken (``taking``)."""

    def __init__(self, state: PoolState, provider: Provider, lending: Lending, supply: Supply):
        self.state, self.provider, self.lending, self.supply = state, provider, lending, supply
        self.taking: Set[str] = set()

    def _held(self, lease_id: str, holder: Optional[str], op: str) -> Sandbox:
        """The sandbox of a lease ``holder`` holds; LeaseEnded for one that is over."""
        rec = self.state.records.leased(lease_id)
        if rec is None:
            raise LeaseEnded("pool %s: %s: lease %s is not held (%s)"
                             % (self.state.name, op, lease_id,
                                self.state.ended.get(lease_id) or "unknown lease"))
        self.lending.check_holder(rec, holder, op)
        return rec

    # ---- snapshots
    async def snapshot(self, lease_id: str, holder: Optional[str], name: Optional[str] = None,
                       for_fork: bool = False) -> dict:
        """Capture the files of the lease's sandbox as snapshot ``name`` (a new name when
        None); its SnapshotInfo as a dict, with the sandbox's spec (``spec``).
        ``for_fork``: the snapshot is deleted with the last sandbox started from it."""
        name = check_snapshot_name(name or "snap-" + uuid.uuid4().hex[:12])
        rec = self._held(lease_id, holder, "snapshot")
        if name in self.state.snapshots or name in self.taking:
            raise ValueError("pool %s already has a snapshot named %r" % (self.state.name, name))
        self.taking.add(name)  # the name is this call's while the provider copies
        try:
            info = await self.provider.snapshot(rec.sandbox_id, name)
        finally:
            self.taking.discard(name)
        self.state.snapshots[name] = info
        if for_fork:
            self.state.fork_snapshots.add(info.image)
        self.state.event(rec, "snapshot", "%s (%d bytes)" % (info.image, info.size_bytes))
        return dict(info.to_dict(), spec=rec.spec.to_dict())

    def snapshot_list(self) -> List[dict]:
        """Every snapshot of the pool, with the sandboxes started from it (``sandboxes``)
        and its warm target (``warm``)."""
        using = collections.Counter(r.spec.image for r in self.state.records.values())
        warm = collections.Counter()
        for spec, count in self.state.config.warm.items():
            warm[spec.image] += count
        return [dict(info.to_dict(), sandboxes=using[info.image], warm=warm[info.image],
                     for_fork=info.image in self.state.fork_snapshots)
                for info in sorted(self.state.snapshots.values(), key=lambda i: i.created_at)]

    def _snapshot_named(self, name_or_image: str) -> SnapshotInfo:
        for info in self.state.snapshots.values():
            if name_or_image in (info.name, info.image):
                return info
        raise ValueError("pool %s has no snapshot %r (it has: %s)"
                         % (self.state.name, name_or_image,
                            ", ".join(sorted(self.state.snapshots)) or "none"))

    async def delete_snapshot(self, name_or_image: str) -> bool:
        """Delete a snapshot (by name or image), its warm target and the idle sandboxes
        started from it; SnapshotInUse while a lease holds one of them."""
        info = self._snapshot_named(name_or_image)
        users = [r for r in self.state.records.values() if r.spec.image == info.image]
        leased = [r.lease.lease_id[:10] + "..." for r in users if r.state is State.LEASED]
        if leased:
            raise SnapshotInUse("pool %s: snapshot %s: leases %s still hold sandboxes started "
                                "from it; release them first"
                                % (self.state.name, info.image, ", ".join(leased)))
        for spec in [s for s in self.state.config.warm if s.image == info.image]:
            del self.state.config.warm[spec]
        for rec in users:
            await self.supply.delete(rec, "its snapshot %s is deleted" % info.name)
        await self.provider.delete_snapshot(info.name)
        self.state.snapshots.pop(info.name, None)
        self.state.fork_snapshots.discard(info.image)
        return True

    def forget_fork_snapshot(self, gone: Sandbox) -> None:
        """After the sandbox ``gone`` is gone: a fork's snapshot whose last sandbox that
        was goes too (in the background)."""
        image = gone.spec.image
        if image not in self.state.fork_snapshots or self.state.closing:
            return
        if any(r.spec.image == image for r in self.state.records.values()) or \
                any(s.image == image for s in self.state.config.warm):
            return
        self.state.fork_snapshots.discard(image)
        info = next((i for i in self.state.snapshots.values() if i.image == image), None)
        if info is not None:
            asyncio.get_running_loop().create_task(self._drop_snapshot(info))

    async def _drop_snapshot(self, info: SnapshotInfo) -> None:
        try:
            await self.provider.delete_snapshot(info.name)
            self.state.snapshots.pop(info.name, None)
        except Exception as exc:  # noqa: BLE001 - kept and listed; the pool's shutdown removes it
            logger.warning("pool %s: the fork snapshot %s was not deleted: %s", self.state.name,
                           info.image, exc)

    async def recover(self) -> None:
        for info in await self.provider.snapshots():
            self.state.snapshots[info.name] = info

    # ---- warm targets
    def set_warm(self, spec, count: int) -> Dict[str, int]:
        """Keep ``count`` READY sandboxes of ``spec`` (an image or a SandboxSpec) from
        now on (0: none); the pool's warm targets, by image."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError("a warm count must be an int >= 0, got %r" % (count,))
        spec = self.state.config.slot(SandboxSpec.of(spec))
        others = sum(n for s, n in self.state.config.warm.items() if s != spec)
        if others + count > self.state.config.max_sandboxes:
            raise ValueError("pool %s: warm targets of %d sandboxes exceed max_sandboxes=%d"
                             % (self.state.name, others + count, self.state.config.max_sandboxes))
        lowered = count < self.state.config.warm.get(spec, 0)
        if count:
            self.state.config.warm[spec] = count
        else:
            self.state.config.warm.pop(spec, None)
        if lowered:  # asked for: the surplus goes now, without lingering
            self.supply.delete_surplus(self.state.wanted(), linger=False)
        self.state.kick()
        warm = collections.Counter()
        for s, n in self.state.config.warm.items():
            warm[s.image] += n
        return dict(warm)

    # ---- pauses
    async def pause(self, lease_id: str, holder: Optional[str], reclaim: bool = False) -> bool:
        rec = self._held(lease_id, holder, "pause")
        if not rec.paused or reclaim:
            if reclaim:
                await self.provider.pause(rec.sandbox_id, reclaim=True)
            else:
                await self.provider.pause(rec.sandbox_id)
            self._mark_paused(rec, True)
        return True

    async def resume(self, lease_id: str, holder: Optional[str]) -> bool:
        rec = self._held(lease_id, holder, "resume")
        if rec.paused:
            await self.provider.resume(rec.sandbox_id)
            self._mark_paused(rec, False)
        return True

    def note_paused(self, lease_id: str, holder: Optional[str], paused: bool) -> Optional[str]:
        """The holder paused or resumed its sandbox through the node's controller
        (``Provider.controller``) itself. None; for a lease that is over (the
        controller takes its token until the sandbox is reset, moments later) or not
        the holder's, why not."""
        try:
            self._mark_paused(self._held(lease_id, holder, "note_paused"), paused)
        except (LeaseEnded, LeaseNotHeld) as exc:
            return str(exc)
        return None

    def _mark_paused(self, rec: Sandbox, paused: bool) -> None:
        if rec.paused != paused:
            rec.paused = paused
            if not paused:
                rec.last_used = self.state.clock.monotonic()  # its idle time starts now
            self.state.event(rec, "paused" if paused else "resumed")
