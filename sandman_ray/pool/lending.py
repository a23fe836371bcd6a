"""The pool's lending: an acquire's wait (``lease``), the calls of a lease's holder
(``register``, ``touch``, ``release``, ``cancel``), and ``lend``, which serves waiters
from READY sandboxes in fair turn, each on the node it prefers, and hands the client's
host its lease.
"""

import asyncio
import uuid
from typing import Optional

from sandman_ray.errors import AcquireTimeout, LeaseNotHeld, ProviderError
from sandman_ray.pool.shared import PoolState
from sandman_ray.pool.states import Lease, Sandbox, State
from sandman_ray.pool.waiters import Waiter
from sandman_ray.providers.base import Provider, reachable
from sandman_ray.spec import ANYWHERE, MIN_IDLE_TIMEOUT_S, SandboxSpec, number_in

# a lease kept alive by its caller (a client of the service): no shorter than an idle
# timeout may be (the calls of its host reach the pool in rounds, touches.py), at most
# an hour
MIN_KEEPALIVE_S, MAX_KEEPALIVE_S = MIN_IDLE_TIMEOUT_S, 3600.0


class Lending:
    """Acquires, leases and their holders' calls.

    Reads and writes of the pool's state (``PoolState``): records (lend, hold, end
    leases; READY -> LEASED -> RELEASING), waiters and waiting (adds, serves, forgets),
    ended, last_lent, stats; reads config. Through ``provider`` only the nodes it places
    on; through ``cluster`` offers a lease to a host and tells a host a lease ended;
    ``metrics`` times the waits."""

    def __init__(self, state: PoolState, provider: Provider, cluster, metrics):
        self.state, self.provider = state, provider
        self.cluster, self.metrics = cluster, metrics

    async def lease(self, spec: SandboxSpec, client: str, timeout_s: float,
                    holder: Optional[str] = None, holder_node: Optional[str] = None,
                    lease_id: Optional[str] = None, node: Optional[str] = None,
                    keepalive_s: Optional[float] = None,
                    weight: Optional[float] = None) -> Lease:
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
            node only.
        keepalive_s: the lease lasts while its caller keeps it alive (a call through
            its holder, or ``keep_many``) at least this often, whether or not its host
            lives: a client outside Ray, which the service's gateway holds leases for.
            None: it lasts while its host lives. An acquire asked again with the same
            ``lease_id`` and client (a retry after a timeout or a cut connection)
            waits for the same lease, never a second sandbox.
        weight: the client's share of the lending against the others' (1 by default;
            a service tenant's weight), above 0, at most 1000."""
        if keepalive_s is not None and not number_in(keepalive_s, MIN_KEEPALIVE_S,
                                                     MAX_KEEPALIVE_S):
            raise ValueError("keepalive_s must be a number of seconds from %g to %g, got %r"
                             % (MIN_KEEPALIVE_S, MAX_KEEPALIVE_S, keepalive_s))
        if weight is not None and not number_in(weight, 0, 1000, above=True):
            raise ValueError("weight must be a number above 0, at most 1000, got %r" % (weight,))
        asked = self.state.config.limited(SandboxSpec.of(spec))
        spec = self.state.config.slot(asked)  # what can serve it; the rest bound as lent
        want, only = await self._placement(node, holder_node)
        if lease_id is None:
            lease_id = "L-" + uuid.uuid4().hex  # a bearer secret: listings never show it
        else:
            served = self.state.records.leased(lease_id)
            if served is not None and (served.holder == holder or not served.registered_at
                                       or (keepalive_s and served.client == client)):
                if served.handing is not None:  # its settings are still being bound
                    return await asyncio.wait_for(asyncio.shield(served.handing), timeout_s)
                return served.lease  # asked again (a retry, a restart of the pool): served
            if lease_id in self.state.ended:  # cancelled (perhaps before it was asked), or over
                raise AcquireTimeout("pool %s: lease %s: %s"
                                     % (self.state.name, lease_id, self.state.ended[lease_id]))
            waiting = self.state.waiting.get(lease_id)
            if keepalive_s and waiting is not None and waiting.client == client:
                # a retry while the first still waits: the same lease when it comes
                try:
                    return await asyncio.wait_for(asyncio.shield(waiting.future), timeout_s)
                except asyncio.TimeoutError:
                    raise AcquireTimeout("pool %s: lease %s: still waiting after %.1f s"
                                         % (self.state.name, lease_id, timeout_s)) from None
            if waiting is not None or served is not None:
                raise ValueError("lease id %s is taken" % lease_id)
        loop = asyncio.get_running_loop()
        now = self.state.clock.monotonic()
        waiter = Waiter(client, spec, loop.create_future(), lease_id, now + timeout_s, now,
                        holder, holder_node, want, only, float(keepalive_s or 0.0),
                        float(weight or 1.0), asked if asked != spec else None)
        self.state.waiters.push(waiter)
        self.state.waiting[lease_id] = waiter
        self.lend(spec)  # a warm sandbox is lent at once, without waiting for a tick
        self.state.kick()  # the warm set may need a refill, or a create may be due
        if waiter.future.done():
            return waiter.future.result()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            self.state.forget_waiter(waiter)
            if waiter.future.done():  # lent as the timeout fired (kept), or failed (why)
                return waiter.future.result()
            self._unbind(waiter, "the acquire timed out while its settings were bound")
            raise AcquireTimeout("pool %s: no %s sandbox within %.1f s (%s)"
                                 % (self.state.name, spec.image, timeout_s, self.state.summary()))
        except asyncio.CancelledError:
            # the caller went away: a sandbox lent meanwhile is reclaimed by the grace
            self.state.forget_waiter(waiter)
            self._unbind(waiter, "the acquire was cancelled while its settings were bound")
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
                             "acquire with node=None or node=%r" % (self.state.name, ANYWHERE))
        if node not in nodes:
            raise ValueError("pool %s: node %r is not an alive Ray node (alive: %s)"
                             % (self.state.name, node, ", ".join(nodes) or "none"))
        return node, node

    def cancel(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """The request for ``lease_id`` is given up: a waiter stops waiting, a lease
        already lent for it ends. False if there was neither."""
        waiter = self.state.waiting.get(lease_id)
        if waiter is not None:
            self.state.forget_waiter(waiter)
            self.state.ended.note(lease_id, "the request was cancelled")
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout("lease %s was cancelled" % lease_id))
            return True
        if self.release(lease_id, holder):
            return True
        # not asked yet (the cancel overtook its request): the request is refused when it
        # comes, rather than lent to a caller that has gone
        if lease_id not in self.state.ended:
            self.state.ended.note(lease_id, "the request was cancelled")
        return False

    def register(self, lease_id: str, holder: str) -> bool:
        """The handle host ``holder`` now holds ``lease_id``. False: the lease is over.
        A lease that another host registered is not taken over (LeaseNotHeld)."""
        rec = self.state.records.leased(lease_id)
        if rec is None:
            return False
        self.check_holder(rec, holder, "register")
        self._hold(rec, holder)
        self.state.stats["registered"] += 1
        return True

    def _hold(self, rec: Sandbox, holder: str, seen: bool = True) -> None:
        self.state.records.hold(rec, holder)
        rec.holder_seen = seen
        rec.registered_at = rec.last_used = self.state.clock.monotonic()

    def touch(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """The lease is in use (its idle timeout starts again)."""
        rec = self.state.records.leased(lease_id)
        if rec is None:
            return False
        self.check_holder(rec, holder, "touch")
        rec.last_used = rec.kept_at = self.state.clock.monotonic()
        return True

    def keep_many(self, leases) -> int:
        """Keep alive each (lease id, holder) of ``leases``: a client's keepalive, which
        renews a lease's ``keepalive_s`` but not its idle timeout (only calls do). A
        lease that ended or that another holder holds is passed over; how many were
        kept."""
        kept, now = 0, self.state.clock.monotonic()
        for lease_id, holder in leases:
            rec = self.state.records.leased(lease_id)
            if rec is not None and (holder is None or rec.holder in (None, holder)):
                rec.kept_at = now
                kept += 1
        return kept

    def touch_many(self, leases) -> int:
        """``touch`` for each (lease id, holder); a lease that ended or that another
        holder holds is passed over. How many were touched."""
        touched = 0
        for lease_id, holder in leases:
            try:
                touched += self.touch(lease_id, holder)
            except LeaseNotHeld:
                pass
        return touched

    def host_restarted(self, holder: str) -> int:
        """Ray restarted the host ``holder`` after its process or node died: the new one
        holds nothing, so the leases of the old one end. Returns how many."""
        held = self.state.records.held_by(holder)
        for rec in held:
            self.state.stats["reclaimed"] += 1
            self.end_lease(rec, "reclaimed: host %s was restarted" % holder)
        return len(held)

    def release(self, lease_id: str, holder: Optional[str] = None) -> bool:
        """End the lease. Once a host registered it, only that host (``holder``) may;
        before, whoever has the lease id (the acquire that got it)."""
        rec = self.state.records.leased(lease_id)
        if rec is None:
            return False
        self.check_holder(rec, holder, "release")
        self.end_lease(rec, "released by its holder", tell_host=False)
        return True

    def check_holder(self, rec: Sandbox, holder: Optional[str], op: str) -> None:
        if rec.registered_at and holder != rec.holder:
            raise LeaseNotHeld("pool %s: %s of the lease on %s refused: it is held by %s, "
                               "not by %s" % (self.state.name, op, rec.sandbox_id, rec.holder,
                                              holder or "a caller without a handle host"))

    def lend(self, only: Optional[SandboxSpec] = None) -> None:
        """Serve waiters from READY sandboxes (of ``only``, else of every spec that has
        both), each the oldest ready on the node it prefers (the caller's: its direct
        calls take the unix socket), else the oldest ready anywhere it may run."""
        specs = [only] if only is not None else \
            [s for s in self.state.waiters.per_spec if s in self.state.records.ready]
        for spec in specs:
            while spec in self.state.records.ready:
                waiter = self.state.waiters.next_for(spec, self.allowed, self._servable)
                if waiter is None:
                    break
                self.state.waiting.pop(waiter.lease_id, None)
                self._lend_to(self._ready_for(waiter), waiter)

    def _servable(self, waiter: Waiter) -> bool:
        return waiter.only is None or bool(self.state.records.ready_on(waiter.spec, waiter.only))

    def _ready_for(self, waiter: Waiter) -> Sandbox:
        here = self.state.records.ready_on(waiter.spec, waiter.node) if waiter.node else None
        return next(iter((here or self.state.records.ready[waiter.spec]).values()))

    def _lend_to(self, rec: Sandbox, waiter: Waiter) -> None:
        now = self.state.clock.monotonic()
        info = rec.info
        lease = Lease(waiter.lease_id, rec.sandbox_id, info.address, info.token,
                      info.node_id, self.state.name, waiter.client, self.state.clock.time(),
                      keepalive_s=waiter.keepalive_s)
        self.state.records.lend(rec, lease, waiter.client, None, waiter.weight)
        rec.holder_seen, rec.registered_at = False, 0.0
        rec.leased_at = rec.last_used = rec.kept_at = now
        rec.keepalive_s = waiter.keepalive_s
        offer = False
        if waiter.holder is not None:
            if waiter.holder_node is None:  # an actor to watch; any host may register
                self.state.records.hold(rec, waiter.holder)
            elif reachable(info, waiter.holder_node):
                # the client's host holds it now (it may still be starting: it is
                # reclaimed for being gone only once it was seen)
                self._hold(rec, waiter.holder, seen=False)
                offer = True
        self.state.to(rec, State.LEASED, "lent to %s" % waiter.client)
        self.state.last_lent[rec.spec] = now
        self.state.stats["leases"] += 1
        if waiter.task is not None:  # handed out once the sandbox has its settings
            rec.task, rec.handing, waiter.lent = waiter.task, waiter.future, rec
            self.state.binding += 1
            asyncio.ensure_future(self._bind(rec, lease, waiter, offer))
            return
        self._hand(lease, waiter, offer)

    def _hand(self, lease: Lease, waiter: Waiter, offer: bool) -> None:
        self.metrics.lent(self.state.clock.monotonic() - waiter.enqueued)
        if offer:  # sent before the answer: a pool that dies between them lost neither
            self.cluster.offer(waiter.holder, lease)
        waiter.future.set_result(lease)

    async def _bind(self, rec: Sandbox, lease: Lease, waiter: Waiter, offer: bool) -> None:
        """Give the sandbox lent to ``waiter`` the settings its spec asks beyond the
        warm set's (PoolConfig.late_bind), then hand the lease out. A sandbox that
        cannot take them goes back to be reset; the waiter waits for another, or is
        told why when its spec is at fault (a workdir that cannot be made)."""
        task = waiter.task
        try:
            await asyncio.wait_for(self.provider.bind_task(
                rec.info, dict(task.env), task.workdir, dict(task.labels)),
                self.state.config.ready_timeout_s)
            failed = None
        except Exception as exc:  # noqa: BLE001 - said to the waiter, or retried
            failed = exc
        finally:
            self.state.binding -= 1
            if not self.state.binding:  # the warm sets' refills, held back meanwhile
                self.state.kick()
        if rec.lease is not lease:  # ended meanwhile (cancelled, released, shut down)
            if not waiter.future.done():
                waiter.future.set_exception(AcquireTimeout(
                    "pool %s: lease %s: %s" % (self.state.name, lease.lease_id,
                                               self.state.ended.get(lease.lease_id)
                                               or "it ended before it was handed out")))
                waiter.future.exception()  # retrieved: its caller may have gone
            return
        rec.handing, waiter.lent = None, None
        if failed is None:
            self.state.stats["bound"] += 1
            return self._hand(lease, waiter, offer)
        self.end_lease(rec, "its settings could not be bound: %s" % failed, tell_host=False)
        if waiter.future.done():
            return
        if getattr(failed, "kind", "") == "fatal":
            waiter.future.set_exception(ProviderError(str(failed), "fatal"))
        else:  # another sandbox, in its turn, under the same lease id
            self.state.ended.pop(waiter.lease_id, None)
            self.state.waiters.push(waiter)
            self.state.waiting[waiter.lease_id] = waiter
            self.lend(waiter.spec)
            self.state.kick()

    def _unbind(self, waiter: Waiter, reason: str) -> None:
        """The caller of ``waiter`` gave up while its sandbox's settings were bound:
        that lease ends now (the sandbox is reset) instead of at the grace."""
        rec, waiter.lent = waiter.lent, None
        if rec is not None and rec.handing is waiter.future:
            self.end_lease(rec, reason, tell_host=False)

    def allowed(self, client: str) -> bool:
        quota = self.state.config.client_quota
        return quota is None or self.state.records.leases_of(client) < quota

    def end_lease(self, rec: Sandbox, reason: str, reuse: bool = True,
                  tell_host: bool = True) -> None:
        """End the lease of ``rec`` for ``reason``; its host (when one registered it and
        did not end it itself) is told, and stops forwarding its calls."""
        if rec.lease is not None:
            self.state.ended.note(rec.lease.lease_id, reason)
            if tell_host and rec.holder is not None:
                self.cluster.tell_host(rec.holder, rec.lease.lease_id,
                                       "%s (pool %s)" % (reason, self.state.name))
        self.state.records.end_lease(rec)
        rec.paused = False  # the provider's reset or delete thaws it
        if reuse:
            self.state.to(rec, State.RELEASING, reason)
        self.state.kick()
