"""HandleHost: the actor that serves the ``SandboxHandle``s of one client process on one
Ray node (sandman_ray.handle).

A client process uses its sandboxes through one ``HandleHost`` actor per Ray node (the
daemons' unix sockets are on their nodes). The host is created by the client, so owned
by it: it dies with its owner (driver, worker or actor), and the pool's watchdog then
sees its name gone and reclaims every lease it held. It uses ``num_cpus=0`` and is a
threaded actor: each call is a blocking request to the daemon on a connection of its
own (a lease keeps a few open), so calls on one sandbox still run side by side. One
host per process and node, instead of an actor per lease, means a burst of leases
starts no actor process once a client has a host on each node (a Ray actor costs
~0.35 s of CPU and ~55 MB).

An acquire is one call, to the pool: it names the client's host as the holder, and the
pool, as it lends the sandbox, hands the host the lease (``take``), so the host
connects to the daemon while the client gets its answer; a first call that overtakes
the offer waits for it. A release ends the lease at the host and at the pool at once.

Ray restarts a host whose process or node died (not one whose owner died or that was
killed). The new incarnation holds no lease: calls in flight or queued then are retried
on it and raise SandboxLost instead of Ray's actor errors, and it tells the pools, which
end the old incarnation's leases.

"""

import contextlib
import threading
import time
import warnings
from typing import Dict, List, Optional, Set

import ray

from sandman_ray.client import DaemonClient
from sandman_ray.daemon.sandmand.wire import OPS, CodecError, unpack
# daemon connections a lease keeps open for its next calls, and how often a busy lease
# tells the pool it is in use: the same for a host as for direct calls
from sandman_ray.direct import IDLE_CONNECTIONS, TOUCH_EVERY_S
from sandman_ray.errors import (
    AuthError, CallTimeout, ConnectionLost, DaemonError, ExecTimeout, LeaseEnded, SandboxLost)
from sandman_ray.pool.metrics import handle_call_latency
from sandman_ray.pool.states import EndedLeases

# The daemon operations a handle forwards: the public ops of the daemon's op table, each
# to the client's method of the same name (see sandman_ray.client for their arguments).
FORWARDED = tuple(op.name for op in OPS if op.public)
# What a handle answers about itself, through its host.
DESCRIBED = ("sandbox_id", "node_id")
HOST_RESTARTS = 3
POOL_CALL_ATTEMPTS = 20  # a host's calls to a PoolActor that Ray is restarting
# A host is a threaded actor: each call is a blocking daemon request on a thread of its
# own, since an asyncio actor costs Ray ~1.1-1.5 ms more per call on a 2-vCPU VM (a
# bare async actor call against a bare sync one, measured side by side). Calls past
# this many in flight in one host wait in Ray's queue. Ray starts all the threads with
# the actor (~73 KB of memory each).
HOST_THREADS = 192
# bind, release and the questions about a lease have threads of their own: a host whose
# call threads all wait on long commands still takes and gives back leases
CONTROL_THREADS = 64
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
    """One lease a host holds: idle daemon connections (a call takes one, or opens a
    new one when all are busy, and gives it back), those in use, when the pool last
    heard, and the calls started and in flight. Guarded by the host's lock."""

    def __init__(self, lease, client: DaemonClient):
        # the pool marked the lease used as it lent it (or as this host registered it)
        self.lease, self.touched = lease, time.monotonic()
        self.idle: List[DaemonClient] = [client]
        self.busy: Set[DaemonClient] = set()
        self.started = 0  # calls begun on this host
        self.calls = 0  # of those, the ones in flight
        self.release_after: Optional[int] = None  # release once this many have ended
        self.ended = False  # released: connections in use are closed when they return

    def drained(self, calls: int) -> bool:
        """Whether ``calls`` calls have begun and none is in flight."""
        return self.started >= calls and self.calls == 0


