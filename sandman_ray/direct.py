"""Direct calls: a SandboxHandle's operations run from the caller's own process, with no
Ray hop (``sb.exec("true")``, ``await sb.exec_async("true")``).

The process that acquired a lease connects to its daemon itself when its address
says it can (a unix socket on its own node, or a TCP address) and keeps a few
connections for the next calls: blocking ones, one per call in flight (IDLE_CONNECTIONS
kept), and one multiplexed asyncio connection per event loop. The handle host still
holds the lease: dropping the handle, the process dying or the pool reclaiming the
lease end it as before. A handle passed to another process, a lease it cannot reach,
and a daemon this process fails to connect to (a TCP address out of its reach) make the
same calls through the host (``ray.get(sb.exec.remote(...))``). The LocalProvider's
daemons listen on unix sockets: from another node, a handle calls through its host.

What ends a lease ends its direct connections: ``release`` cuts them here; when the
pool ends a lease (its TTL, idleness, a shutdown), the sandbox is reset or deleted
before anyone else gets it, and a reset cuts every connection and gives the daemon a
new token, so a direct call of the old holder fails with LeaseEnded, never reaching the
next holder's sandbox. (Until that reset, a few milliseconds, a direct call of the old
holder still reaches its own former sandbox; a call through the host is refused as
soon as the pool's word arrives.)
"""

import asyncio
import threading
import time
from typing import Dict, List, Optional, Set

import ray

from sandman_ray import touches
from sandman_ray.client import AsyncDaemonClient, DaemonClient
from sandman_ray.errors import (
    AuthError, CallTimeout, ConnectionLost, DaemonError, ExecTimeout, LeaseEnded, SandboxLost,
    lease_lost)

IDLE_CONNECTIONS = 2  # blocking connections a lease keeps open for its next calls
TOUCH_EVERY_S = touches.TOUCH_EVERY_S  # how often a lease in use notes it (sandman_ray.touches)
WHY_WAIT_S = 10.0  # how long a call that lost its daemon asks the pool why


class Unreachable(Exception):
    """This process cannot connect to the daemon (nothing was sent): the call goes
    through the host instead."""


