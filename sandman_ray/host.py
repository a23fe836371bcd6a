"""HandleHost: the actor that serves the ``SandboxHandle``s of one client process on one
Ray node (sandman_ray.handle).

A client process uses its sandboxes through one ``HandleHost`` actor per Ray node (the
daemons' unix sockets are on their nodes). The host is created by the client, so owned
by it: it dies with its owner (driver, worker or actor), and the pool's watchdog then
sees its name gone and reclaims every lease it held. It uses ``num_cpus=0``. One host
per process and node, instead of an actor per lease, means a burst of leases starts no
actor process once a client has a host on each node (a Ray actor costs ~0.35 s of CPU
and ~50-80 MB here).

The host is an asyncio actor: a call is a coroutine on one multiplexed daemon connection
of its lease, opened by the lease's first call through the host and kept, so a host
holding 1,000 leases has the threads of any asyncio actor (~26) whatever it holds or
runs, and a lease only ever used directly (sandman_ray.direct) costs it no connection.
(Its threaded form ran 192 + 64 threads from its start: 284 threads and 105-114 MB at
any number of leases, bench/density.py of 2026-12-04; an asyncio actor's call costs
Ray ~0.3 ms more than a threaded one's here, measured side by side.)

An acquire is one call, to the pool: it names the client's host as the holder, and the
pool, as it lends the sandbox, hands the host the lease (``take``); a first call that
overtakes the offer waits for it. A release ends the lease at the host and at the pool
at once.

Ray restarts a host whose process or node died (not one whose owner died or that was
killed). The new incarnation holds no lease: calls in flight or queued then are retried
on it and raise SandboxLost instead of Ray's actor errors, and it tells the pools, which
end the old incarnation's leases.
"""

import asyncio
import hashlib
import time
import warnings
from typing import Dict, Optional, Set

import ray
from ray._raylet import PythonFunctionDescriptor

from sandman_ray import touches
from sandman_ray.client import AsyncDaemonClient
from sandman_ray.daemon.sandmand.wire import OPS, CodecError, unpack
from sandman_ray.direct import TOUCH_EVERY_S
from sandman_ray.errors import (
    AuthError, CallTimeout, ConnectionLost, ExecTimeout, LeaseEnded, SandboxLost, lease_lost)
from sandman_ray.pool.metrics import handle_call_latency
from sandman_ray.pool.states import EndedLeases
from sandman_ray.pool_calls import another, asking, carried_async

# The daemon operations a handle forwards: the public ops of the daemon's op table, each
# to the client's method of the same name (see sandman_ray.client for their arguments).
FORWARDED = tuple(op.name for op in OPS if op.public)
# What a handle answers about itself, through its host.
DESCRIBED = ("sandbox_id", "node_id")
HOST_RESTARTS = 3
# Calls a host runs at once (coroutines: no thread each); more wait in Ray's queue.
HOST_CALLS = 10000
# A call that arrives before the pool's offer of its lease (``take``; both are sent at
# once) waits this long for it.
TAKE_WAIT_S = 10.0
RELEASE_WAIT_S = 60.0  # a dropped handle's lease: how long to wait for calls it sent
# Chunks of a stream through the host (each up to 1 MiB) that may wait for their caller.
STREAM_AHEAD = 16
# Operations that stream, with a generator of their own (``exec_stream``): directly, an
# iterator; ``.remote()``, a Ray streaming generator; ``_async``, an async iterator.
STREAMED = ("exec_stream",)


class _Held:
    """One lease a host holds: its daemon connection (opened by its first call, shared
    by every call in flight: requests are multiplexed), the connections of its
    streams, when the pool last heard, and the calls started and in flight."""

    __slots__ = ("lease", "touched", "client", "connecting", "streams", "started", "calls",
                 "release_after", "ended")

    def __init__(self, lease):
        # the pool marked the lease used as it lent it (or as this host registered it)
        self.lease, self.touched = lease, time.monotonic()
        self.client: Optional[AsyncDaemonClient] = None
        self.connecting: Optional[asyncio.Future] = None  # the first call connecting
        self.streams: Set[AsyncDaemonClient] = set()
        self.started = 0  # calls begun on this host
        self.calls = 0  # of those, the ones in flight
        self.release_after: Optional[int] = None  # release once this many have ended
        self.ended = False  # released: its connections are closed

    def drained(self, calls: int) -> bool:
        """Whether ``calls`` calls have begun and none is in flight."""
        return self.started >= calls and self.calls == 0

    def cut(self) -> None:
        """Close its connections: calls in flight on them end (ConnectionLost), and the
        daemon stops what they started."""
        self.ended = True
        for client in [self.client, *self.streams]:
            if client is not None:
                client.close()
        self.client = None
        self.streams.clear()


