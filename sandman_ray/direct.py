"""Direct calls: a SandboxHandle's operations run from the caller's own process, with no
Ray hop (``sb.exec("true")``, ``await sb.exec_async("true")``).

The process that acquired a lease connects to its daemon itself when it can reach it
(a unix socket on its own node, or a TCP address) and keeps a few connections for the
next calls: blocking ones, one per call in flight (IDLE_CONNECTIONS kept), and one
multiplexed asyncio connection per event loop. The handle host still holds the lease:
dropping the handle, the process dying or the pool reclaiming the lease end it as
before. A handle passed to another process, or a lease it cannot reach, makes the same
calls through its host (``ray.get(sb.exec.remote(...))``).

What ends a lease ends its direct connections: ``release`` closes them here; when the
pool ends a lease (its TTL, idleness, a shutdown), the sandbox is reset or deleted
before anyone else gets it, and a reset cuts every connection and gives the daemon a
new token, so a direct call of the old holder fails with LeaseEnded, never reaching the
next holder's sandbox.
"""

import asyncio
import threading
import time
import weakref
from typing import List, Optional, Set

import ray

from sandman_ray.client import AsyncDaemonClient, DaemonClient
from sandman_ray.errors import (
    AuthError, CallTimeout, ConnectionLost, DaemonError, ExecTimeout, LeaseEnded, SandboxLost)

IDLE_CONNECTIONS = 2  # blocking connections a lease keeps open for its next calls
TOUCH_EVERY_S = 2.0  # how often a lease in use by direct calls tells the pool
WHY_WAIT_S = 10.0  # how long a call that lost its daemon asks the pool why


class Direct:
    """This process's connections to one lease's daemon."""

    def __init__(self, lease, holder: Optional[str]):
        self.address, self.token = lease.address, lease.token
        self.lease_id, self.pool, self.sandbox_id = lease.lease_id, lease.pool, lease.sandbox_id
        self.holder = holder  # the host that holds the lease (a touch names it)
        self.lock = threading.Lock()
        self.idle: List[DaemonClient] = []
        self.busy: Set[DaemonClient] = set()
        self.loops: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.touched = time.monotonic()  # the pool marked the lease used as it lent it
        self.ended: Optional[str] = None  # why this process stopped using the lease

    # ---- blocking
    def call(self, op: str, args: tuple, kwargs: dict):
        self._touch()
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

    def _client(self) -> DaemonClient:
        with self.lock:
            self._check_open()
            client = self.idle.pop() if self.idle else None
            if client is not None:
                self.busy.add(client)
                return client
        try:
            client = DaemonClient(self.address, self.token)
        except (ConnectionLost, AuthError) as exc:
            raise self._lost(exc, "connect", ray.get) from exc
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
        self._touch()
        client = await self._async_client()
        try:
            return await getattr(client, op)(*args, **kwargs)
        except (ConnectionLost, AuthError) as exc:
            self._drop_async(client)
            raise (await self._lost_async(exc, op)) from exc
        except CallTimeout as exc:
            raise self._timed_out(op, exc) from exc

    async def _async_client(self) -> AsyncDaemonClient:
        loop = asyncio.get_running_loop()
        with self.lock:
            self._check_open()
            made = self.loops.get(loop)
            if made is None:  # the first call on this loop connects; the others wait
                made = self.loops[loop] = loop.create_future()
                connecting = True
            else:
                connecting = False
        if not connecting:
            client = await asyncio.shield(made)
            if client.closed:
                self._drop_async(client)
                return await self._async_client()
            return client
        try:
            client = await AsyncDaemonClient.connect(self.address, self.token)
        except (ConnectionLost, AuthError) as exc:
            with self.lock:
                self.loops.pop(loop, None)
            made.set_exception(exc)
            made.exception()  # retrieved: the waiters, if any, raise it themselves
            raise (await self._lost_async(exc, "connect")) from exc
        except BaseException as exc:
            with self.lock:
                self.loops.pop(loop, None)
            made.cancel()
            raise exc
        made.set_result(client)
        with self.lock:
            late = self.ended is not None
        if late:
            client.close()
            self._check_open()
        return client

    def _drop_async(self, client: AsyncDaemonClient) -> None:
        with self.lock:
            for loop, made in list(self.loops.items()):
                if made.done() and not made.cancelled() and made.exception() is None \
                        and made.result() is client:
                    del self.loops[loop]
        client.close()

    # ---- the lease
    def close(self, reason: str) -> None:
        """This process is done with the lease (``release``, or the handle was
        dropped): close every connection; calls in flight are cut."""
        with self.lock:
            if self.ended is None:
                self.ended = reason
            idle, self.idle = self.idle, []
            busy = list(self.busy)
            made = list(self.loops.values())
            self.loops.clear()
        for client in idle:
            client.close()
        for client in busy:
            client.abort()
        for fut in made:  # an asyncio connection is closed on its own loop
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                try:
                    fut.get_loop().call_soon_threadsafe(fut.result().close)
                except RuntimeError:  # its loop is closed, and the connection with it
                    pass

    def _check_open(self) -> None:
        """Raise LeaseEnded if this process released the lease (the caller holds the
        lock)."""
        if self.ended is not None:
            raise LeaseEnded("lease %s has ended: %s" % (self.lease_id, self.ended),
                             self.ended)

    def _touch(self) -> None:
        """Tell the pool the lease is in use, every TOUCH_EVERY_S (its idle reclaim
        counts direct calls too); no answer is awaited."""
        now = time.monotonic()
        if now - self.touched <= TOUCH_EVERY_S:
            return
        self.touched = now
        try:
            from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
            pool = ray.get_actor(pool_actor_name(self.pool), namespace=NAMESPACE)
            pool.touch.remote(self.lease_id, self.holder)
        except Exception:  # noqa: BLE001 - the pool is gone: the call says so itself
            pass

    def _timed_out(self, op: str, exc: Exception) -> ExecTimeout:
        return ExecTimeout("%s on sandbox %s: %s" % (op, self.sandbox_id, exc))

    def _why(self):
        """An ObjectRef of why the pool ended the lease (None: it did not), or None
        when the pool cannot be asked."""
        try:
            from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
            return ray.get_actor(pool_actor_name(self.pool),
                                 namespace=NAMESPACE).why_ended.remote(self.lease_id)
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
        if mine is not None or reason is not None:
            self.close(reason or mine)
            why = mine or reason
            return LeaseEnded("lease %s has ended: %s" % (self.lease_id, why), why)
        if isinstance(exc, AuthError):
            self.close("sandbox %s no longer takes this lease's token" % self.sandbox_id)
            return LeaseEnded("lease %s has ended: sandbox %s no longer takes its token"
                              % (self.lease_id, self.sandbox_id), "token refused")
        return SandboxLost("sandbox %s is gone (%s during %s)" % (self.sandbox_id, exc, op))
