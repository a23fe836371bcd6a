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

The watchdog and a restarted pool's recovery are in ``sandman_ray.pool.upkeep``; the
snapshots, warm targets and paused leases in ``sandman_ray.pool.snapshots``.
"""

import asyncio
import collections
import itertools
import logging
import os
import random
import uuid
from typing import Deque, Dict, List, Optional

from sandman_ray.errors import AcquireTimeout, LeaseNotHeld, ProviderError
from sandman_ray.pool.pacing import AdaptiveTokenBucket
from sandman_ray.pool.records import Records
from sandman_ray.pool.snapshots import SnapshotOps
from sandman_ray.pool.timings import LoopTimes
from sandman_ray.pool.upkeep import Upkeep
from sandman_ray.pool.states import EndedLeases, Lease, Sandbox, State, reachable
from sandman_ray.pool.waiters import FairQueue, Waiter
from sandman_ray.providers.base import POOL_LABEL, Provider
from sandman_ray.spec import ANYWHERE, PoolConfig, SandboxSpec

logger = logging.getLogger(__name__)

TICK_S = 0.05          # reconcile at least this often while anything is pending
CREATE_ATTEMPTS = 3    # transient failures of one create before it counts as failed
EVENT_LOG = 5000       # transitions kept for ``events``
# A READY sandbox beyond the warm target is deleted only after lingering this long: in
# a loop of acquire/release it is taken again first, instead of one create and one
# delete per episode (each ~60 ms of CPU here).
SURPLUS_LINGER_S = 10.0
# How often the pool compares the provider's inventory with its records: a create that
# finished after the pool restarted (its request died with the old process) leaves a
# sandbox no record knows, which is deleted.
INVENTORY_INTERVAL_S = 5.0
NODE_CHECK_S = 1.0     # how often the pool asks which Ray nodes are alive


class Reconciler(SnapshotOps, Upkeep):
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
                                         self.bucket.rate, dict(self.records.per_client))
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
                    await self.delete_strays()
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

    # ------------------------------------------------------------------ leases
    async def lease(self, spec: SandboxSpec, client: str, timeout_s: float,
                    holder: Optional[str] = None, holder_node: Optional[str] = None,
                    lease_id: Optional[str] = None, node: Optional[str] = None) -> Lease:
        """A READY sandbox for ``spec``, lent to ``client``, within ``timeout_s``.

        holder: the name of the handle host that will hold the lease. When the sandbox
            is one that host can reach (on ``holder_node``, or at a TCP address), the
            lease is registered to it at once and offered to it (``cluster.offer``: it
            connects before the client's first call); otherwise the host of the
            sandbox's node registers it (``register``), within the grace.
        lease_id: the caller's id for the lease (a 128-bit secret it made), so that it
            can ``cancel`` a request whose answer it has not seen.
        node: where the sandbox runs. None: on ``holder_node`` when one is ready or can
            be created there (a sandbox ready elsewhere is lent rather than waited for);
            ``"anywhere"``: wherever the provider places it; a Ray node id: on that
            node only."""
        spec = self.config.limited(SandboxSpec.of(spec))
        want, only = await self._placement(node, holder_node)
        if lease_id is None:
            lease_id = "L-" + uuid.uuid4().hex  # a bearer secret: listings never show it
        else:
            served = self.records.leased(lease_id)
            if served is not None and (served.holder == holder or not served.registered_at):
                return served.lease  # asked again after a restart of the pool: served
            if lease_id in self.ended:  # cancelled (perhaps before it was asked), or over
                raise AcquireTimeout("pool %s: lease %s: %s"
                                     % (self.name, lease_id, self.ended[lease_id]))
            if lease_id in self.waiting or served is not None:
                raise ValueError("lease id %s is taken" % lease_id)
        loop = asyncio.get_running_loop()
        now = self.clock.monotonic()
        waiter = Waiter(client, spec, loop.create_future(), lease_id, now + timeout_s, now,
                        holder, holder_node, want, only)
        self.waiters.push(waiter)
        self.waiting[lease_id] = waiter
        self.lend(spec)  # a warm sandbox is lent at once, without waiting for a tick
        self.kick()  # the warm set may need a refill, or a create may be due
        if waiter.future.done():
            return waiter.future.result()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            self._forget_waiter(waiter)
            if waiter.future.done():  # lent as the timeout fired (kept), or failed (why)
                return waiter.future.result()
            raise AcquireTimeout("pool %s: no %s sandbox within %.1f s (%s)"
                                 % (self.name, spec.image, timeout_s, self.summary()))
        except asyncio.CancelledError:
            # the caller went away: a sandbox lent meanwhile is reclaimed by the grace
            self._forget_waiter(waiter)
            raise

    async def _placement(self, node: Optional[str], holder_node: Optional[str]) -> tuple:
        """(the node a waiter prefers, the node it must have) for an acquire's ``node``."""
        if node == ANYWHERE:
            return None, None
        if node is None:
            return holder_node, None
        nodes = await self.provider.nodes()
        if nodes is None:
            raise ValueError("pool %s: its provider does not place sandboxes on Ray nodes; "
                             "acquire with node=None or node=%r" % (self.name, ANYWHERE))
        if node not in nodes:
            raise ValueError("pool %s: node %r is not an alive Ray node (alive: %s)"
                             % (self.name, node, ", ".join(nodes) or "none"))
        return node, node

    def _forget_waiter(self, waiter: Waiter) -> None:
        self.waiters.remove(waiter)
        self.waiting.pop(waiter.lease_id, None)

    def cancel(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """The request for ``lease_id`` is given up: a waiter stops waiting, a lease
        already lent for it ends. False if there was neither."""
        waiter = self.waiting.get(lease_id)
        if waiter is not None:
            self._forget_waiter(waiter)
            self.ended.note(lease_id, "the request was cancelled")
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout("lease %s was cancelled" % lease_id))
            return True
        if self.release(lease_id, holder):
            return True
        # not asked yet (the cancel overtook its request): the request is refused when it
        # comes, rather than lent to a caller that has gone
        if lease_id not in self.ended:
            self.ended.note(lease_id, "the request was cancelled")
        return False

    def register(self, lease_id: str, holder: str) -> bool:
        """The handle host ``holder`` now holds ``lease_id``. False: the lease is over.
        A lease that another host registered is not taken over (LeaseNotHeld)."""
        rec = self.records.leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, holder, "register")
        self._hold(rec, holder)
        self.stats["registered"] += 1
        return True

    def _hold(self, rec: Sandbox, holder: str, seen: bool = True) -> None:
        self.records.hold(rec, holder)
        rec.holder_seen = seen
        rec.registered_at = rec.last_used = self.clock.monotonic()

    def touch(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """The lease is in use (its idle timeout starts again)."""
        rec = self.records.leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, holder, "touch")
        rec.last_used = self.clock.monotonic()
        return True

    def host_restarted(self, holder: str) -> int:
        """Ray restarted the host ``holder`` after its process or node died: the new one
        holds nothing, so the leases of the old one end. Returns how many."""
        held = self.records.held_by(holder)
        for rec in held:
            self.stats["reclaimed"] += 1
            self.end_lease(rec, "reclaimed: host %s was restarted" % holder)
        return len(held)

    def release(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """End the lease. Once a host registered it, only that host (``holder``) may;
        before, whoever has the lease id (the acquire that got it)."""
        rec = self.records.leased(lease_id)
        if rec is None:
            return False
        self._check_holder(rec, holder, "release")
        self.end_lease(rec, "released by its holder", tell_host=False)
        return True

    def _check_holder(self, rec: Sandbox, holder: Optional[str], op: str) -> None:
        if rec.registered_at and holder != rec.holder:
            raise LeaseNotHeld("pool %s: %s of the lease on %s refused: it is held by %s, "
                               "not by %s" % (self.name, op, rec.sandbox_id, rec.holder,
                                              holder or "a caller without a handle host"))

    def lend(self, only: Optional[SandboxSpec] = None) -> None:
        """Serve waiters from READY sandboxes (of ``only``, else of every spec that has
        both), each the oldest ready on the node it prefers (the caller's: its direct
        calls take the unix socket), else the oldest ready anywhere it may run."""
        specs = [only] if only is not None else \
            [s for s in self.waiters.per_spec if s in self.records.ready]
        for spec in specs:
            while spec in self.records.ready:
                waiter = self.waiters.next_for(spec, self.allowed, self._servable)
                if waiter is None:
                    break
                self.waiting.pop(waiter.lease_id, None)
                self._lend_to(self._ready_for(waiter), waiter)

    def _servable(self, waiter: Waiter) -> bool:
        return waiter.only is None or bool(self.records.ready_on(waiter.spec, waiter.only))

    def _ready_for(self, waiter: Waiter) -> Sandbox:
        here = self.records.ready_on(waiter.spec, waiter.node) if waiter.node else None
        return next(iter((here or self.records.ready[waiter.spec]).values()))

    def _lend_to(self, rec: Sandbox, waiter: Waiter) -> None:
        now = self.clock.monotonic()
        info = rec.info
        lease = Lease(waiter.lease_id, rec.sandbox_id, info.address, info.token,
                      info.node_id, self.name, waiter.client, self.clock.time())
        self.records.lend(rec, lease, waiter.client, None)
        rec.holder_seen, rec.registered_at = False, 0.0
        rec.leased_at = rec.last_used = now
        offer = False
        if waiter.holder is not None:
            if waiter.holder_node is None:  # an actor to watch; any host may register
                self.records.hold(rec, waiter.holder)
            elif reachable(info, waiter.holder_node):
                # the client's host holds it now (it may still be starting: it is
                # reclaimed for being gone only once it was seen)
                self._hold(rec, waiter.holder, seen=False)
                offer = True
        self._to(rec, State.LEASED, "lent to %s" % waiter.client)
        self.last_lent[rec.spec] = now
        self.stats["leases"] += 1
        self.metrics.lent(now - waiter.enqueued)
        if offer:  # sent before the answer: a pool that dies between them lost neither
            self.cluster.offer(waiter.holder, lease)
        waiter.future.set_result(lease)

    def allowed(self, client: str) -> bool:
        quota = self.config.client_quota
        return quota is None or self.records.per_client.get(client, 0) < quota

    def end_lease(self, rec: Sandbox, reason: str, reuse: bool = True,
                  tell_host: bool = True) -> None:
        """End the lease of ``rec`` for ``reason``; its host (when one registered it and
        did not end it itself) is told, and stops forwarding its calls."""
        if rec.lease is not None:
            self.ended.note(rec.lease.lease_id, reason)
            if tell_host and rec.holder is not None:
                self.cluster.tell_host(rec.holder, rec.lease.lease_id,
                                       "%s (pool %s)" % (reason, self.name))
        self.records.end_lease(rec)
        rec.paused = False  # the provider's reset or delete thaws it
        if reuse:
            self._to(rec, State.RELEASING, reason)
        self.kick()

    # ------------------------------------------------------------------ what is wanted
    def wanted(self) -> Dict[SandboxSpec, int]:
        """Per spec: the warm target plus the waiters whose clients may get one more."""
        wanted = collections.Counter(self.config.warm)
        wanted.update(self.waiters.per_spec)
        quota = self.config.client_quota
        if quota is not None:
            for client, held in self.records.per_client.items():
                if held >= quota:
                    for waiter in self.waiters.of(client):
                        wanted[waiter.spec] -= 1
        return wanted

    def create_missing(self, wanted: Dict[SandboxSpec, int]) -> None:
        if self.closing:
            return
        held = self.records.held()
        starting = self.records.count(State.CREATING) + self.records.count(State.REQUESTED)
        for spec, count in wanted.items():
            missing = count - self.records.supply.get(spec, 0)
            musts, wants = self._nodes_to_create(spec) if spec in self.waiters.per_spec \
                else ([], [])
            nodes = musts + wants
            for _ in range(max(missing, len(musts))):
                if held >= self.config.max_sandboxes or starting >= self.config.max_starting:
                    return
                if not self.bucket.take():
                    asyncio.get_running_loop().call_later(self.bucket.wait_s(), self.kick)
                    return
                rec = Sandbox("sbx-" + uuid.uuid4().hex[:12], spec,
                              since=self.clock.monotonic())
                if nodes:  # for a waiter on that node
                    rec.node_hint = nodes.pop(0)
                    self.provider.place(rec.sandbox_id, rec.node_hint)
                self.records.add(rec)
                self._event(rec, "requested")
                held += 1
                starting += 1
                asyncio.get_running_loop().create_task(self._create(rec))

    def _nodes_to_create(self, spec: SandboxSpec) -> tuple:
        """The nodes new sandboxes of ``spec`` should be created on for the waiters: one
        per waiter that wants a node, less the sandboxes ready or coming there; as
        (those of waiters that take one node only, those of waiters that prefer one).
        The pool creates more than it otherwise would only for the first (a sandbox
        elsewhere does not serve them)."""
        have = self.records.supply_on(spec)
        musts, wants = [], []
        for waiter in self.waiters.waiting():
            node = waiter.node
            if waiter.spec != spec or node is None:
                continue
            if have[node] > 0:
                have[node] -= 1
            else:
                (musts if waiter.only else wants).append(node)
        return musts, wants

    def delete_surplus(self, wanted: Dict[SandboxSpec, int]) -> None:
        """READY sandboxes beyond what their spec wants, once they have lingered."""
        now = self.clock.monotonic()
        for spec in list(self.records.ready):
            extra = self.records.supply.get(spec, 0) - wanted.get(spec, 0)
            if extra <= 0:
                continue
            for rec in list(itertools.islice(self.records.ready[spec].values(), extra)):
                self.records.visited += 1
                if now - rec.since <= SURPLUS_LINGER_S:
                    break  # oldest first: the rest lingered less
                self._delete_soon(rec, "surplus")

    def release_ended(self, wanted: Dict[SandboxSpec, int]) -> None:
        for rec in self.records.walk(State.RELEASING):
            # reset it while its spec is wanted or in use (another episode is likely to
            # follow); what turns out surplus is deleted after lingering. A fork's
            # sandbox is kept only while wanted: its group took all it needed at once
            recently = self.clock.monotonic() - self.last_lent.get(rec.spec, -1e9) \
                < SURPLUS_LINGER_S and rec.spec.image not in self.fork_snapshots
            keep = (self.config.reuse == "reset" and self.provider.supports_reset
                    and (recently or self.records.supply.get(rec.spec, 0)
                         < wanted.get(rec.spec, 0)))
            if keep:
                self._to(rec, State.RESETTING)
                asyncio.get_running_loop().create_task(self._reset(rec))
            else:
                self._delete_soon(rec, "released")

    # ------------------------------------------------------------------ side effects
    async def _create(self, rec: Sandbox) -> None:
        if rec.state is not State.REQUESTED:
            return  # deleted before its create began (a shutdown)
        labels = {POOL_LABEL: self.name}
        self._to(rec, State.CREATING)
        started = self.clock.monotonic()
        while True:
            rec.attempts += 1
            self.create_starts.append(self.clock.time())
            try:
                info = await asyncio.wait_for(
                    self.provider.create(rec.sandbox_id, rec.spec, labels),
                    self.config.ready_timeout_s)
                if rec.state is not State.CREATING:  # deleted meanwhile (pool shutdown)
                    await self._provider_delete(rec.sandbox_id)
                    return
                self.records.place(rec, info)
                if info.created_at:  # the provider's own account of when it started it
                    self.events.append((info.created_at, rec.sandbox_id, "started", ""))
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
                if rec.state is not State.CREATING:
                    return  # deleted meanwhile: nothing left to do
                if kind == "fatal" or rec.attempts >= CREATE_ATTEMPTS:
                    self.stats["create_failures"] += 1
                    self._fail_waiters(rec.spec, exc)
                    await self._delete(rec, "create failed: %s" % exc)
                    return
                # back off with jitter; the token bucket slows everyone else down too
                await self.clock.sleep(min(5.0, 0.2 * 2 ** rec.attempts) *
                                       random.uniform(0.5, 1.5))
                if rec.state is not State.CREATING:
                    return
        self.bucket.succeeded()
        self.stats["creates"] += 1
        self.metrics.created(self.clock.monotonic() - started)
        self._to(rec, State.READY, "answers after %.2f s" % (self.clock.monotonic() - started))
        self.lend(rec.spec)
        self.kick()

    def _fail_waiters(self, spec: SandboxSpec, exc: Exception) -> None:
        """A create failed for good: a fatal error (a bad image) fails the waiters for that
        spec at once, with the reason, rather than letting them time out."""
        if getattr(exc, "kind", "") != "fatal":
            return
        for waiter in [w for w in self.waiters.waiting() if w.spec == spec]:
            self._forget_waiter(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(ProviderError(str(exc), "fatal"))

    async def _reset(self, rec: Sandbox) -> None:
        try:
            info = await asyncio.wait_for(self.provider.reset(rec.sandbox_id),
                                          self.config.ready_timeout_s)
        except Exception as exc:
            if rec.state is State.RESETTING:
                await self._delete(rec, "reset failed: %s" % exc)
            return
        if rec.state is not State.RESETTING:
            return
        self.records.place(rec, info)
        self.stats["resets"] += 1
        self.metrics.reset_done()
        self._to(rec, State.READY, "reset")
        self.lend(rec.spec)
        self.kick()

    def _begin_delete(self, rec: Sandbox, reason: str) -> bool:
        """The state side of a delete, at once (so no tick can lend the sandbox while
        the provider deletes it). False if it is already being deleted."""
        if rec.state in (State.DELETING, State.GONE):
            return False
        if rec.state is State.LEASED:
            self.end_lease(rec, reason, reuse=False)
        if rec.state not in (State.READY, State.RELEASING, State.FAILED):
            self._to(rec, State.FAILED, reason)
        self._to(rec, State.DELETING, reason)
        return True

    def _delete_soon(self, rec: Sandbox, reason: str) -> None:
        if self._begin_delete(rec, reason):
            asyncio.get_running_loop().create_task(self._finish_delete(rec, reason))

    async def _delete(self, rec: Sandbox, reason: str) -> None:
        """Delete ``rec``; returns once the provider has deleted it, also when another
        delete of it was already under way (then that one is waited for)."""
        if self._begin_delete(rec, reason):
            await self._finish_delete(rec, reason)
        elif rec.state is State.DELETING:
            done = asyncio.get_running_loop().create_future()
            self.delete_waiters.setdefault(rec.sandbox_id, []).append(done)
            await done

    async def _finish_delete(self, rec: Sandbox, reason: str) -> None:
        try:
            await self._provider_delete(rec.sandbox_id)
            self.stats["deletes"] += 1
            self.metrics.deleted(reason)
            self._to(rec, State.GONE, reason)
            self.records.drop(rec)
            self._forget_fork_snapshot(rec.spec.image)
            self.kick()
        finally:
            for done in self.delete_waiters.pop(rec.sandbox_id, ()):
                if not done.done():
                    done.set_result(None)

    async def _provider_delete(self, sandbox_id: str) -> None:
        for attempt in range(5):
            try:
                await self.provider.delete(sandbox_id)
                return
            except Exception as exc:  # a delete must not be forgotten: retry, then say so
                logger.warning("pool %s: delete %s failed (%s), retrying", self.name,
                               sandbox_id, exc)
                await self.clock.sleep(0.2 * 2 ** attempt)
        logger.error("pool %s: could not delete %s", self.name, sandbox_id)

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
                "leases_per_client": dict(self.records.per_client),
                "snapshots": len(self.snapshots),
                "snapshot_bytes": sum(i.size_bytes for i in self.snapshots.values()),
                "create_starts": list(self.create_starts)[-1000:],
                "loop_ms": self.loop_times.summary()}

    def sandboxes(self) -> List[dict]:
        now = self.clock.monotonic()
        return [{"sandbox_id": r.sandbox_id, "state": r.state.value, "image": r.spec.image,
                 "spec": r.spec.to_dict(), "node_id": getattr(r.info, "node_id", None),
                 "client": r.client, "holder": r.holder, "age_s": now - r.since,
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