class _HandleHost:
    def __init__(self):
        _without_foreign_serializers()
        self.name = ray.get_runtime_context().get_actor_name()
        self.node = ray.get_runtime_context().get_node_id()
        self.held: Dict[str, _Held] = {}  # lease id -> what it holds
        self.binding: Set[str] = set()  # leases whose bind is under way
        self.dropped: Set[str] = set()  # of those, the ones released meanwhile
        self.pools: Dict[str, object] = {}  # pool name -> PoolActor handle
        self.ended = EndedLeases()  # to say why a late call is refused
        self.arrived: Optional[asyncio.Condition] = None  # a lease was taken or ended
        self.restarted = _reconstructed()
        if self.restarted:
            self._tell_pools_of_restart()

    def __repr__(self) -> str:
        """What the Ray dashboard and Ray's messages call this actor."""
        return "%s(%s, node=%s, %d leases)" % (
            type(self).__name__.lstrip("_"), self.name, (self.node or "?")[:12],
            len(self.held))

    def _tell_pools_of_restart(self) -> None:
        """Whatever the old incarnation held is lost: every pool frees its leases."""
        from sandman_ray.names import NAMESPACE, pool_actor_name
        prefix = pool_actor_name("")
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith(prefix):
                try:
                    pool = ray.get_actor(entry["name"], namespace=NAMESPACE)
                except ValueError:  # shut down meanwhile
                    continue
                pool.host_restarted.remote(self.name)

    def _pool(self, pool: str):
        handle = self.pools.get(pool)
        if handle is None:
            from sandman_ray.names import NAMESPACE, pool_actor_name
            handle = self.pools[pool] = ray.get_actor(pool_actor_name(pool), namespace=NAMESPACE)
        return handle

    async def _tell_pool(self, pool: str, method: str, *args):
        """A call to the pool, made again while Ray restarts it (a release that is lost
        would leave the lease held by this live host for good), and of the pool
        looked up once more when the cached handle's actor is dead (``pool_calls``)."""
        return await carried_async(asking(
            lambda actor: getattr(actor, method).remote(*args), self._pool(pool),
            lambda dead: self._pool_again(pool, dead)))

    def _pool_again(self, pool: str, dead):
        """The pool's actor looked up anew, once ``dead`` turned out dead; None when there
        is no other (the pool itself is gone)."""
        if self.pools.get(pool) is dead:
            del self.pools[pool]
        try:
            return another(self._pool(pool), dead)
        except ValueError:  # no pool of that name any more
            return None

    def _changed(self) -> None:
        """Wake the calls that wait for a lease to be taken or to end."""
        if self.arrived is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.arrived:
            self.arrived.notify_all()

    async def take(self, lease) -> bool:
        """The pool lent ``lease`` to this host's client, who asked the pool itself
        (``cluster.offer``), or the client hands it over itself: hold it (its first
        call connects). False when the lease ended here first (its client gave it
        back) or is held already. A lease held under the same id with another sandbox
        or token gives way: a restarted pool lent the id again (what it lent before is
        no longer its)."""
        if self._same_held(lease) or lease.lease_id in self.ended or self.restarted:
            return False
        stale = self.held.get(lease.lease_id)
        if stale is not None:
            stale.cut()
        self.held[lease.lease_id] = _Held(lease)
        self._changed()
        return True

    def _same_held(self, lease) -> bool:
        """Whether ``lease`` is held here already, as it is."""
        held = self.held.get(lease.lease_id)
        return held is not None and (held.lease.sandbox_id, held.lease.token) == \
            (lease.sandbox_id, lease.token)

    async def cancel(self, pool: str, lease_id: str) -> None:
        """The acquire of ``lease_id`` was given up by its caller (cancelled,
        interrupted, timed out): whether it is still waiting at the pool, offered to
        this host, being bound here or already held, the lease ends and nothing of it
        is kept."""
        held = self._take(lease_id, "the acquire was given up")
        if held is None and lease_id in self.binding:
            self.dropped.add(lease_id)
        await self._tell_pool(pool, "cancel", lease_id, self.name)

    async def bind(self, lease) -> str:
        """Take ``lease``, which a client on another node acquired, and register with
        the pool (which confirms the lease is still open)."""
        self.binding.add(lease.lease_id)
        try:
            self.held[lease.lease_id] = _Held(lease)
            try:
                taken = await self._tell_pool(lease.pool, "register", lease.lease_id, self.name)
            except BaseException:
                self._forget(lease.lease_id)
                raise
            if not taken:
                self._forget(lease.lease_id)
                raise SandboxLost("lease %s of sandbox %s ended before it was taken"
                                  % (lease.lease_id, lease.sandbox_id))
            if lease.lease_id in self.dropped:  # given up while it was being bound
                await self.release(lease.lease_id, lease.pool)
                raise SandboxLost("lease %s was given back while it was being taken"
                                  % lease.lease_id)
            return self.name
        finally:
            self.binding.discard(lease.lease_id)
            self.dropped.discard(lease.lease_id)

    def _forget(self, lease_id: str) -> None:
        held = self.held.pop(lease_id, None)
        if held is not None:
            held.cut()

    def _take(self, lease_id: str, reason: str = "released by its holder") -> Optional[_Held]:
        """Stop holding ``lease_id`` and close its connections; later calls on it raise
        LeaseEnded with ``reason``, and an offer of it that comes late is refused."""
        held = self.held.pop(lease_id, None)
        if held is not None:
            held.cut()
        self.ended.note(lease_id, reason)
        self._changed()
        return held

    async def lease_ended(self, lease_id: str, reason: str) -> None:
        """The pool ended ``lease_id`` (its TTL, idleness, a release by the pool's own
        decision, a restart, a shutdown): stop forwarding, close its connections."""
        if lease_id in self.binding:
            self.dropped.add(lease_id)
        self._take(lease_id, reason)

    async def release(self, lease_id: str, pool: Optional[str] = None,
                      after_calls: Optional[int] = None, tell_pool: bool = True) -> bool:
        """End the lease; False if this host did not hold it (it is still ended at
        ``pool``: a restarted host held nothing). ``after_calls``: end it once that
        many calls on it have begun and all have finished (a handle dropped right after
        ``.remote()``), or after RELEASE_WAIT_S if some never arrive. ``tell_pool``
        False: the caller ends it at the pool itself (``sandman_ray.release`` does
        both at once)."""
        if after_calls is not None:
            held = await self._awaited(lease_id)
            if held is not None and not held.drained(after_calls):
                held.release_after = after_calls  # the last call to end releases it
                asyncio.get_running_loop().call_later(
                    RELEASE_WAIT_S, lambda: asyncio.ensure_future(self._release_late(lease_id)))
                return True
        held = self._take(lease_id)
        if held is None:
            if lease_id in self.binding:
                self.dropped.add(lease_id)  # its bind releases it once registered
            elif pool is not None and tell_pool:
                await self._tell_pool_of_release(pool, lease_id)
            return False
        if tell_pool:
            await self._tell_pool_of_release(held.lease.pool, lease_id)
        return True

    async def _tell_pool_of_release(self, pool: str, lease_id: str) -> None:
        """The pool's release of the lease; a pool that is gone (shut down) ended its
        leases with it, so there is nothing to tell (a handle dropped after its pool's
        shutdown releases through here, and no one waits for the answer)."""
        try:
            await self._tell_pool(pool, "release", lease_id, self.name)
        except ValueError:  # no pool of that name
            pass
        except ray.exceptions.RayActorError:  # its actor died; _pool_again found no
            if pool in self.pools:  # pool of that name (and cached none) unless it stands
                raise

    async def drop(self, lease_id: str) -> bool:
        """``release`` without telling the pool: ``sandman_ray.release`` ends the lease
        at the pool itself, at once."""
        return await self.release(lease_id, tell_pool=False)

    async def _release_late(self, lease_id: str) -> None:
        try:
            await self.release(lease_id)
        except Exception:  # noqa: BLE001 - the owner's death or the watchdog reclaims it
            pass

    async def leases(self, pool: str) -> list:
        """The leases of ``pool`` this host holds (a restarted pool asks)."""
        return [held.lease for held in self.held.values() if held.lease.pool == pool]

    async def node_id(self, lease_id: str) -> Optional[str]:
        """The Ray node of the lease's sandbox (None: not on a Ray node, a pod)."""
        held = await self._awaited(lease_id)
        return held.lease.node_id if held else None

    async def sandbox_id(self, lease_id: str) -> Optional[str]:
        held = await self._awaited(lease_id)
        return held.lease.sandbox_id if held else None

    async def _awaited(self, lease_id: str) -> Optional[_Held]:
        """``_holding``, None for a lease not held."""
        try:
            return await self._holding(lease_id)
        except (LeaseEnded, SandboxLost):
            return None

    async def _holding(self, lease_id: str) -> _Held:
        """What this host holds for ``lease_id``, waiting up to TAKE_WAIT_S for the
        pool's offer of a lease that has not ended."""
        held = self.held.get(lease_id)
        if held is not None:  # the common case: no wait, no lock
            return held
        if self.arrived is None:
            self.arrived = asyncio.Condition()
        deadline = time.monotonic() + TAKE_WAIT_S
        async with self.arrived:
            while True:
                held = self.held.get(lease_id)
                if held is not None:
                    return held
                reason = self.ended.get(lease_id)
                if reason is not None:
                    raise LeaseEnded("lease %s has ended: %s" % (lease_id, reason), reason)
                if self.restarted:
                    raise SandboxLost("lease %s: its handle host %s was restarted after its "
                                      "process or Ray node died, and the sandbox is lost"
                                      % (lease_id, self.name))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxLost("lease %s is not held (released, reclaimed or lost)"
                                      % lease_id)
                try:
                    await asyncio.wait_for(self.arrived.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def _connection(self, held: _Held) -> AsyncDaemonClient:
        """The lease's connection, opened by the first call that needs it (the calls
        that come meanwhile wait for it)."""
        if held.client is not None and not held.client.closed:
            return held.client
        if held.connecting is None:
            held.connecting = asyncio.ensure_future(self._connect(held))
        connecting = held.connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if held.connecting is connecting and connecting.done():
                held.connecting = None

    async def _connect(self, held: _Held) -> AsyncDaemonClient:
        lease = held.lease
        client = await AsyncDaemonClient.connect(lease.address, lease.token, hello_first=False)
        if held.ended:  # released while it connected
            client.close()
            raise ConnectionLost("lease %s was released while it connected" % lease.lease_id)
        held.client = client
        return client

    async def _call(self, lease_id: str, op: str, args, kwargs, packed: Optional[bytes] = None):
        """One daemon call on a lease; ``packed``: args and kwargs as _Method.remote
        packed them, unpacked once the call counts as begun."""
        held, began = await self._begin(lease_id)
        lease = held.lease
        try:
            if packed is not None:
                try:
                    args, kwargs = unpack(packed)
                except CodecError as exc:
                    raise TypeError("arguments of %s: %s" % (op, exc)) from None
            client = await self._connection(held)
            result = await getattr(client, op)(*args, **kwargs)
            handle_call_latency().observe(time.monotonic() - began,
                                          tags={"pool": lease.pool, "op": op})
            return result
        except (ConnectionLost, AuthError, CallTimeout) as exc:
            raise (await self._failed(held, op, exc)) from exc
        finally:
            await self._end_call(held)

    async def _begin(self, lease_id: str) -> tuple:
        """A call begins on a held lease: counted, and the pool told now and then."""
        now = time.monotonic()
        held = await self._holding(lease_id)
        held.started += 1
        held.calls += 1
        if now - held.touched > TOUCH_EVERY_S:
            held.touched = now
            touches.note(self._pool(held.lease.pool), lease_id, self.name)
        return held, now

    async def _end_call(self, held: _Held) -> None:
        held.calls -= 1
        if held.release_after is not None and not held.ended \
                and held.drained(held.release_after):
            await self.release(held.lease.lease_id)

    async def _failed(self, held: _Held, op: str, exc: Exception) -> Exception:
        """The error a call that lost its daemon (or its patience) raises: ExecTimeout
        for a timeout (the connection stays: its late reply is skipped); LeaseEnded for
        a lease ended here or by the pool (which may have started the sandbox afresh
        before its word arrived); else SandboxLost."""
        lease = held.lease
        if isinstance(exc, CallTimeout):
            return ExecTimeout("%s on sandbox %s: %s" % (op, lease.sandbox_id, exc))
        reason = self.ended.get(lease.lease_id) or await self._ended_at_pool(lease)
        error = lease_lost(exc, op, lease.sandbox_id, lease.lease_id, reason)
        if isinstance(error, LeaseEnded):
            return self._lease_over(lease.lease_id, error.reason)
        if held.client is not None and held.client.closed:
            held.client = None  # the next call connects again
        return error

    @ray.method(num_returns="streaming", max_task_retries=0,
                _generator_backpressure_num_objects=STREAM_AHEAD)
    async def exec_stream(self, lease_id: str, *args, **kwargs):
        """``AsyncDaemonClient.exec_stream`` as a Ray streaming generator, on a
        connection of its own (a slow reader pauses only that one): each chunk an
        object, then the ExecResult; at most STREAM_AHEAD chunks wait for the caller
        (then the daemon waits too). A caller that drops the generator or cancels it
        kills the command."""
        held, _ = await self._begin(lease_id)
        lease, client = held.lease, None
        try:
            client = await AsyncDaemonClient.connect(lease.address, lease.token,
                                                     hello_first=False)
            held.streams.add(client)
            if held.ended:
                client.close()
            stream = client.exec_stream(*args, **kwargs)
            try:
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()
        except (ConnectionLost, AuthError, CallTimeout) as exc:
            raise (await self._failed(held, "exec_stream", exc)) from exc
        finally:
            if client is not None:
                held.streams.discard(client)
                client.close()
            await self._end_call(held)

    async def _ended_at_pool(self, lease) -> Optional[str]:
        try:
            return await self._tell_pool(lease.pool, "why_ended", lease.lease_id)
        except ray.exceptions.RayError:
            return None

    def _lease_over(self, lease_id: str, reason: str) -> LeaseEnded:
        """Stop holding ``lease_id``, which ended for ``reason``; the error to raise."""
        self._take(lease_id, reason)
        return LeaseEnded("lease %s has ended: %s" % (lease_id, reason), reason)


def _without_foreign_serializers() -> None:
    """Keep Ray from loading, in this process, the serializers it registers for other
    libraries' types (pydantic, starlette, pyarrow and with it numpy) as it first
    (de)serializes something: a host only passes its own types. They cost a host 30 MB
    of its 84 MB (PSS after 3,000 calls, a bare actor measured each way here). The host
    takes no constructor arguments, so nothing is deserialized before this runs."""
    try:
        from ray.util import serialization_addons
    except ImportError:  # pragma: no cover - a Ray without them has nothing to skip
        return
    serialization_addons.apply = lambda context: None


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (the property reads an API Ray deprecated
    itself, which would print a warning in every host)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _forward(op: str):
    async def method(self, lease_id, *args, **kwargs):
        if isinstance(lease_id, bytes):  # a packed call: lease id, NUL, args and kwargs
            lease, _, packed = lease_id.partition(b"\0")
            return await self._call(lease.decode(), op, None, None, packed)
        return await self._call(lease_id, op, args, kwargs)
    method.__name__ = op
    method.__doc__ = "Forwarded to the daemon: see AsyncDaemonClient.%s." % op
    return method


for _op in FORWARDED:
    setattr(_HandleHost, _op, _forward(_op))

# A host's calls are not recorded as Ray task events (the dashboard's task list): one per
# sandbox operation would crowd the GCS's table of them, and the record costs each
# host ~10 MB (a bare actor with and without, measured here).
HandleHost = ray.remote(num_cpus=0, max_restarts=HOST_RESTARTS, max_task_retries=-1,
                        max_concurrency=HOST_CALLS, enable_task_events=False)(_HandleHost)


def _same_class_everywhere(actor_class, code: bytes) -> None:
    """Give ``actor_class`` one Ray class id in every process whose ``code`` is the same.

    Ray names a class it makes an actor of by a random id per process that defines it,
    and a process keeps, for good, every class it has loaded to hold a handle to one
    of its actors (~180 kB each, with its methods' signatures). Every client process
    defines its own host, so a pool that serves short-lived clients loaded one more
    class per client it ever served: its memory grew with every client that came and
    went (bench/soak.py's killed clients). With the id derived from the code, the pool
    loads the host's class once, and Ray's function table holds one copy of it."""
    meta = actor_class.__ray_metadata__
    made = meta.actor_creation_function_descriptor
    meta.actor_creation_function_descriptor = PythonFunctionDescriptor(
        made.module_name, made.function_name, made.class_name,
        hashlib.sha256(code).hexdigest())


with open(__file__, "rb") as _source:
    _same_class_everywhere(HandleHost, _source.read() + repr(FORWARDED).encode())
