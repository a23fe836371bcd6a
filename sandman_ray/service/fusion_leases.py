"""The sandboxes the service keeps for SandboxFusion's requests (service/fusion.py).

Each ``/run_code`` request runs in a sandbox lent for it alone, and no program runs
where another ran before the sandbox was reset. Taking a lease from the pool for each
request and giving it back costs a round of Ray calls in the service, the pool and the
node's agent (the lease, its offer, the release, the reset the pool orders), more CPU
than the program's own start. So the service keeps the leases it took for a tenant's
requests: once a program is done and its answer sent, the node's agent renews the
sandbox in place, asked on its control socket with the lease's token
(sandman_ray.control: every process killed, a fresh writable layer, a new token: what
the pool's reset does), and the sandbox serves the tenant's next request, the oldest
waiting for room first. A lease goes back to the pool instead (the pool then resets or
deletes its sandbox and lends it by its own fair queue) when no request used it for
IDLE_S, when it was kept for KEPT_MAX_S, while anyone waits at the pool, and when its
renew fails or its agent has no control socket.

Kept leases count in their tenant's limits (an acquire of the tenant's own that finds
it at its limit takes an idle one's room), under lease ids of their own (KEPT_PREFIX):
they are the service's, and no tenant lists, reaches or keeps them.
"""

import asyncio
import collections
import dataclasses
import logging
import os
import time
from typing import Deque, Dict, Optional, Set

import ray

from sandman_ray import control, touches
from sandman_ray.errors import ProtocolError, ProviderError, SandboxLost, SandmanError
from sandman_ray.lookup import (
    control_path_async, forget_control_path, forget_named, get_named)
from sandman_ray.service.answers import Refusal
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

KEPT_PREFIX = "F-"  # the lease ids of kept leases
IDLE_S = 2.0  # a kept lease no request used for this long goes back to the pool
KEEPALIVE_S = 60.0  # a kept lease's keepalive: it is touched while a request uses it
BUSY_PER_CPU = 2  # a tenant's requests running per CPU of the node past which it is busy
# a kept lease this old goes back to the pool at its next renew: the pool's fair queue,
# its TTLs and its own upkeep see each sandbox again
KEPT_MAX_S = 30.0