class _HandleHost:
    def __init__(self, name: str):
        self.name = name
        self.node = ray.get_runtime_context().get_node_id()
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)  # a lease was taken or ended
        self.held: Dict[str, _Held] = {}  # lease id -> what it holds
        self.binding: Set[str] = set()  # leases whose bind is under way
        self.taking: Dict[str, object] = {}  # lease id -> a lease offered, connecting
        self.dropped: Set[str] = set()  # of those, the ones released meanwhile
        self.pools: Dict[str, object] = {}  # pool name -> PoolActor handle
        self.ended = EndedLeases()  # to say why a late call is refused
        self.restarted = _reconstructed()
        if self.restarted:
            self._tell_pools_of_restart()

    def _tell_pools_of_restart(self) -> None:
        """Whatever the old incarnation held is lost: every pool frees its leases."""
        from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
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
            from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
            handle = self.pools[pool] = ray.get_actor(pool_actor_name(pool), namespace=NAMESPACE)
        return handle

    def _tell_pool(self, pool: str, method: str, *args):
        """A call to the pool, asked again while Ray restarts it (a release that is
        lost would leave the lease held by this live host for good); a cached handle
        found dead is looked up once more (the pool shut down and created anew)."""
        looked_again = False
        for attempt in range(POOL_CALL_ATTEMPTS):
            try:
                return ray.get(getattr(self._pool(pool), method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if attempt + 1 == POOL_CALL_ATTEMPTS:
                    raise
                time.sleep(min(0.05 * 2 ** attempt, 1.0))  # back off while it restarts
            except ray.exceptions.RayActorError as exc:
                dead = self.pools.pop(pool, None)
                if looked_again or dead is None:
                    raise
                looked_again = True
                try:
                    if self._pool(pool)._actor_id == dead._actor_id:
                        raise
                except ValueError:  # no pool of that name any more
                    raise exc from None

    @ray.method(concurrency_group="control")
    def take(self, lease) -> bool:
        """The pool lent ``lease`` to this host's client, who asked the pool itself
        (``cluster.offer``): connect to its daemon now, so that the client's first call
        finds the lease held and a connection open. False when the lease ended here
        first (its client gave it back) or its sandbox is gone (given back). A lease
        held already under the same id with another sandbox or token gives way: a
        restarted pool lent the id again (what it lent before is no longer its)."""
        with self.lock:
            if self._same_held(lease) or lease.lease_id in self.ended or self.restarted:
                return False
            self.taking[lease.lease_id] = lease  # a restarted pool asking sees it
        try:
            # its hello's answer comes with the first call's: the lease is held here
            # one round trip sooner, for a first call that may already wait for it
            client = self._connected(lease, self.name, hello_first=False)
        except SandboxLost as exc:
            with self.lock:
                self.taking.pop(lease.lease_id, None)
                self.ended.note(lease.lease_id, str(exc))
                self.arrived.notify_all()
            return False
        with self.lock:
            self.taking.pop(lease.lease_id, None)
            late = lease.lease_id in self.ended or self._same_held(lease)
            stale = None if late else self.held.get(lease.lease_id)
            if stale is not None:
                stale.ended = True  # its connections in use close as they come back
            if not late:
                self.held[lease.lease_id] = _Held(lease, client)
            self.arrived.notify_all()
        if late:  # released while it connected: the release told the pool
            client.close()
        if stale is not None:
            self._end(stale)
        return not late

    def _same_held(self, lease) -> bool:
        """Whether ``lease`` is held here already, as it is (the lock held)."""
        held = self.held.get(lease.lease_id)
        return held is not None and (held.lease.sandbox_id, held.lease.token) == \
            (lease.sandbox_id, lease.token)

    @contextlib.contextmanager
    def _taking(self, lease_id: str):
        """While ``lease_id`` is being taken (a bind), a release or cancel of it marks it
        dropped, and the taking gives it back (``_unless_dropped``)."""
        with self.lock:
            self.binding.add(lease_id)
        try:
            yield
        finally:
            with self.lock:
                self.binding.discard(lease_id)
                self.dropped.discard(lease_id)

    @ray.method(concurrency_group="control")
    def cancel(self, pool: str, lease_id: str) -> None:
        """The acquire of ``lease_id`` was given up by its caller (cancelled,
        interrupted, timed out): whether it is still waiting at the pool, offered to
        this host, being taken up here or already held, the lease ends and nothing of
        it is kept."""
        with self.lock:
            held = self._take(lease_id, "the acquire was given up")
            if held is None and lease_id in self.binding:
                self.dropped.add(lease_id)
        self._end(held)
        self._tell_pool(pool, "cancel", lease_id, self.name)

    def _connected(self, lease, holder: Optional[str], hello_first: bool = True) -> DaemonClient:
        """A connection to the lease's daemon; a sandbox found gone is given back to the
        pool (by ``holder``, the host that holds it, if one does): SandboxLost."""
        try:
            return DaemonClient(lease.address, lease.token, hello_first=hello_first)
        except (ConnectionLost, AuthError) as exc:  # gone, or started afresh meanwhile
            self._tell_pool(lease.pool, "release", lease.lease_id, holder)
            raise SandboxLost("sandbox %s is gone: %s" % (lease.sandbox_id, exc)) from exc

    def _unless_dropped(self, lease) -> None:
        """Give ``lease`` back if its acquire was given up while it was being taken."""
        with self.lock:
            dropped = lease.lease_id in self.dropped
        if dropped:
            self.release(lease.lease_id, lease.pool)
            raise SandboxLost("lease %s was given back while it was being taken" % lease.lease_id)

    @ray.method(concurrency_group="control")
    def bind(self, lease) -> str:
        """Take ``lease``: connect to its daemon and register with the pool (which
        confirms the lease is still open)."""
        with self._taking(lease.lease_id):
            return self._bind(lease)

    def _bind(self, lease) -> str:
        client = self._connected(lease, None)
        with self.lock:
            self.held[lease.lease_id] = _Held(lease, client)
        try:
            taken = self._tell_pool(lease.pool, "register", lease.lease_id, self.name)
        except BaseException:
            self._end(self._forget(lease.lease_id))
            raise
        if not taken:
            self._end(self._forget(lease.lease_id))
            raise SandboxLost("lease %s of sandbox %s ended before it was taken"
                              % (lease.lease_id, lease.sandbox_id))
        self._unless_dropped(lease)
        return self.name

    def _forget(self, lease_id: str) -> Optional[_Held]:
        with self.lock:
            return self._take(lease_id)

    def _take(self, lease_id: str, reason: str = "released by its holder") -> Optional[_Held]:
        """Stop holding ``lease_id`` (the caller holds the lock); later calls on it
        raise LeaseEnded with ``reason``, and an offer of it that comes late is
        refused."""
        held = self.held.pop(lease_id, None)
        if held is not None:
            held.ended = True
        self.ended.note(lease_id, reason)
        self.arrived.notify_all()
        return held

    @ray.method(concurrency_group="control")
    def lease_ended(self, lease_id: str, reason: str) -> None:
        """The pool ended ``lease_id`` (its TTL, idleness, a release by the pool's own
        decision, a restart, a shutdown): stop forwarding, close its connections."""
        with self.lock:
            if lease_id in self.binding:
                self.dropped.add(lease_id)
        self._lease_over(lease_id, reason)

    def _end(self, held: Optional[_Held]) -> None:
        """Close what a lease that is no longer held kept open: idle connections now,
        and those in use are cut, so their calls end (the daemon stops their commands)."""
        if held is None:
            return
        with self.lock:
            idle, held.idle = held.idle, []
            busy = list(held.busy)
        for client in idle:
            client.close()
        for client in busy:
            client.abort()

    @ray.method(concurrency_group="control")
    def release(self, lease_id: str, pool: Optional[str] = None,
                after_calls: Optional[int] = None, tell_pool: bool = True) -> bool:
        """End the lease; False if this host did not hold it (it is still ended at
        ``pool``: a restarted host held nothing). ``after_calls``: end it once that
        many calls on it have begun and all have finished (a handle dropped right after
        ``.remote()``), or after RELEASE_WAIT_S if some never arrive. ``tell_pool``
        False: the caller ends it at the pool itself (``sandman_ray.release`` does
        both at once)."""
        with self.lock:
            held = self.held.get(lease_id) if after_calls is None else self._awaited(lease_id)
            if held is not None and after_calls is not None and not held.drained(after_calls):
                held.release_after = after_calls  # the last call to end releases it
                timer = threading.Timer(RELEASE_WAIT_S, self._release_late, (lease_id,))
                timer.daemon = True
                timer.start()
                return True
            held = self._take(lease_id)
            binding = held is None and lease_id in self.binding
            if binding:
                self.dropped.add(lease_id)  # its bind releases it once registered
        if held is None:
            if not binding and pool is not None and tell_pool:
                self._tell_pool(pool, "release", lease_id, self.name)
            return False
        self._end(held)
        if tell_pool:
            self._tell_pool(held.lease.pool, "release", lease_id, self.name)
        return True

    @ray.method(concurrency_group="control")
    def drop(self, lease_id: str) -> bool:
        """``release`` without telling the pool: ``sandman_ray.release`` ends the lease
        at the pool itself, at once."""
        return self.release(lease_id, tell_pool=False)

    def _release_late(self, lease_id: str) -> None:
        try:
            self.release(lease_id)
        except Exception:  # noqa: BLE001 - the owner's death or the watchdog reclaims it
            pass

    @ray.method(concurrency_group="control")
    def leases(self, pool: str) -> list:
        """The leases of ``pool`` this host holds (a restarted pool asks)."""
        with self.lock:
            return [held.lease for held in self.held.values() if held.lease.pool == pool] + \
                [lease for lease in self.taking.values() if lease.pool == pool]

    @ray.method(concurrency_group="control")
    def node_id(self, lease_id: str) -> Optional[str]:
        """The Ray node of the lease's sandbox (None: not on a Ray node, a pod)."""
        held = self._described(lease_id)
        return held.lease.node_id if held else None

    @ray.method(concurrency_group="control")
    def sandbox_id(self, lease_id: str) -> Optional[str]:
        held = self._described(lease_id)
        return held.lease.sandbox_id if held else None

    def _described(self, lease_id: str) -> Optional[_Held]:
        with self.lock:
            return self._awaited(lease_id)

    def _awaited(self, lease_id: str) -> Optional[_Held]:
        """``_holding``, None for a lease not held (the caller holds the lock)."""
        try:
            return self._holding(lease_id)
        except (LeaseEnded, SandboxLost):
            return None

    def _holding(self, lease_id: str) -> _Held:
        """What this host holds for ``lease_id`` (the caller holds the lock), waiting
        up to TAKE_WAIT_S for the pool's offer of a lease that has not ended."""
        deadline = None
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
            now = time.monotonic()
            deadline = deadline or now + TAKE_WAIT_S
            if now >= deadline:
                raise SandboxLost("lease %s is not held (released, reclaimed or lost)"
                                  % lease_id)
            self.arrived.wait(deadline - now)

    def _call(self, lease_id: str, op: str, args, kwargs, packed: Optional[bytes] = None):
        """One daemon call on a lease; ``packed``: args and kwargs as _Method.remote
        packed them, unpacked once the call counts as begun."""
        with self._using(lease_id, op) as client:
            if packed is not None:
                try:
                    args, kwargs = unpack(packed)
                except CodecError as exc:
                    raise TypeError("arguments of %s: %s" % (op, exc)) from None
            return getattr(client, op)(*args, **kwargs)

    @ray.method(num_returns="streaming", max_task_retries=0,
                _generator_backpressure_num_objects=STREAM_AHEAD)
    def exec_stream(self, lease_id: str, *args, **kwargs):
        """``DaemonClient.exec_stream`` as a Ray streaming generator: each chunk an
        object, then the ExecResult; at most STREAM_AHEAD chunks wait for the caller
        (then the daemon waits too). A caller that drops the generator or cancels it
        kills the command."""
        with self._using(lease_id, "exec_stream") as client:
            stream = client.exec_stream(*args, stop=_cancelled, **kwargs)
            try:
                for item in stream:
                    yield item
            finally:
                stream.close()

    @contextlib.contextmanager
    def _using(self, lease_id: str, op: str):
        """A connection of the lease for one call: counted as begun and in flight, the
        pool touched now and then, errors said as a handle's, the connection kept for
        the next call when the call left it sound."""
        now = time.monotonic()
        with self.lock:
            held = self._holding(lease_id)
            held.started += 1
            held.calls += 1
            client = held.idle.pop() if held.idle else None
            if client is not None:
                held.busy.add(client)
            touch = now - held.touched > TOUCH_EVERY_S
            if touch:
                held.touched = now
        lease = held.lease
        reuse = False
        try:
            if touch:
                self._pool(lease.pool).touch.remote(lease_id, self.name)
            if client is None:  # every connection of this lease is busy: one more
                client = DaemonClient(lease.address, lease.token)
                with self.lock:
                    held.busy.add(client)
                    if held.ended:  # released while it connected
                        client.abort()
            yield client
            reuse = not client.broken
            handle_call_latency().observe(time.monotonic() - now,
                                          tags={"pool": lease.pool, "op": op})
        except ConnectionLost as exc:
            # the pool may have ended the lease and started the sandbox afresh before
            # its word arrived here
            reason = self._ended_at_pool(lease)
            if reason is not None:
                raise self._lease_over(lease_id, reason) from exc
            raise SandboxLost("sandbox %s is gone (%s during %s)"
                              % (lease.sandbox_id, exc, op)) from exc
        except AuthError as exc:  # the sandbox started again for another lease
            reason = self._ended_at_pool(lease) or (
                "sandbox %s no longer takes this lease's token" % lease.sandbox_id)
            raise self._lease_over(lease_id, reason) from exc
        except CallTimeout as exc:
            reuse = True  # the late reply is skipped by the next call on it
            raise ExecTimeout("%s on sandbox %s: %s" % (op, lease.sandbox_id, exc)) from exc
        except DaemonError:
            reuse = True  # an answer: the connection is as good as before
            raise
        finally:
            with self.lock:
                held.calls -= 1
                if client is not None:
                    held.busy.discard(client)
                    if reuse and not held.ended and len(held.idle) < IDLE_CONNECTIONS:
                        held.idle.append(client)
                        client = None
                release = (held.release_after is not None and not held.ended
                           and held.drained(held.release_after))
            if client is not None:
                client.close()
            if release:
                self.release(lease_id)


    def _ended_at_pool(self, lease) -> Optional[str]:
        try:
            return self._tell_pool(lease.pool, "why_ended", lease.lease_id)
        except ray.exceptions.RayError:
            return None

    def _lease_over(self, lease_id: str, reason: str) -> LeaseEnded:
        """Stop holding ``lease_id``, which ended for ``reason``; the error to raise."""
        with self.lock:
            gone = self._take(lease_id, reason)
        self._end(gone)
        return LeaseEnded("lease %s has ended: %s" % (lease_id, reason), reason)


def _cancelled() -> bool:
    """Whether the caller cancelled the call this host thread serves (``ray.cancel``)."""
    return ray.get_runtime_context().is_canceled()


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (the property reads an API Ray deprecated
    itself, which would print a warning in every host)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _forward(op: str):
    def method(self, lease_id, *args, **kwargs):
        if isinstance(lease_id, bytes):  # a packed call: lease id, NUL, args and kwargs
            lease, _, packed = lease_id.partition(b"\0")
            return self._call(lease.decode(), op, None, None, packed)
        return self._call(lease_id, op, args, kwargs)
    method.__name__ = op
    method.__doc__ = "Forwarded to the daemon: see DaemonClient.%s." % op
    return method


for _op in FORWARDED:
    setattr(_HandleHost, _op, _forward(_op))

HandleHost = ray.remote(num_cpus=0, max_restarts=HOST_RESTARTS, max_task_retries=-1,
                        max_concurrency=HOST_THREADS,
                        concurrency_groups={"control": CONTROL_THREADS})(_HandleHost)
