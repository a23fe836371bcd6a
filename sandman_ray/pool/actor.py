"""The PoolActor: one detached, named actor per pool, around its reconciler.

The actor is the Ray side only: it builds the pool's ``Reconciler``
(``pool/reconciler.py``, the decisions) with the pool's provider, ``RayCluster``
(``pool/cluster.py``, every Ray call) and its metrics, recovers once it starts, runs
the reconcile loop, and forwards the client and host calls. It is an asyncio actor:
every call runs on the one event loop the reconciler owns.
"""

import asyncio
import dataclasses
import logging
from typing import List, Optional

import ray

from sandman_ray.names import NAMESPACE, pool_actor_name
from sandman_ray.pool.cluster import Clock, RayCluster
from sandman_ray.pool.metrics import PoolMetrics
from sandman_ray.pool.reconciler import Reconciler
from sandman_ray.pool.states import pack_lease, unpack_lease_request
from sandman_ray.providers.base import Provider
from sandman_ray.spec import PoolConfig

logger = logging.getLogger(__name__)
STATUS_WAIT_S = 10.0  # for the nodes' image caches in a status

__all__ = ["NAMESPACE", "PoolActor", "pool_actor_name"]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class PoolActor:
    def __init__(self, name: str, config: PoolConfig):
        if not isinstance(config.provider, Provider):
            raise TypeError("pool %s: PoolConfig.provider must be a Provider, got %r"
                            % (name, config.provider))
        config.provider.bind(name, config)
        self.name = name
        self.pool: Optional[Reconciler] = None
        self.config = config
        self.recovered: Optional[asyncio.Future] = None
        self.node = ray.get_runtime_context().get_node_id()

    def __repr__(self) -> str:
        """What the Ray dashboard and Ray's messages call this actor."""
        where = "PoolActor(pool=%s, node=%s, " % (self.name, (self.node or "?")[:12])
        if self.pool is None:
            return where + "starting)"
        state = self.pool.state
        return where + "%d sandboxes, %d leased, %d waiting)" % (
            state.records.held(), state.records.counts().get("leased", 0), len(state.waiters))

    async def _started(self) -> Reconciler:
        """The reconciler, made (in this actor's process and loop) and recovered on the
        first call."""
        if self.recovered is None:
            self.pool = Reconciler(self.name, self.config, self.config.provider, RayCluster(),
                                   Clock(), PoolMetrics(self.name))
            self.pool.state.wake = asyncio.Event()
            self.recovered = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._run())
        await asyncio.shield(self.recovered)
        return self.pool

    async def _run(self) -> None:
        asyncio.get_running_loop().create_task(self._warm_up())
        try:
            await self.pool.upkeep.recover()
        except Exception as exc:  # the pool must still serve; say what was lost
            logger.exception("pool %s: recovery failed: %s", self.name, exc)
        self.recovered.set_result(None)
        await self.pool.run()

    async def _warm_up(self) -> None:
        """The provider's agents start with the pool, not at its first create."""
        try:
            await self.config.provider.warm_up()
        except Exception:  # noqa: BLE001 - the creates will say what is wrong
            logger.exception("pool %s: the provider did not warm up", self.name)

    async def start(self) -> str:
        await self._started()
        return self.name

    # ---- client and host calls
    # ACQUIRE_EVENTS: an acquire is recorded as a Ray task event (the dashboard lists it
    # as sandman:acquire:<pool>); the calls that follow each lease (release, touches,
    # a host asking why its lease ended) are not: they would crowd the GCS's table of
    # task events, and the record costs the pool's process memory.
    async def lease(self, spec, client: Optional[str] = None, timeout_s: float = 60.0,
                    holder: Optional[str] = None, holder_node: Optional[str] = None,
                    lease_id: Optional[str] = None, node: Optional[str] = None,
                    keepalive_s: Optional[float] = None, weight: Optional[float] = None):
        """A Lease (``Lending.lease``). ``spec`` alone as bytes: the whole request
        packed (``pack_lease_request``), and the lease packed in the answer: the
        acquire's path (each argument Ray serializes costs a call ~0.3 ms here)."""
        pool = await self._started()
        if isinstance(spec, bytes):
            lease = await pool.lending.lease(*unpack_lease_request(spec))
        else:
            lease = await pool.lending.lease(spec, client, timeout_s, holder, holder_node,
                                             lease_id, node, keepalive_s, weight)
        controller = pool.provider.controller(lease.node_id)
        if pool.config.pause_between_steps or controller:
            lease = dataclasses.replace(lease, controller=controller,
                                        pause_between_steps=pool.config.pause_between_steps)
        return pack_lease(lease) if isinstance(spec, bytes) else lease

    async def cancel(self, lease_id: str, holder: Optional[str] = None) -> bool:
        return (await self._started()).lending.cancel(lease_id, holder)

    async def register(self, lease_id: str, holder: str) -> bool:
        return (await self._started()).lending.register(lease_id, holder)

    @ray.method(enable_task_events=False)  # one or more per lease: see ACQUIRE_EVENTS
    async def touch(self, lease_id: str, holder: Optional[str] = None) -> bool:
        return (await self._started()).lending.touch(lease_id, holder)

    @ray.method(enable_task_events=False)  # one or more per lease: see ACQUIRE_EVENTS
    async def touch_many(self, leases: list) -> int:
        """``touch`` for each (lease id, holder) in ``leases`` (sandman_ray.touches: a
        process's round); how many were leases of this pool held by their holder."""
        return (await self._started()).lending.touch_many(leases)

    @ray.method(enable_task_events=False)  # one or more per lease: see ACQUIRE_EVENTS
    async def keep_many(self, leases: list) -> int:
        """Keep each (lease id, holder) of ``leases`` alive (``Lending.keep_many``);
        how many were."""
        return (await self._started()).lending.keep_many(leases)

    @ray.method(enable_task_events=False)  # one or more per lease: see ACQUIRE_EVENTS
    async def release(self, lease_id, holder: Optional[str] = None) -> bool:
        """End the lease; ``lease_id`` as bytes: ``lease id NUL holder`` in one."""
        if isinstance(lease_id, bytes):
            lease_id, _, named = lease_id.decode().partition("\0")
            holder = named or None
        return (await self._started()).lending.release(lease_id, holder)

    async def host_restarted(self, holder: str) -> int:
        return (await self._started()).lending.host_restarted(holder)

    async def held_by(self, holder: str) -> list:
        """The leases the host ``holder`` holds (the service, started again under its
        name, adopts its tenants' leases)."""
        pool = await self._started()
        return [rec.lease for rec in pool.state.records.held_by(holder) if rec.lease is not None]

    @ray.method(enable_task_events=False)  # one or more per lease: see ACQUIRE_EVENTS
    async def why_ended(self, lease_id: str) -> Optional[str]:
        """Why ``lease_id`` ended, if this pool ended it (a host asks when its sandbox
        stops answering: the pool's word may still be on its way); None otherwise."""
        return (await self._started()).state.ended.get(lease_id)

    # ---- snapshots, warm targets, pauses (pool/snapshots.py)
    async def snapshot(self, lease_id: str, holder: Optional[str], name: Optional[str] = None,
                       for_fork: bool = False) -> dict:
        return await (await self._started()).snapshot_ops.snapshot(lease_id, holder, name, for_fork)

    async def snapshots(self) -> List[dict]:
        return (await self._started()).snapshot_ops.snapshot_list()

    async def delete_snapshot(self, name_or_image: str) -> bool:
        return await (await self._started()).snapshot_ops.delete_snapshot(name_or_image)

    async def prefetch(self, images: List[str], nodes: Optional[List[str]] = None) -> List[dict]:
        from sandman_ray.pool.prefetch import prefetch
        return await prefetch(await self._started(), images, nodes)

    async def set_warm(self, spec, count: int) -> dict:
        return (await self._started()).snapshot_ops.set_warm(spec, count)

    async def pause(self, lease_id: str, holder: Optional[str], reclaim: bool = False) -> bool:
        return await (await self._started()).snapshot_ops.pause(lease_id, holder, reclaim)

    async def resume(self, lease_id: str, holder: Optional[str]) -> bool:
        return await (await self._started()).snapshot_ops.resume(lease_id, holder)

    async def note_paused(self, lease_id: str, holder: Optional[str],
                          paused: bool) -> Optional[str]:
        return (await self._started()).snapshot_ops.note_paused(lease_id, holder, paused)

    # ---- questions and operations
    async def status(self, images: bool = False) -> dict:
        """The pool's states, counters and rates; with ``images``, each node's image
        cache too (``image_cache``: a call to each node's agent)."""
        pool = await self._started()
        status = pool.status()
        if not images:
            return status
        try:  # the nodes' image caches, where the provider keeps them
            caches = await asyncio.wait_for(pool.provider.image_cache(), STATUS_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - the pool's own status still answers
            logger.warning("pool %s: image caches not read: %s", self.name, exc)
            caches = None
        if caches is not None:
            status["image_cache"] = caches
        return status

    async def list_sandboxes(self) -> List[dict]:
        return (await self._started()).sandboxes()

    async def recent_events(self, limit: int = 100) -> List[tuple]:
        """The last ``limit`` transitions: (wall time, sandbox id, state, reason)."""
        events = (await self._started()).state.events
        return list(events)[-limit:] if limit > 0 else []

    async def gc(self, dry_run: bool = True) -> List[dict]:
        return await (await self._started()).upkeep.gc(dry_run)

    async def shutdown(self) -> int:
        return await (await self._started()).shutdown()