class FusionLeases:
    """The kept leases of one ServiceHost (``host``), per tenant."""

    def __init__(self, host):
        self.host = host
        self.kept: Dict[str, str] = {}  # lease id -> its tenant, busy or idle
        self.kept_at: Dict[str, float] = {}  # lease id -> when it was leased
        self.contended = False  # others wait at the pool (asked once a second)
        # tenant -> its idle leases and when each was last used, last used last
        self.idle: Dict[str, Dict[str, float]] = {}
        self.busy: Set[str] = set()
        # tenant -> its requests waiting for a sandbox, oldest first: each a future
        # that a renewed kept lease (its id) resolves
        self.queued: Dict[str, Deque[asyncio.Future]] = {}
        # tenant -> its requests at its limit, oldest first: each a future that a lease
        # of the tenant that ended resolves (the oldest alone: a wake of all let newer
        # requests take the room in turn and starve the oldest past their timeouts)
        self.limited: Dict[str, Deque[asyncio.Future]] = {}
        self.asking: Dict[str, int] = {}  # tenant -> its acquires at the pool under way
        self.renewing: Dict[asyncio.Future, str] = {}  # renews under way -> their tenant
        self.sweeper: Optional[asyncio.Task] = None
        self.closed = False

    @staticmethod
    def holds(lease_id: str) -> bool:
        """Whether ``lease_id`` is one of the service's kept leases."""
        return lease_id.startswith(KEPT_PREFIX)

    async def run(self, tenant: str, image: str, request) -> dict:
        """SandboxFusion's answer to ``request`` (fusion.Request), run in a kept sandbox
        of ``image`` for ``tenant``; Refusal(504) when none is free within the
        request's compile and run timeouts together."""
        from sandman_ray.client.aio import AsyncDaemonClient
        from sandman_ray.service import fusion
        lease_id = await self._take(tenant, SandboxSpec(image=image),
                                    request.compile_timeout + request.run_timeout)
        try:
            served = self.host.served.get(lease_id)
            if served is None:
                raise SandboxLost("its sandbox was reclaimed before the program ran")
            lease = served[1]
            client = await AsyncDaemonClient.connect(lease.address, lease.token)
            try:
                return await fusion.run(client, request, self.host.fusion_carried)
            finally:
                client.close()
        except SandmanError as exc:
            return fusion.answer("SandboxError", "%s: %s" % (type(exc).__name__, exc))
        finally:  # renewed after the answer is sent
            task = asyncio.ensure_future(self._renew(tenant, lease_id))
            self.renewing[task] = tenant
            task.add_done_callback(lambda done: self.renewing.pop(done, None))

    # ---- lending a kept lease to a request
    async def _take(self, tenant: str, spec: SandboxSpec, budget: float) -> str:
        """A lease for one request of ``tenant``: an idle kept one; else whichever comes
        first of a new one from the pool and a kept one renewed meanwhile (handed to the
        tenant's oldest request waiting). A tenant at its limit waits in line rather
        than be refused, for ``budget`` seconds; then Refusal 504, which
        SandboxFusion's clients retry."""
        queue = self.queued.setdefault(tenant, collections.deque())
        limited = self.limited.setdefault(tenant, collections.deque())
        if not queue:
            lease_id = self._idle_one(tenant)
            if lease_id is not None:
                return self._lent(lease_id)
        deadline = time.monotonic() + budget
        ticket = asyncio.get_running_loop().create_future()  # a kept lease handed to it
        queue.append(ticket)
        asking: Optional[asyncio.Future] = None  # its acquire at the pool
        wake: Optional[asyncio.Future] = None  # at the limit: its place in line for room
        if limited:  # behind the requests that wait for room already
            wake = self._in_line(limited, False)
        again = False  # it had its turn for room, and is first in line if refused again
        message = "older requests of this tenant wait for room"
        try:
            while True:
                in_line = wake is not None and wake in limited
                if asking is None and not in_line and self._short(tenant):
                    asking = self._ask(tenant, spec, deadline)
                left = deadline - time.monotonic()
                if left <= 0:  # a gateway's timeout, which SandboxFusion's clients retry
                    raise Refusal(504, "timeout", "no sandbox was free for this request "
                                  "within its compile and run timeouts (%.1f s): %s; try again"
                                  % (budget, message))
                done, _ = await asyncio.wait([f for f in (ticket, asking, in_line and wake) if f],
                                             timeout=min(left, 1.0),
                                             return_when=asyncio.FIRST_COMPLETED)
                if ticket.done():
                    if ticket.result() in self.kept:
                        return self._lent(ticket.result())
                    # ended between its hand-off and now: first in line for the next
                    ticket = asyncio.get_running_loop().create_future()
                    queue.appendleft(ticket)
                if asking is not None and asking.done():
                    taken, asking = asking, None
                    try:
                        return self._lent(taken.result())
                    except Refusal as no:  # at its limit: in line, and asks again in turn
                        if no.status != 429:
                            raise
                        message = no.message
                    wake = self._in_line(limited, again)
                elif in_line and (wake.done() or not done and limited and limited[0] is wake):
                    # room: a lease of the tenant ended, or, once a second, the first in
                    # line asks (a limit may be raised meanwhile); refused, it is first
                    if wake in limited:
                        limited.remove(wake)
                    wake, again = None, True  # (its room is this ask's)
        finally:
            queue.remove(ticket) if ticket in queue else None
            if wake is not None and wake in limited:
                limited.remove(wake)
            elif wake is not None and wake.done() and not wake.cancelled():
                _first_waiting(limited, None)  # woken, and served otherwise: the next
            if not ticket.done():
                ticket.cancel()
            elif not ticket.cancelled() and ticket.result() not in self.busy:
                # handed a lease, and given up meanwhile
                self._idle_again(tenant, ticket.result())
            if asking is not None:  # a lease it brings later serves the next request
                asking.add_done_callback(lambda late: self._came_late(tenant, late))

    def _short(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` that waits for a sandbox asks the pool for
        one now (else it looks again once a second): while fewer of its requests run
        than BUSY_PER_CPU per CPU of the node, whenever its waiting requests outnumber
        its asks under way (a warm sandbox comes sooner than a renew); past that, the
        node is busy and a pool's lease costs CPU the programs need, so only when its
        waiting requests outnumber the sandboxes coming to them, renewed or asked."""
        waiting = sum(1 for ticket in self.queued.get(tenant, ()) if not ticket.done())
        asking = self.asking.get(tenant, 0)
        if sum(1 for lease_id in self.busy if self.kept.get(lease_id) == tenant) < \
                BUSY_PER_CPU * (os.cpu_count() or 1):
            return waiting > asking
        return waiting > asking + sum(1 for of in self.renewing.values() if of == tenant)

    def _ask(self, tenant: str, spec: SandboxSpec, deadline: float) -> asyncio.Future:
        """A new lease of the pool's, asked for (counted while under way)."""
        self.asking[tenant] = self.asking.get(tenant, 0) + 1
        asking = asyncio.ensure_future(self._lease(tenant, spec, deadline))
        asking.add_done_callback(lambda _: self.asking.__setitem__(
            tenant, self.asking[tenant] - 1))
        return asking

    @staticmethod
    def _in_line(limited: Deque[asyncio.Future], again: bool) -> asyncio.Future:
        """A request's place in line for room (``limited``): at the end, or ``again``
        (it had its turn and was refused again) at the front."""
        place = asyncio.get_running_loop().create_future()
        (limited.appendleft if again else limited.append)(place)
        return place

    def _came_late(self, tenant: str, asking: asyncio.Future) -> None:
        """The pool's lease for a request served meanwhile: the next request's."""
        if asking.cancelled() or asking.exception() is not None:
            return
        if self.closed:
            self._later(self._give_back(asking.result()))
        else:
            self._idle_again(tenant, asking.result())

    async def _lease(self, tenant: str, spec: SandboxSpec, deadline: float) -> str:
        lease = await self.host.acquire(tenant, spec, max(1.0, deadline - time.monotonic()),
                                        KEEPALIVE_S, None, self.host.node,
                                        prefix=KEPT_PREFIX)
        self.kept[lease["lease_id"]] = tenant
        self.kept_at[lease["lease_id"]] = time.monotonic()
        self._sweeping()
        return lease["lease_id"]

    def _idle_one(self, tenant: str) -> Optional[str]:
        idle = self.idle.get(tenant)
        return idle.popitem()[0] if idle else None  # the last used: the warmest pages

    def _lent(self, lease_id: str) -> str:
        self.busy.add(lease_id)
        self._touch(lease_id)
        return lease_id

    def _touch(self, lease_id: str) -> None:
        served = self.host.served.get(lease_id)
        if served is not None:
            touches.note(self.host._pool(self.host.pool), lease_id, self.host.name)

    # ---- after a request: renewed, and lent again
    async def _renew(self, tenant: str, lease_id: str) -> None:
        self.busy.discard(lease_id)
        try:
            renewed = await self._renewed(lease_id)
        except Exception:  # noqa: BLE001 - whatever failed, the pool resets it
            logger.exception("kept lease %s: its renew failed", lease_id)
            renewed = False
        if renewed:
            self._idle_again(tenant, lease_id)
        else:
            await self._give_back(lease_id)

    async def _renewed(self, lease_id: str) -> bool:
        """Whether the kept lease's sandbox was renewed for its next request (False: it
        goes back to the pool, which resets it)."""
        served = self.host.served.get(lease_id)
        if served is None or self.closed or self.contended or \
                time.monotonic() - self.kept_at.get(lease_id, 0.0) >= KEPT_MAX_S:
            return False
        lease = served[1]
        path = await self._control_path(lease.controller)
        if path is None:
            return False
        try:
            renewed = await control.renew_async(path, lease.sandbox_id, lease.token)
        except (ProviderError, ProtocolError):
            renewed = None
        if renewed is None:
            forget_control_path(lease.controller)  # asked again next time
            return False
        if self.host.served.get(lease_id, (None, None))[1] is not lease:
            return False  # ended meanwhile: the pool's own reset comes after ours
        self.host.renewed(lease_id, dataclasses.replace(lease, **renewed))
        return not self.closed

    def _idle_again(self, tenant: str, lease_id: str) -> None:
        """A renewed lease: to the oldest request of its tenant waiting, else idle."""
        if lease_id not in self.kept:
            return
        if not _first_waiting(self.queued.get(tenant), lease_id):
            self.idle.setdefault(tenant, {})[lease_id] = time.monotonic()

    async def _give_back(self, lease_id: str) -> None:
        self.busy.discard(lease_id)
        if lease_id in self.kept:
            await self.host.release(lease_id, self.host.pool)  # ``ended`` follows

    async def _control_path(self, controller: Optional[str]) -> Optional[str]:
        """The control socket of the agent named ``controller`` (None: it has none, or
        the provider has no such agent)."""
        agent = None if controller is None else get_named(controller)
        if agent is None:
            return None
        try:
            return await control_path_async(controller, agent)
        except ray.exceptions.RayActorError:  # gone: looked up again next time
            forget_named(controller)
            return None

    # ---- the pool's word, the tenant's own acquires, and idle leases
    def ended(self, tenant: str, lease_id: str) -> None:
        """``lease_id`` of ``tenant`` ended (given back, or ended by the pool): the oldest
        request of the tenant waiting for room asks the pool for it."""
        self.idle.get(tenant, {}).pop(lease_id, None)
        if self.kept.pop(lease_id, None) is not None:
            self.kept_at.pop(lease_id, None)
            self.busy.discard(lease_id)
        _first_waiting(self.limited.get(tenant), None)

    async def make_room(self, tenant: str) -> bool:
        """Give back one idle kept lease of ``tenant`` (its own acquire found it at its
        limit), after the renews of its leases under way if it has none idle yet:
        whether there was one."""
        lease_id = self._idle_one(tenant)
        renewing = [task for task, of in self.renewing.items() if of == tenant]
        if lease_id is None and renewing:
            await asyncio.wait(renewing)
            lease_id = self._idle_one(tenant)
        if lease_id is None:
            return False
        await self._give_back(lease_id)
        return True

    def _sweeping(self) -> None:
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """While any lease is kept, once every IDLE_S / 2: each busy one touched (a long
        program keeps its lease), each idle one unused for IDLE_S given back, and the
        pool asked whether anyone else waits there."""
        while self.kept and not self.closed:
            await asyncio.sleep(IDLE_S / 2)
            for lease_id in list(self.busy):
                self._touch(lease_id)
            try:
                status = await self.host._tell_pool(self.host.pool, "status")
                # anyone at all: another tenant, another client of the pool, or asks
                # of these requests that found the pool full (their sandboxes then
                # come back through it)
                self.contended = status["waiters"] > 0
            except Exception:  # noqa: BLE001 - asked again at the next round
                self.contended = False
            now = time.monotonic()
            for idle in self.idle.values():  # (while contended, every idle one)
                for lease_id, at in list(idle.items()):
                    if self.contended or now - at >= IDLE_S:
                        del idle[lease_id]
                        self._later(self._give_back(lease_id))

    def _later(self, work) -> None:
        """``work`` (a coroutine) run on its own; a failure of it is logged."""
        def done(task: asyncio.Future) -> None:
            if not task.cancelled() and task.exception() is not None:
                logger.warning("kept leases: %s", task.exception())
        asyncio.ensure_future(work).add_done_callback(done)

    async def close(self) -> None:
        """Stop: renews under way end, and no lease is kept any more (the host gives
        back every lease it serves)."""
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.renewing:
            await asyncio.wait(list(self.renewing))
        for queue in list(self.queued.values()) + list(self.limited.values()):
            for waiting in queue:
                if not waiting.done():
                    waiting.cancel()


def _first_waiting(line: Optional[Deque[asyncio.Future]], value) -> bool:
    """Resolve the oldest future of ``line`` still waiting with ``value``: whether one
    was."""
    while line:
        waiting = line.popleft()
        if not waiting.done():
            waiting.set_result(value)
            return True
    return False