class Direct:
    """This process's connections to one lease's daemon; ``pool``: the PoolActor's
    handle (touches, and why a lease ended)."""

    def __init__(self, lease, holder: Optional[str], pool):
        self.address, self.token = lease.address, lease.token
        self.lease_id, self.sandbox_id = lease.lease_id, lease.sandbox_id
        self.holder = holder  # the host that holds the lease (a touch names it)
        self.pool = pool
        self.lock = threading.Lock()
        self.idle: List[DaemonClient] = []
        self.busy: Set[DaemonClient] = set()
        self.loops: Dict[asyncio.AbstractEventLoop, "asyncio.Future"] = {}
        self.streams: Dict[AsyncDaemonClient, asyncio.AbstractEventLoop] = {}  # asyncio streams
        self.touched = time.monotonic()  # the pool marked the lease used as it lent it
        self.ended: Optional[str] = None  # why this process stopped using the lease
        self.reached = False  # a connection was made once (else a failed one: Unreachable)

    # ---- blocking
    def call(self, op: str, args: tuple, kwargs: dict):
        client, ok = self._client(), False
        try:
            result = getattr(client, op)(*args, **kwargs)
            ok = True
            return result
        except (ConnectionLost, AuthError) as exc:
            raise self._lost(exc, op, ray.get) from exc
        except CallTimeout as exc:
            ok = True  # the late reply is skipped by the next call on it
            raise self._timed_out(op, exc) from exc
        except DaemonError:
            ok = True  # an answer: the connection is as good as before
            raise
        finally:
            self._give_back(client, ok)

    def stream(self, op: str, args: tuple, kwargs: dict):
        """A streaming op (``exec_stream``) on a connection of its own until it ends: a
        generator of its items. Unreachable is raised here, before anything is sent."""
        client = self._client()
        return self._streamed(client, op, args, kwargs)

    def _streamed(self, client: DaemonClient, op: str, args: tuple, kwargs: dict):
        ok = False
        try:
            items = getattr(client, op)(*args, **kwargs)
            try:
                for item in items:
                    yield item
            finally:
                items.close()  # given up early: cancelled, and read to its end
                ok = not client.broken
        except (ConnectionLost, AuthError) as exc:
            ok = False
            raise self._lost(exc, op, ray.get) from exc
        except CallTimeout as exc:
            raise self._timed_out(op, exc) from exc
        finally:
            self._give_back(client, ok)

    def _client(self) -> DaemonClient:
        """An idle connection, or a new one; the pool is touched now and then."""
        now = time.monotonic()
        with self.lock:
            self._check_open()
            touch = now - self.touched > TOUCH_EVERY_S
            if touch:
                self.touched = now
            client = self.idle.pop() if self.idle else None
            if client is not None:
                self.busy.add(client)
        if touch:
            self._tell_touched()
        if client is not None:
            return client
        try:
            # the hello goes with the first call: a new lease's first call costs one
            # round trip to the daemon, as the next does
            client = DaemonClient(self.address, self.token, hello_first=False)
        except ConnectionLost as exc:
            if not self.reached:
                raise Unreachable(str(exc)) from exc
            raise self._lost(exc, "connect", ray.get) from exc
        except AuthError as exc:
            raise self._lost(exc, "connect", ray.get) from exc
        self.reached = True
        with self.lock:
            self.busy.add(client)
            if self.ended is not None:  # released while it connected
                client.abort()
        return client

    def _give_back(self, client: DaemonClient, ok: bool) -> None:
        with self.lock:
            self.busy.discard(client)
            if ok and self.ended is None and len(self.idle) < IDLE_CONNECTIONS:
                self.idle.append(client)
                return
        client.close()

    # ---- asyncio
    async def call_async(self, op: str, args: tuple, kwargs: dict):
        client = await self._async_client()
        self._touch()
        try:
            return await getattr(client, op)(*args, **kwargs)
        except (ConnectionLost, AuthError) as exc:
            self._drop_async(client)
            raise (await self._lost_async(exc, op)) from exc
        except CallTimeout as exc:
            raise self._timed_out(op, exc) from exc

    async def open_stream_async(self, op: str, args: tuple, kwargs: dict):
        """A streaming op on an asyncio connection of its own (its reader's pace pauses
        that connection only): an async generator of its items. Unreachable is raised
        here, before anything is sent."""
        loop = asyncio.get_running_loop()
        with self.lock:
            self._check_open()
        try:
            client = await AsyncDaemonClient.connect(self.address, self.token)
        except ConnectionLost as exc:
            if not self.reached:
                raise Unreachable(str(exc)) from exc
            raise (await self._lost_async(exc, "connect")) from exc
        except AuthError as exc:
            raise (await self._lost_async(exc, "connect")) from exc
        self.reached = True
        with self.lock:
            self.streams[client] = loop
            late = self.ended is not None
        if late:
            _cut(client, loop)
        self._touch()
        return self._streamed_async(client, op, args, kwargs)

    async def _streamed_async(self, client: AsyncDaemonClient, op: str, args: tuple,
                              kwargs: dict):
        try:
            async for item in getattr(client, op)(*args, **kwargs):
                yield item
        except (ConnectionLost, AuthError) as exc:
            raise (await self._lost_async(exc, op)) from exc
        except CallTimeout as exc:
            raise self._timed_out(op, exc) from exc
        finally:
            with self.lock:
                self.streams.pop(client, None)
            client.close()

    async def _async_client(self) -> AsyncDaemonClient:
        """This loop's connection; the first call on a loop connects and the others
        wait for it (and connect themselves if it failed or was cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                self._check_open()
                stale = self._closed_loops()
                made = self.loops.get(loop)
                connecting = made is None
                if connecting:
                    made = self.loops[loop] = loop.create_future()
            for client in stale:
                _cut(client, None)
            if connecting:
                return await self._connect_async(loop, made)
            try:
                client = await asyncio.shield(made)
            except asyncio.CancelledError:
                if made.cancelled() and not asyncio.current_task().cancelling():
                    continue  # the connecting call was cancelled, not this one
                raise
            except (ConnectionLost, AuthError, Unreachable, LeaseEnded, SandboxLost):
                continue  # its own error went to its caller; this one tries itself
            if not client.closed:
                return client
            self._drop_async(client)

    async def _connect_async(self, loop, made: "asyncio.Future") -> AsyncDaemonClient:
        try:
            client = await AsyncDaemonClient.connect(self.address, self.token)
        except BaseException as exc:
            with self.lock:
                if self.loops.get(loop) is made:
                    del self.loops[loop]
            if isinstance(exc, Exception):
                made.set_exception(exc)
                made.exception()  # retrieved: the waiters connect themselves
            else:
                made.cancel()
            if isinstance(exc, ConnectionLost) and not self.reached:
                raise Unreachable(str(exc)) from exc
            if isinstance(exc, (ConnectionLost, AuthError)):
                raise (await self._lost_async(exc, "connect")) from exc
            raise
        self.reached = True
        made.set_result(client)
        with self.lock:
            late = self.ended is not None
        if late:  # released while it connected
            _cut(client, loop)
            self._check_open()
        return client

    def _closed_loops(self) -> List[AsyncDaemonClient]:
        """Forget the connections of loops that have closed (an ``asyncio.run`` that
        ended); returns them, to be cut (the caller holds the lock)."""
        stale = []
        for loop in [loop for loop in self.loops if loop.is_closed()]:
            client = _made(self.loops.pop(loop))
            if client is not None:
                stale.append(client)
        return stale

    def _drop_async(self, client: AsyncDaemonClient) -> None:
        with self.lock:
            for loop, made in list(self.loops.items()):
                if _made(made) is client:
                    del self.loops[loop]
        _cut(client, asyncio.get_running_loop())

    # ---- the lease
    def close(self, reason: str) -> None:
        """This process is done with the lease (``release``, or the handle was
        dropped): cut every connection; calls in flight end at once."""
        with self.lock:
            if self.ended is None:
                self.ended = reason
            idle, self.idle = self.idle, []
            busy = list(self.busy)
            made = [(_made(fut), loop) for loop, fut in self.loops.items()]
            made += list(self.streams.items())
            self.loops.clear()
            self.streams.clear()
        for client in idle:
            client.close()
        for client in busy:
            client.abort()
        for client, loop in made:
            if client is not None:
                _cut(client, loop)

    def _check_open(self) -> None:
        """Raise LeaseEnded if this process released the lease (the caller holds the
        lock)."""
        if self.ended is not None:
            raise LeaseEnded("lease %s has ended: %s" % (self.lease_id, self.ended),
                             self.ended)

    def _touch(self) -> None:
        """Note that the lease is in use, every TOUCH_EVERY_S (the pool's idle reclaim
        counts direct calls too; sandman_ray.touches tells it)."""
        now = time.monotonic()
        with self.lock:
            if now - self.touched <= TOUCH_EVERY_S:
                return
            self.touched = now
        self._tell_touched()

    def _tell_touched(self) -> None:
        touches.note(self.pool, self.lease_id, self.holder)

    def _timed_out(self, op: str, exc: Exception) -> ExecTimeout:
        return ExecTimeout("%s on sandbox %s: %s" % (op, self.sandbox_id, exc))

    def _why(self):
        """An ObjectRef of why the pool ended the lease (None: it did not), or None
        when the pool cannot be asked."""
        try:
            return self.pool.why_ended.remote(self.lease_id)
        except Exception:  # noqa: BLE001 - no pool: the sandbox went with it
            return None

    def _lost(self, exc: Exception, op: str, get) -> Exception:
        """The error for a daemon that stopped answering this lease: LeaseEnded when the
        pool ended it (and reset the sandbox for the next holder), else SandboxLost."""
        ref = self._why()
        reason = None
        if ref is not None:
            try:
                reason = get(ref, timeout=WHY_WAIT_S)
            except Exception:  # noqa: BLE001 - no answer: the sandbox is lost to us
                reason = None
        return self._error(exc, op, reason)

    async def _lost_async(self, exc: Exception, op: str) -> Exception:
        ref = self._why()
        reason = None
        if ref is not None:
            try:
                reason = await asyncio.wait_for(ref, WHY_WAIT_S)
            except Exception:  # noqa: BLE001
                reason = None
        return self._error(exc, op, reason)

    def _error(self, exc: Exception, op: str, reason: Optional[str]) -> Exception:
        with self.lock:
            mine = self.ended
        error = lease_lost(exc, op, self.sandbox_id, self.lease_id, reason or mine)
        if isinstance(error, LeaseEnded):
            self.close(error.reason)
        return error


def _made(fut: "asyncio.Future") -> Optional[AsyncDaemonClient]:
    """The connection a loop's future holds, if it was made."""
    if fut.done() and not fut.cancelled() and fut.exception() is None:
        return fut.result()
    return None


def _cut(client: AsyncDaemonClient, loop) -> None:
    """End an asyncio connection from any thread, whether its loop runs or has closed,
    and close it on its ``loop`` when that still runs."""
    client.abort()
    if loop is not None and not loop.is_closed():
        try:
            loop.call_soon_threadsafe(client.close)
        except RuntimeError:  # closed meanwhile
            pass
