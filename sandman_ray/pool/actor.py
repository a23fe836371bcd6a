"""The PoolActor: one detached, named actor per pool, a reconciler.

Each tick compares what is wanted (waiters + warm targets per spec) with what exists
and takes the next step: lend READY sandboxes to waiters (clients in turn), start
creates (paced by an adaptive token bucket and a cap on starts in flight), reset or
delete released sandboxes, delete surplus. State transitions happen only through
``Sandbox.to``; side effects only through the provider.

The watchdog sweeps every ``sweep_interval_s``: a lease whose handle host (the client's
actor that registered it) is gone (one ``list_named_actors`` call per sweep, never a
reference to the actor, which would keep it alive), that no host registered within the
grace, or that outlived its TTL or idle timeout, is reclaimed. Sandboxes on a Ray node that has died went with it:
the pool checks the nodes every ``NODE_CHECK_S``, forgets those sandboxes (ending their
leases) and creates their warm capacity again on the nodes that are left.

Leases are written to Ray's GCS key-value store, so a restarted PoolActor rebuilds its
state from the provider's labelled inventory and those records: live leases go on, the
rest is reclaimed, nothing is leased twice.
"""

import asyncio
import collections
import json
import logging
import os
import random
import time
import uuid
from typing import Deque, Dict, List, Optional

import ray

from sandman_ray.errors import AcquireTimeout, LeaseNotHeld, ProviderError
from sandman_ray.pool.metrics import PoolMetrics
from sandman_ray.pool.pacing import AdaptiveTokenBucket
from sandman_ray.pool.states import COMING, EndedLeases, Lease, Sandbox, State, counts
from sandman_ray.pool.waiters import FairQueue, Waiter
from sandman_ray.providers.base import POOL_LABEL
from sandman_ray.spec import PoolConfig, SandboxSpec

logger = logging.getLogger(__name__)

NAMESPACE = "sandman"
KV_NAMESPACE = "sandman"
TICK_S = 0.05          # reconcile at least this often while anything is pending
TICK_PER_RECORD_S = 2e-6  # how long events gather per record before a tick (large pools)
CREATE_ATTEMPTS = 3    # transient failures of one create before it counts as failed
EVENT_LOG = 5000       # transitions kept for ``events``
# A READY sandbox beyond the warm target is deleted only after lingering this long: in
# a loop of acquire/release it is taken again first, instead of one create and one
# delete per episode (each ~60 ms of CPU here).
SURPLUS_LINGER_S = 10.0
# How often the pool compares the provider's inventory with its records: a create that
# finished after this actor restarted (its request died with the old process) leaves a
# sandbox no record knows, which is deleted.
INVENTORY_INTERVAL_S = 5.0
NODE_CHECK_S = 1.0     # how often the pool asks the GCS which Ray nodes are alive


def pool_actor_name(pool: str) -> str:
    return "sandman:pool:%s" % pool


