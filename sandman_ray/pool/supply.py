"""The pool's supply: the creates that are missing for what each spec wants (paced by
a token bucket, capped by ``max_starting`` and ``max_sandboxes``, on the nodes waiters
want), the released sandboxes reset or deleted, the surplus deleted after lingering;
and those side effects through the provider: create, reset, delete.
"""

import asyncio
import collections
import itertools
import logging
import random
import uuid
from typing import Callable, Deque, Dict, List

from sandman_ray.errors import ProviderError
from sandman_ray.pool.lending import Lending
from sandman_ray.pool.pacing import AdaptiveTokenBucket
from sandman_ray.pool.shared import PoolState
from sandman_ray.pool.states import Sandbox, State
from sandman_ray.providers.base import POOL_LABEL, Provider
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

CREATE_ATTEMPTS = 3    # transient failures of one create before it counts as failed
# A READY sandbox beyond the warm target is deleted only after lingering this long: in
# a loop of acquire/release it is taken again first, instead of one create and one
# delete per episode (each ~60 ms of CPU here).
SURPLUS_LINGER_S = 10.0


class Supply:
    """Creates, resets and deletes.

    Reads and writes of the pool's state (``PoolState``): records (adds, places and
    drops them; REQUESTED -> CREATING -> READY, RELEASING -> RESETTING -> READY, any ->
    DELETING -> GONE), stats, events, waiters (a fatal create fails and forgets them);
    reads config, what waiters want and where, last_lent, fork_snapshots and closing.
    Serves the waiters through ``lending`` when a sandbox becomes READY, and ends the
    lease of one it deletes. Its own: the token bucket that paces creates (``bucket``),
    when creates started (``create_starts``), the callers waiting on a delete under way.
    ``on_gone(rec)`` is called after a sandbox is gone (the snapshots' concern drops a
    fork's snapshot with its last sandbox)."""

    def __init__(self, state: PoolState, provider: Provider, lending: Lending, metrics):
        self.state, self.provider, self.lending, self.metrics = state, provider, lending, metrics
        config = state.config
        self.bucket = AdaptiveTokenBucket(config.create_rate_per_s, config.create_burst,
                                          clock=state.clock.monotonic)
        self.create_starts: Deque[float] = collections.deque(maxlen=5000)  # wall clock
        # sandbox id -> futures of delete calls that wait for a delete already under way
        self.delete_waiters: Dict[str, List[asyncio.Future]] = {}
        self.on_gone: Callable[[Sandbox], None] = lambda rec: None

    def create_missing(self, wanted: Dict[SandboxSpec, int]) -> None:
        if self.state.closing:
            return
        records, config, waited = self.state.records, self.state.config, self.state.waiters.per_spec
        held = records.held()
        starting = records.count(State.CREATING) + records.count(State.REQUESTED)
        for spec, count in wanted.items():
            if self.state.binding:  # a burst's leases are being handed out: the machine's
                count = min(count, waited.get(spec, 0))  # CPU goes to them, refills after
            missing = count - records.supply.get(spec, 0)
            musts, wants = self._nodes_to_create(spec) if spec in waited else ([], [])
            nodes = musts + wants
            for _ in range(max(missing, len(musts))):
                if held >= config.max_sandboxes and spec in waited:
                    self._make_room(spec, wanted)  # the next tick creates in the room made
                if held >= config.max_sandboxes or starting >= config.max_starting:
                    return
                if not self.bucket.take():
                    asyncio.get_running_loop().call_later(self.bucket.wait_s(), self.state.kick)
                    return
                rec = Sandbox("sbx-" + uuid.uuid4().hex[:12], spec,
                              since=self.state.clock.monotonic())
                if nodes:  # for a waiter on that node
                    rec.node_hint = nodes.pop(0)
                    self.provider.place(rec.sandbox_id, rec.node_hint)
                records.add(rec)
                self.state.event(rec, "requested")
                held += 1
                starting += 1
                asyncio.get_running_loop().create_task(self._create(rec))

    def _make_room(self, spec: SandboxSpec, wanted: Dict[SandboxSpec, int]) -> None:
        """A waiter for ``spec`` is held back by ``max_sandboxes`` alone: a READY sandbox
        of another spec that nothing wants (a surplus lingering for a next acquire of
        its kind) is deleted now, so that one of ``spec`` can be made. One at a time
        (none while a delete is under way: room is coming), the oldest surplus first."""
        if self.state.records.count(State.DELETING):
            return
        for other in list(self.state.records.ready):
            if other == spec or self.state.records.supply.get(other, 0) <= wanted.get(other, 0):
                continue
            oldest = next(iter(self.state.records.ready[other].values()))
            self.delete_soon(oldest, "surplus: room for a waiting acquire")
            return

    def _nodes_to_create(self, spec: SandboxSpec) -> tuple:
        """The nodes new sandboxes of ``spec`` should be created on for the waiters: one
        per waiter that wants a node, less the sandboxes ready or coming there; as
        (those of waiters that take one node only, those of waiters that prefer one).
        The pool creates more than it otherwise would only for the first (a sandbox
        elsewhere does not serve them)."""
        have = self.state.records.supply_on(spec)
        musts, wants = [], []
        for waiter in self.state.waiters.waiting():
            node = waiter.node
            if waiter.spec != spec or node is None:
                continue
            if have[node] > 0:
                have[node] -= 1
            else:
                (musts if waiter.only else wants).append(node)
        return musts, wants

    def delete_surplus(self, wanted: Dict[SandboxSpec, int], linger: bool = True) -> None:
        """READY sandboxes beyond what their spec wants, once they have lingered (all of
        them at once with ``linger`` False: a warm target lowered on purpose)."""
        now = self.state.clock.monotonic()
        for spec in list(self.state.records.ready):
            extra = self.state.records.supply.get(spec, 0) - wanted.get(spec, 0)
            if extra <= 0:
                continue
            for rec in list(itertools.islice(self.state.records.ready[spec].values(), extra)):
                self.state.records.visited += 1
                if linger and now - rec.since <= SURPLUS_LINGER_S:
                    break  # oldest first: the rest lingered less
                self.delete_soon(rec, "surplus")

    def release_ended(self, wanted: Dict[SandboxSpec, int]) -> None:
        for rec in self.state.records.walk(State.RELEASING):
            # reset it while its spec is wanted or in use (another episode is likely to
            # follow); what turns out surplus is deleted after lingering. A fork's
            # sandbox is kept only while wanted: its group took all it needed at once
            recently = self.state.clock.monotonic() - self.state.last_lent.get(rec.spec, -1e9) \
                < SURPLUS_LINGER_S and rec.spec.image not in self.state.fork_snapshots
            keep = (self.state.config.reuse == "reset" and self.provider.supports_reset
                    and (recently or self.state.records.supply.get(rec.spec, 0)
                         < wanted.get(rec.spec, 0)))
            if keep:
                self.state.to(rec, State.RESETTING)
                asyncio.get_running_loop().create_task(self._reset(rec))
            else:
                self.delete_soon(rec, "released")

    # ------------------------------------------------------------------ side effects
    async def _create(self, rec: Sandbox) -> None:
        if rec.state is not State.REQUESTED:
            return  # deleted before its create began (a shutdown)
        labels = {POOL_LABEL: self.state.name}
        self.state.to(rec, State.CREATING)
        started = self.state.clock.monotonic()
        while True:
            rec.attempts += 1
            self.create_starts.append(self.state.clock.time())
            try:
                info = await asyncio.wait_for(
                    self.provider.create(rec.sandbox_id, rec.spec, labels),
                    self.state.config.ready_timeout_s)
                if rec.state is not State.CREATING:  # deleted meanwhile (pool shutdown)
                    await self.provider_delete(rec.sandbox_id)
                    return
                self.state.records.place(rec, info)
                if info.created_at:  # the provider's own account of when it started it
                    self.state.events.append((info.created_at, rec.sandbox_id, "started", ""))
                break
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = ProviderError("not ready within %.0f s"
                                        % self.state.config.ready_timeout_s, "transient")
                elif not isinstance(exc, ProviderError):  # a bug, not the cluster's weather
                    logger.exception("pool %s: create %s failed", self.state.name, rec.sandbox_id)
                    exc = ProviderError("%s: %s" % (type(exc).__name__, exc), "fatal")
                kind = exc.kind
                self.metrics.create_failed(kind)
                if kind == "throttled":
                    self.state.stats["throttled"] += 1
                    rec.attempts -= 1  # the cluster said "later", not "no": not a failure
                if kind in ("throttled", "transient"):
                    self.bucket.back_off()
                if rec.state is not State.CREATING:
                    return  # deleted meanwhile: nothing left to do
                if kind == "fatal" or rec.attempts >= CREATE_ATTEMPTS:
                    self.state.stats["create_failures"] += 1
                    self._fail_waiters(rec.spec, exc)
                    await self.delete(rec, "create failed: %s" % exc)
                    return
                # back off with jitter; the token bucket slows everyone else down too
                await self.state.clock.sleep(min(5.0, 0.2 * 2 ** rec.attempts) *
                                             random.uniform(0.5, 1.5))
                if rec.state is not State.CREATING:
                    return
        self.bucket.succeeded()
        self.state.stats["creates"] += 1
        took = self.state.clock.monotonic() - started
        self.metrics.created(took)
        self.state.to(rec, State.READY, "answers after %.2f s" % took)
        self.lending.lend(rec.spec)
        self.state.kick()

    def _fail_waiters(self, spec: SandboxSpec, exc: Exception) -> None:
        """A create failed for good: a fatal error (a bad image) fails the waiters for that
        spec at once, with the reason, rather than letting them time out."""
        if getattr(exc, "kind", "") != "fatal":
            return
        for waiter in [w for w in self.state.waiters.waiting() if w.spec == spec]:
            self.state.forget_waiter(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(ProviderError(str(exc), "fatal"))

    async def _reset(self, rec: Sandbox) -> None:
        try:
            info = await asyncio.wait_for(self.provider.reset(rec.sandbox_id),
                                          self.state.config.ready_timeout_s)
        except Exception as exc:
            if rec.state is State.RESETTING:
                await self.delete(rec, "reset failed: %s" % exc)
            return
        if rec.state is not State.RESETTING:
            return
        self.state.records.place(rec, info)
        self.state.stats["resets"] += 1
        self.metrics.reset_done()
        self.state.to(rec, State.READY, "reset")
        self.lending.lend(rec.spec)
        self.state.kick()

    def _begin_delete(self, rec: Sandbox, reason: str) -> bool:
        """The state side of a delete, at once (so no tick can lend the sandbox while
        the provider deletes it). False if it is already being deleted."""
        if rec.state in (State.DELETING, State.GONE):
            return False
        if rec.state is State.LEASED:
            self.lending.end_lease(rec, reason, reuse=False)
        if rec.state not in (State.READY, State.RELEASING, State.FAILED):
            self.state.to(rec, State.FAILED, reason)
        self.state.to(rec, State.DELETING, reason)
        return True

    def delete_soon(self, rec: Sandbox, reason: str) -> None:
        if self._begin_delete(rec, reason):
            asyncio.get_running_loop().create_task(self._finish_delete(rec, reason))

    async def delete(self, rec: Sandbox, reason: str) -> None:
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
            await self.provider_delete(rec.sandbox_id)
            self.state.stats["deletes"] += 1
            self.metrics.deleted(reason)
            self.state.to(rec, State.GONE, reason)
            self.state.records.drop(rec)
            self.on_gone(rec)
            self.state.kick()
        finally:
            for done in self.delete_waiters.pop(rec.sandbox_id, ()):
                if not done.done():
                    done.set_result(None)

    async def provider_delete(self, sandbox_id: str) -> None:
        for attempt in range(5):
            try:
                await self.provider.delete(sandbox_id)
                return
            except Exception as exc:  # a delete must not be forgotten: retry, then say so
                logger.warning("pool %s: delete %s failed (%s), retrying", self.state.name,
                               sandbox_id, exc)
                await self.state.clock.sleep(0.2 * 2 ** attempt)
        logger.error("pool %s: could not delete %s", self.state.name, sandbox_id)