def handle_name_prefix() -> str:
    return "sandman:sbx:"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class PoolActor:
    def __init__(self, name: str, config: PoolConfig):
        from sandman_ray.providers.local import LocalProvider
        self.name = name
        self.config = config
        self.provider = config.provider if config.provider is not None else LocalProvider()
        if hasattr(self.provider, "bind"):
            self.provider.bind(name)
        self.records: Dict[str, Sandbox] = {}
        self.closing = False               # shutdown began
        self.leases: Dict[str, str] = {}   # lease id -> sandbox id
        self.waiters = FairQueue()
        self.bucket = AdaptiveTokenBucket(config.create_rate_per_s, config.create_burst)
        self.events: Deque[tuple] = collections.deque(maxlen=EVENT_LOG)
        self.metrics: Optional[PoolMetrics] = None  # made in this actor's process
        self.stats = {"creates": 0, "create_failures": 0, "deletes": 0, "resets": 0,
                      "throttled": 0, "reclaimed": 0, "leases": 0, "lost": 0}
        self.create_starts: List[float] = []  # wall clock of each provider create call
        self.last_lent: Dict[SandboxSpec, float] = {}
        self.kv_thread = None
        self.host_thread = None  # tells hosts of leases the pool ended
        self.ended = EndedLeases()  # for hosts that ask why_ended
        self.wake: Optional[asyncio.Event] = None
        self.started = False
        self.recovered: Optional[asyncio.Future] = None

    # ------------------------------------------------------------------ lifecycle
    async def _ensure_started(self) -> None:
        if not self.started:
            self.started = True
            self.metrics = PoolMetrics(self.name)
            self.wake = asyncio.Event()
            self.recovered = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._run())
        await asyncio.shield(self.recovered)

    async def start(self) -> str:
        await self._ensure_started()
        return self.name

    async def _run(self) -> None:
        try:
            await self._recover()
        except Exception as exc:  # the pool must still serve; say what was lost
            logger.exception("pool %s: recovery failed: %s", self.name, exc)
        self.recovered.set_result(None)
        next_sweep = 0.0
        next_inventory = time.monotonic() + INVENTORY_INTERVAL_S
        next_node_check = 0.0
        while True:
            try:
                self._tick()
                if self.metrics.due():
                    self.metrics.refresh(counts(self.records), len(self.waiters),
                                         self.bucket.rate, self._leases_per_client())
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.config.sweep_interval_s
                    await self._sweep()
                if time.monotonic() >= next_node_check:
                    next_node_check = time.monotonic() + NODE_CHECK_S
                    await self._drop_dead_nodes()
                if time.monotonic() >= next_inventory:
                    next_inventory = time.monotonic() + INVENTORY_INTERVAL_S
                    await self._delete_strays()
            except Exception:
                logger.exception("pool %s: reconcile failed", self.name)
            try:
                await asyncio.wait_for(self.wake.wait(), TICK_S if self._busy() else
                                       self.config.sweep_interval_s)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            # A tick walks every record. With thousands of them, let the events of a
            # moment gather into one tick rather than tick once per event (at 10,000
            # records the pool otherwise kept a core 91 % busy); small pools tick at once.
            gather_s = len(self.records) * TICK_PER_RECORD_S
            if gather_s >= 0.001:
                await asyncio.sleep(min(gather_s, 0.05))

    def _leases_per_client(self) -> Dict[str, int]:
        per_client: Dict[str, int] = {}
        for rec in self.records.values():
            if rec.state is State.LEASED:
                per_client[rec.client] = per_client.get(rec.client, 0) + 1
        return per_client

    def _kick(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def _busy(self) -> bool:
        return bool(len(self.waiters)) or any(
            r.state in (State.REQUESTED, State.RELEASING) for r in self.records.values())

    # ------------------------------------------------------------------ client calls
    async def lease(self, spec: SandboxSpec, client: str, timeout_s: float,
                    handle: Optional[str] = None) -> Lease:
        """A READY sandbox for ``spec``, lent to ``client``, within ``timeout_s``. The
        client library's handle host registers the lease once it holds it. A caller
        without such an actor may name ``handle``, an actor whose liveness is then
        watched from the moment the lease is lent."""
        await self._ensure_started()
        spec = self.config.limited(SandboxSpec.of(spec))
        loop = asyncio.get_running_loop()
        # the lease id is a bearer secret (128 bits): listings never show it
        waiter = Waiter(client, spec, loop.create_future(), "L-" + uuid.uuid4().hex,
                        time.monotonic() + timeout_s, time.monotonic(), handle)
        self.waiters.push(waiter)
        self._lend()  # a warm sandbox is lent at once, without waiting for a tick
        if waiter.future.done():
            self._kick()  # the warm set may need a refill
            return waiter.future.result()
        self._kick()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            self.waiters.remove(waiter)
            if waiter.future.done() and not waiter.future.exception():
                return waiter.future.result()  # lent as the timeout fired: keep it
            raise AcquireTimeout("pool %s: no %s sandbox within %.1f s (%s)"
                                 % (self.name, spec.image, timeout_s, self._summary()))
        except asyncio.CancelledError:
            # the caller went away: a sandbox lent meanwhile is reclaimed by the grace
            self.waiters.remove(waiter)
            raise

    async def register(self, lease_id: str, handle: str) -> bool:
        """The handle actor ``handle`` now holds ``lease_id``. False: the lease is over.
        A lease that another host registered is not taken over (LeaseNotHeld)."""
        await self._ensure_started()
        rec = self._leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, handle, "register")
        rec.handle, rec.handle_seen = handle, True
        rec.registered_at = time.monotonic()
        rec.last_used = time.monotonic()
        self._persist(rec)
        return True

    async def touch(self, lease_id: str, handle: Optional[str] = None) -> bool:
        """The lease is in use (its idle timeout starts again)."""
        rec = self._leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, handle, "touch")
        rec.last_used = time.monotonic()
        return True

    async def handle_restarted(self, handle: str) -> int:
        """Ray restarted the handle actor ``handle`` after its process or node died: the
        new one holds nothing, so the leases of the old one end. Returns how many."""
        await self._ensure_started()
        held = [r for r in self.records.values()
                if r.state is State.LEASED and r.handle == handle]
        for rec in held:
            self.stats["reclaimed"] += 1
            self._end_lease(rec, "reclaimed: handle %s was restarted" % handle)
        return len(held)

    async def release(self, lease_id: str, handle: Optional[str] = None) -> bool:
        """End the lease. Once a host registered it, only that host (``handle``, its
        name) may; before, whoever has the lease id (the acquire that got it)."""
        await self._ensure_started()
        rec = self._leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, handle, "release")
        self._end_lease(rec, "released by its holder", tell_host=False)
        return True

    async def why_ended(self, lease_id: str) -> Optional[str]:
        """Why ``lease_id`` ended, if this pool ended it (a host asks when its sandbox
        stops answering: the pool's word may still be on its way); None otherwise."""
        return self.ended.get(lease_id)

    def _check_holder(self, rec: Sandbox, handle: Optional[str], op: str) -> None:
        if rec.registered_at and handle != rec.handle:
            raise LeaseNotHeld("pool %s: %s of the lease on %s refused: it is held by %s, "
                               "not by %s" % (self.name, op, rec.sandbox_id, rec.handle,
                                              handle or "a caller without a handle host"))

    async def status(self) -> dict:
        await self._ensure_started()
        now = time.monotonic()
        leased = [r for r in self.records.values() if r.state is State.LEASED]
        return {"pool": self.name, "pid": os.getpid(), "states": counts(self.records),
                "waiters": len(self.waiters),
                "create_rate_per_s": self.bucket.rate, "stats": dict(self.stats),
                "oldest_lease_s": max((now - r.leased_at for r in leased), default=0.0),
                "leases_per_client": self._leases_per_client(),
                "create_starts": list(self.create_starts[-1000:])}

    async def list_sandboxes(self) -> List[dict]:
        now = time.monotonic()
        return [{"sandbox_id": r.sandbox_id, "state": r.state.value, "image": r.spec.image,
                 "node_id": getattr(r.info, "node_id", None), "client": r.client,
                 "handle": r.handle, "age_s": now - r.since, "leased": r.lease is not None}
                for r in self.records.values()]

    async def recent_events(self, limit: int = 100) -> List[tuple]:
        """The last ``limit`` transitions: (wall time, sandbox id, state, reason)."""
        return list(self.events)[-limit:] if limit > 0 else []

    async def gc(self, dry_run: bool = True) -> List[dict]:
        """Sandboxes that no live handle holds: leases whose handle actor is gone (or
        never came within the grace) and sandboxes of this pool that the provider has
        but no record knows. Deleted unless ``dry_run``; returned either way. The
        watchdog finds the first kind too, every ``sweep_interval_s``: this is for an
        operator who will not wait, or a pool whose watchdog is slowed down."""
        await self._ensure_started()
        names = await asyncio.get_running_loop().run_in_executor(None, _live_handle_names)
        now = time.monotonic()
        found = []
        for rec in [r for r in self.records.values() if r.state is State.LEASED]:
            why = self._orphaned(rec, names, now)
            if why:
                found.append({"sandbox_id": rec.sandbox_id, "state": rec.state.value,
                              "client": rec.client, "why": why})
                if not dry_run:
                    await self._delete(rec, "gc: %s" % why)
        for info in await self._strays():
            found.append({"sandbox_id": info.sandbox_id, "state": "unknown", "client": None,
                          "why": "no record of this pool knows it"})
            if not dry_run:
                await self._delete_stray(info)
        return found

    async def shutdown(self) -> int:
        """Delete every sandbox of the pool (leases end); returns how many."""
        await self._ensure_started()
        self.closing = True  # no create starts from here on
        for waiter in list(self.waiters.waiting()):
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout("pool %s is shutting down" % self.name))
        recs = list(self.records.values())
        await asyncio.gather(*(self._delete(r, "pool shutdown") for r in recs),
                             return_exceptions=True)
        if hasattr(self.provider, "shutdown"):
            await self.provider.shutdown()
        return len(recs)

    # ------------------------------------------------------------------ reconcile
    def _tick(self) -> None:
        now = time.monotonic()
        self._expire_waiters(now)
        self._lend()
        self._release_ended()
        self._create_missing()
        self._delete_surplus()

    def _expire_waiters(self, now: float) -> None:
        for waiter in list(self.waiters.waiting()):
            if waiter.future.done() or waiter.deadline < now:
                self.waiters.remove(waiter)

    def _held_by(self, client: str) -> int:
        return sum(1 for r in self.records.values() if r.state is State.LEASED and r.client == client)

    def _allowed(self, client: str) -> bool:
        quota = self.config.client_quota
        return quota is None or self._held_by(client) < quota

    def _lend(self) -> None:
        ready: Dict[SandboxSpec, List[Sandbox]] = {}
        for rec in self.records.values():
            if rec.state is State.READY:
                ready.setdefault(rec.spec, []).append(rec)
        for spec, recs in ready.items():
            recs.sort(key=lambda r: r.since)
            while recs:
                waiter = self.waiters.next_for(spec, self._allowed)
                if waiter is None:
                    break
                rec = recs.pop(0)
                lease = Lease(waiter.lease_id, rec.sandbox_id, rec.info.address, rec.info.token,
                              rec.info.node_id, self.name)
                rec.lease, rec.client, rec.handle = lease, waiter.client, waiter.handle
                rec.handle_seen, rec.registered_at = False, 0.0
                rec.leased_at = rec.last_used = time.monotonic()
                self._to(rec, State.LEASED, "lent to %s" % waiter.client)
                self.leases[lease.lease_id] = rec.sandbox_id
                self.last_lent[spec] = time.monotonic()
                self.stats["leases"] += 1
                self.metrics.lent(time.monotonic() - waiter.enqueued)
                self._persist(rec)
                waiter.future.set_result(lease)

    def _wanted(self) -> Dict[SandboxSpec, int]:
        wanted: Dict[SandboxSpec, int] = dict(self.config.warm)
        for waiter in self.waiters.waiting():
            if not waiter.future.done() and self._allowed(waiter.client):
                wanted[waiter.spec] = wanted.get(waiter.spec, 0) + 1
        return wanted

    def _create_missing(self) -> None:
        if self.closing:
            return
        have: Dict[SandboxSpec, int] = {}
        for rec in self.records.values():
            if rec.state is State.READY or rec.state in COMING:
                have[rec.spec] = have.get(rec.spec, 0) + 1
        held = sum(1 for r in self.records.values() if r.state is not State.GONE)
        starting = sum(1 for r in self.records.values()
                       if r.state in (State.CREATING, State.STARTING))
        for spec, count in self._wanted().items():
            for _ in range(count - have.get(spec, 0)):
                if held >= self.config.max_sandboxes or starting >= self.config.max_starting:
                    return
                if not self.bucket.take():
                    asyncio.get_running_loop().call_later(self.bucket.wait_s(), self._kick)
                    return
                rec = Sandbox("sbx-" + uuid.uuid4().hex[:12], spec)
                self.records[rec.sandbox_id] = rec
                self._event(rec, "requested")
                held += 1
                starting += 1
                asyncio.get_running_loop().create_task(self._create(rec))

    def _delete_surplus(self) -> None:
        wanted = self._wanted()
        now = time.monotonic()
        ready: Dict[SandboxSpec, List[Sandbox]] = {}
        for rec in self.records.values():
            if rec.state is State.READY:
                ready.setdefault(rec.spec, []).append(rec)
        for spec, recs in ready.items():
            coming = sum(1 for r in self.records.values() if r.spec == spec and r.state in COMING)
            extra = len(recs) + coming - wanted.get(spec, 0)
            lingering = [r for r in recs if now - r.since > SURPLUS_LINGER_S]
            for rec in sorted(lingering, key=lambda r: r.since)[:max(0, extra)]:
                self._delete_soon(rec, "surplus")

    def _release_ended(self) -> None:
        wanted = self._wanted()
        have: Dict[SandboxSpec, int] = {}
        for rec in self.records.values():
            if rec.state is State.READY or rec.state in COMING:
                have[rec.spec] = have.get(rec.spec, 0) + 1
        for rec in list(self.records.values()):
            if rec.state is not State.RELEASING:
                continue
            # reset it while its spec is wanted or in use (another episode is likely to
            # follow); what turns out surplus is deleted after lingering
            recently = time.monotonic() - self.last_lent.get(rec.spec, -1e9) < SURPLUS_LINGER_S
            keep = (self.config.reuse == "reset" and self.provider.supports_reset
                    and (recently or have.get(rec.spec, 0) < wanted.get(rec.spec, 0)))
            if keep:
                have[rec.spec] = have.get(rec.spec, 0) + 1
                self._to(rec, State.RESETTING)
                asyncio.get_running_loop().create_task(self._reset(rec))
            else:
                self._delete_soon(rec, "released")

    # ------------------------------------------------------------------ side effects
    async def _create(self, rec: Sandbox) -> None:
        labels = {POOL_LABEL: self.name}
        self._to(rec, State.CREATING)
        started = time.monotonic()
        while True:
            rec.attempts += 1
            self.create_starts.append(time.time())
            del self.create_starts[:-5000]
            try:
                rec.info = await asyncio.wait_for(
                    self.provider.create(rec.sandbox_id, rec.spec, labels),
                    self.config.ready_timeout_s)
                if rec.state is not State.CREATING:  # deleted meanwhile (pool shutdown)
                    await self._provider_delete(rec.sandbox_id)
                    return
                self._to(rec, State.STARTING)
                await asyncio.wait_for(self.provider.probe(rec.info), self.config.ready_timeout_s)
                if rec.state is not State.STARTING:
                    return
                break
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = ProviderError("not ready within %.0f s" % self.config.ready_timeout_s,
                                        "transient")
                elif not isinstance(exc, ProviderError):  # a bug, not the cluster's weather
                    logger.exception("pool %s: create %s failed", self.name, rec.sandbox_id)
                    exc = ProviderError("%s: %s" % (type(exc).__name__, exc), "fatal")
                kind = exc.kind
                self.metrics.create_failed(kind)
                if kind == "throttled":
                    self.stats["throttled"] += 1
                    rec.attempts -= 1  # the cluster said "later", not "no": not a failure
                if kind in ("throttled", "transient"):
                    self.bucket.back_off()
                if rec.state not in (State.CREATING, State.STARTING):
                    return  # deleted meanwhile: nothing left to do
                if kind == "fatal" or rec.attempts >= CREATE_ATTEMPTS:
                    self.stats["create_failures"] += 1
                    self._fail_waiters(rec.spec, exc)
                    await self._delete(rec, "create failed: %s" % exc)
                    return
                if rec.state is State.STARTING:
                    await self._provider_delete(rec.sandbox_id)
                    self._to(rec, State.CREATING, "retry: %s" % exc)
                # back off with jitter; the token bucket slows everyone else down too
                await asyncio.sleep(min(5.0, 0.2 * 2 ** rec.attempts) * random.uniform(0.5, 1.5))
        self.bucket.succeeded()
        self.stats["creates"] += 1
        self.metrics.created(time.monotonic() - started)
        self._to(rec, State.READY, "answers after %.2f s" % (time.monotonic() - started))
        self._kick()

    def _fail_waiters(self, spec: SandboxSpec, exc: Exception) -> None:
        """A create failed for good: a fatal error (a bad image) fails the waiters for that
        spec at once, with the reason, rather than letting them time out."""
        if getattr(exc, "kind", "") != "fatal":
            return
        for waiter in list(self.waiters.waiting()):
            if waiter.spec == spec and not waiter.future.done():
                waiter.future.set_exception(ProviderError(str(exc), "fatal"))

    async def _reset(self, rec: Sandbox) -> None:
        try:
            rec.info = await asyncio.wait_for(self.provider.reset(rec.sandbox_id),
                                              self.config.ready_timeout_s)
            await asyncio.wait_for(self.provider.probe(rec.info), self.config.ready_timeout_s)
        except Exception as exc:
            if rec.state is State.RESETTING:
                await self._delete(rec, "reset failed: %s" % exc)
            return
        if rec.state is not State.RESETTING:
            return
        self.stats["resets"] += 1
        self.metrics.reset_done()
        self._to(rec, State.READY, "reset")
        self._kick()

    def _begin_delete(self, rec: Sandbox, reason: str) -> bool:
        """The state side of a delete, at once (so no tick can lend the sandbox while
        the provider deletes it). False if it is already being deleted."""
        if rec.state in (State.DELETING, State.GONE):
            return False
        if rec.state is State.LEASED:
            self._end_lease(rec, reason, reuse=False)
        if rec.state not in (State.READY, State.RELEASING, State.FAILED):
            self._to(rec, State.FAILED, reason)
        self._to(rec, State.DELETING, reason)
        return True

    def _delete_soon(self, rec: Sandbox, reason: str) -> None:
        if self._begin_delete(rec, reason):
            asyncio.get_running_loop().create_task(self._finish_delete(rec, reason))

    async def _delete(self, rec: Sandbox, reason: str) -> None:
        if self._begin_delete(rec, reason):
            await self._finish_delete(rec, reason)

    async def _finish_delete(self, rec: Sandbox, reason: str) -> None:
        await self._provider_delete(rec.sandbox_id)
        self.stats["deletes"] += 1
        self.metrics.deleted(reason)
        self._to(rec, State.GONE, reason)
        self.records.pop(rec.sandbox_id, None)
        self._kick()

    async def _provider_delete(self, sandbox_id: str) -> None:
        for attempt in range(5):
            try:
                await self.provider.delete(sandbox_id)
                return
            except Exception as exc:  # a delete must not be forgotten: retry, then say so
                logger.warning("pool %s: delete %s failed (%s), retrying", self.name,
                               sandbox_id, exc)
                await asyncio.sleep(0.2 * 2 ** attempt)
        logger.error("pool %s: could not delete %s", self.name, sandbox_id)

    def _end_lease(self, rec: Sandbox, reason: str, reuse: bool = True,
                   tell_host: bool = True) -> None:
        """End the lease of ``rec`` for ``reason``; its host (when one registered it and
        did not end it itself) is told, and stops forwarding its calls."""
        if rec.lease is not None:
            self.leases.pop(rec.lease.lease_id, None)
            self.ended.note(rec.lease.lease_id, reason)
            self._forget(rec)
            if tell_host and rec.handle is not None:
                self._tell_host(rec.handle, rec.lease.lease_id, reason)
        rec.lease, rec.client, rec.handle = None, None, None
        if reuse:
            self._to(rec, State.RELEASING, reason)
        self._kick()

    def _leased(self, lease_id: str) -> Optional[Sandbox]:
        rec = self.records.get(self.leases.get(lease_id, ""))
        return rec if rec is not None and rec.state is State.LEASED else None

    def _to(self, rec: Sandbox, state: State, reason: str = "") -> None:
        rec.to(state)
        self._event(rec, state.value, reason)

    def _event(self, rec: Sandbox, what: str, reason: str = "") -> None:
        self.events.append((time.time(), rec.sandbox_id, what, reason))

    def _summary(self) -> str:
        c = counts(self.records)
        return ", ".join("%s %d" % (k, v) for k, v in c.items() if v) or "no sandboxes"

    # ------------------------------------------------------------------ watchdog
    async def _sweep(self) -> None:
        leased = [r for r in self.records.values() if r.state is State.LEASED]
        if not leased:
            return
        taken = time.monotonic()
        names = await asyncio.get_running_loop().run_in_executor(None, _live_handle_names)
        now = time.monotonic()
        for rec in leased:
            if rec.state is not State.LEASED or rec.registered_at >= taken:
                continue  # ended meanwhile, or registered by a host the list may predate
            why = self._orphaned(rec, names, now) or self._expired(rec, now)
            if why:
                self.stats["reclaimed"] += 1
                self._end_lease(rec, "reclaimed: " + why)

    async def _drop_dead_nodes(self) -> None:
        """Forget the sandboxes on Ray nodes that have died (with them): their holders
        get SandboxLost from their handles, and warm capacity is created elsewhere."""
        placed = {rec.info.node_id for rec in self.records.values()
                  if rec.info is not None and rec.info.node_id}
        if not placed:
            return
        dead = placed - await asyncio.get_running_loop().run_in_executor(None, _alive_nodes)
        for rec in list(self.records.values()):
            node = rec.info.node_id if rec.info is not None else None
            if node in dead and rec.state not in (State.DELETING, State.GONE):
                self.stats["lost"] += 1
                self._delete_soon(rec, "lost: Ray node %s died" % node[:12])

    def _orphaned(self, rec: Sandbox, names: set, now: float) -> Optional[str]:
        """Why no live handle holds the leased ``rec`` (None: one does, or its handle
        may still be starting). ``names``: the live handle actors' names."""
        alive = rec.handle is not None and rec.handle in names
        rec.handle_seen = rec.handle_seen or alive
        if not alive and rec.handle_seen:
            return "handle %s is gone" % rec.handle
        if not alive and now - rec.leased_at > self.config.lease_grace_s:
            return "no handle within %.0f s" % self.config.lease_grace_s
        return None

    def _expired(self, rec: Sandbox, now: float) -> Optional[str]:
        """Why the lease of ``rec`` is over by its TTL or idle timeout (None: it is not)."""
        ttl = rec.spec.ttl_s or self.config.sandbox_ttl_s  # the spec's, else the pool's
        idle = rec.spec.idle_timeout_s or self.config.idle_timeout_s
        if ttl and now - rec.leased_at > ttl:
            return "the lease outlived its TTL of %g s" % ttl
        if idle and now - rec.last_used > idle:
            return "the lease was idle for %g s" % idle
        return None

    async def _strays(self) -> list:
        """Sandboxes of this pool that the provider has and no record knows."""
        return [info for info in await self.provider.list({POOL_LABEL: self.name})
                if info.sandbox_id not in self.records]

    async def _delete_stray(self, info) -> None:
        logger.warning("pool %s: deleting %s, which no record knows", self.name,
                       info.sandbox_id)
        self.stats["deletes"] += 1
        self.metrics.deleted("stray")
        await self._provider_delete(info.sandbox_id)

    async def _delete_strays(self) -> None:
        for info in await self._strays():
            await self._delete_stray(info)

    def _tell_host(self, host: str, lease_id: str, reason: str) -> None:
        """Tell the handle host named ``host`` that ``lease_id`` ended, off the event
        loop (a name lookup is a GCS call). The host is looked up by name and its
        handle dropped at once: the pool never keeps a host alive."""
        if self.host_thread is None:
            from concurrent.futures import ThreadPoolExecutor
            self.host_thread = ThreadPoolExecutor(1, thread_name_prefix="sandman-hosts")
        self.host_thread.submit(_tell_host, host, lease_id, "%s (pool %s)" % (reason, self.name))

    # ------------------------------------------------------------------ persistence
    def _kv_key(self, sandbox_id: str) -> str:
        return "pool:%s:lease:%s" % (self.name, sandbox_id)

    def _kv(self, fn, *args) -> None:
        """A GCS key-value call, off the event loop (each is a network round trip), in
        order (one thread)."""
        if self.kv_thread is None:
            from concurrent.futures import ThreadPoolExecutor
            self.kv_thread = ThreadPoolExecutor(1, thread_name_prefix="sandman-kv")
        self.kv_thread.submit(fn, *args, namespace=KV_NAMESPACE)

    def _persist(self, rec: Sandbox) -> None:
        from ray.experimental import internal_kv
        lease = rec.lease
        self._kv(internal_kv._internal_kv_put, self._kv_key(rec.sandbox_id), json.dumps({
            "lease_id": lease.lease_id, "client": rec.client, "handle": rec.handle,
            "leased_wall": time.time() - (time.monotonic() - rec.leased_at)}))

    def _forget(self, rec: Sandbox) -> None:
        from ray.experimental import internal_kv
        self._kv(internal_kv._internal_kv_del, self._kv_key(rec.sandbox_id))

    async def _recover(self) -> None:
        """After a restart: adopt the provider's sandboxes of this pool; leases whose
        handle lives on (or may still register) continue, the rest is released."""
        from ray.experimental import internal_kv
        infos = await self.provider.list({POOL_LABEL: self.name})
        if not infos:
            return
        names = await asyncio.get_running_loop().run_in_executor(None, _live_handle_names)
        now_wall, now = time.time(), time.monotonic()
        for info in infos:
            if (info.details or {}).get("alive") is False:
                await self.provider.delete(info.sandbox_id)  # died while we were down
                continue
            spec = _spec_of(info)
            rec = Sandbox(info.sandbox_id, spec, info=info)
            raw = internal_kv._internal_kv_get(self._kv_key(info.sandbox_id), namespace=KV_NAMESPACE)
            record = json.loads(raw) if raw else None
            # Without a lease record it may still have served a lease whose record was
            # being written when the old pool died: it starts afresh (a new token)
            # before anyone else is lent it.
            rec.state = State.RELEASING
            self.records[rec.sandbox_id] = rec
            if record is not None:
                age = now_wall - record["leased_wall"]
                alive = record["handle"] in names if record["handle"] else \
                    age < self.config.lease_grace_s
                rec.lease = Lease(record["lease_id"], info.sandbox_id, info.address, info.token,
                                  info.node_id, self.name)
                rec.client, rec.handle = record["client"], record["handle"]
                rec.leased_at = rec.last_used = now - age
                rec.state = State.LEASED
                self.leases[rec.lease.lease_id] = rec.sandbox_id
                if not alive:
                    self._end_lease(rec, "recovered without a live handle")
            self._event(rec, "recovered as %s" % rec.state.value)
        logger.info("pool %s: recovered %d sandboxes", self.name, len(infos))


def _spec_of(info) -> SandboxSpec:
    """The spec a sandbox was created from, as its provider reports it."""
    spec = (info.details or {}).get("spec")
    if isinstance(spec, SandboxSpec):
        return spec
    return SandboxSpec(image=(info.details or {}).get("image", "host"))


def _tell_host(host: str, lease_id: str, reason: str) -> None:
    try:
        actor = ray.get_actor(host, namespace=NAMESPACE)
    except ValueError:  # gone: nothing holds the lease any more
        return
    try:
        actor.lease_ended.remote(lease_id, reason)
    except Exception:  # noqa: BLE001 - a host that died meanwhile holds nothing
        logger.debug("host %s could not be told that %s ended", host, lease_id)


def _alive_nodes() -> set:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _live_handle_names() -> set:
    prefix = handle_name_prefix()
    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith(prefix)}
