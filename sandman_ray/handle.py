"""SandboxHandle: what ``acquire`` returns, and the actors that serve it.

A client process uses its sandboxes through one ``HandleHost`` actor per Ray node (the
daemons' unix sockets are on their nodes). The host is created by the client, so owned
by it: it dies with its owner (driver, worker or actor), and the pool's watchdog then
sees its name gone and reclaims every lease it held. It uses ``num_cpus=0`` and one
asyncio connection per sandbox with many requests in flight. One host per process and
node, instead of an actor per lease, means a burst of leases starts no actor process
once a client has a host on each node (a Ray actor costs ~0.35 s of CPU and ~55 MB).

A ``SandboxHandle`` names one lease on one host and reads like an actor handle:
``ray.get(sb.exec.remote("ls"))``, ``await sb.run.remote("cd /tmp")``. It pickles, so
it can be passed to tasks and actors. When the handle is garbage collected in the
process that acquired it, and was never passed on, its lease is released.

Ray restarts a host whose process or node died (not one whose owner died or that was
killed). The new incarnation holds no lease: calls in flight or queued then are retried
on it and raise SandboxLost instead of Ray's actor errors, and it tells the pools, which
end the old incarnation's leases.
"""

import asyncio
import time
import warnings
import weakref
from typing import Dict, Optional, Set

import ray

from sandman_ray.client import AsyncDaemonClient
from sandman_ray.errors import CallTimeout, ConnectionLost, ExecTimeout, SandboxLost
from sandman_ray.pool.metrics import handle_call_latency

# The daemon operations a handle forwards (see sandman_ray.client for their arguments).
FORWARDED = ("ping", "info", "exec", "run", "session_open", "session_close", "session_list",
             "spawn", "proc_status", "proc_list", "proc_output", "proc_wait", "proc_signal",
             "read_file", "write_file", "stat", "list_dir", "mkdir", "remove", "move",
             "get_archive", "put_archive")
# What a handle answers about itself, through its host.
DESCRIBED = ("sandbox_id", "node_id")
TOUCH_EVERY_S = 2.0  # how often a busy lease tells the pool it is in use
HOST_RESTARTS = 3
POOL_CALL_ATTEMPTS = 20  # a host's calls to a PoolActor that Ray is restarting


class _Held:
    """One lease a host holds: its daemon connection, when the pool last heard, and
    the calls in flight on it."""

    def __init__(self, lease, client: AsyncDaemonClient):
        self.lease, self.client, self.touched = lease, client, 0.0
        self.calls = 0
        self.quiet = asyncio.Event()  # set while no call is in flight
        self.quiet.set()


class _HandleHost:
    def __init__(self, name: str):
        self.name = name
        self.held: Dict[str, _Held] = {}  # lease id -> what it holds
        self.binding: Set[str] = set()  # leases whose bind is under way
        self.dropped: Set[str] = set()  # of those, the ones released meanwhile
        self.pools: Dict[str, object] = {}  # pool name -> PoolActor handle
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
                pool.handle_restarted.remote(self.name)

    def _pool(self, pool: str):
        if pool not in self.pools:
            from sandman_ray.pool.actor import NAMESPACE, pool_actor_name
            self.pools[pool] = ray.get_actor(pool_actor_name(pool), namespace=NAMESPACE)
        return self.pools[pool]

    async def _tell_pool(self, pool: str, method: str, *args):
        """A call to the pool, asked again while Ray restarts it (a release that is
        lost would leave the lease held by this live host for good)."""
        for attempt in range(POOL_CALL_ATTEMPTS):
            try:
                return await getattr(self._pool(pool), method).remote(*args)
            except ray.exceptions.ActorUnavailableError:
                if attempt + 1 == POOL_CALL_ATTEMPTS:
                    raise
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
            except ray.exceptions.RayActorError:
                self.pools.pop(pool, None)  # perhaps shut down and created again
                raise

    async def bind(self, lease) -> str:
        """Take ``lease``: connect to its daemon and register with the pool (which
        confirms the lease is still open)."""
        self.binding.add(lease.lease_id)
        try:
            return await self._bind(lease)
        finally:
            self.binding.discard(lease.lease_id)
            self.dropped.discard(lease.lease_id)

    async def _bind(self, lease) -> str:
        try:
            client = await AsyncDaemonClient.connect(lease.address, lease.token)
        except ConnectionLost as exc:
            await self._tell_pool(lease.pool, "release", lease.lease_id)
            raise SandboxLost("sandbox %s is gone: %s" % (lease.sandbox_id, exc)) from exc
        self.held[lease.lease_id] = _Held(lease, client)
        try:
            taken = await self._tell_pool(lease.pool, "register", lease.lease_id, self.name)
        except BaseException:
            self._forget(lease.lease_id)
            raise
        if not taken:
            self._forget(lease.lease_id)
            raise SandboxLost("lease %s of sandbox %s ended before it was taken"
                              % (lease.lease_id, lease.sandbox_id))
        if lease.lease_id in self.dropped:  # the acquire gave up while this bind ran
            await self.release(lease.lease_id, lease.pool)
            raise SandboxLost("lease %s was given back while it was being taken" % lease.lease_id)
        return self.name

    def _forget(self, lease_id: str) -> Optional[_Held]:
        held = self.held.pop(lease_id, None)
        if held is not None:
            held.client.close()
        return held

    async def release(self, lease_id: str, pool: Optional[str] = None,
                      after_calls: bool = False) -> bool:
        """End the lease; False if this host did not hold it (it is still ended at
        ``pool``: a restarted host held nothing). ``after_calls``: let the calls in
        flight on it finish first (a handle dropped right after ``.remote()``)."""
        held = self.held.get(lease_id)
        if held is not None and after_calls:
            await held.quiet.wait()
        held = self._forget(lease_id)
        if held is None:
            if lease_id in self.binding:
                self.dropped.add(lease_id)  # its bind releases it once registered
            elif pool is not None:
                await self._tell_pool(pool, "release", lease_id)
            return False
        await self._tell_pool(held.lease.pool, "release", lease_id)
        return True

    def node_id(self, lease_id: str) -> str:
        return ray.get_runtime_context().get_node_id()

    def sandbox_id(self, lease_id: str) -> Optional[str]:
        held = self.held.get(lease_id)
        return held.lease.sandbox_id if held else None

    def _holding(self, lease_id: str) -> _Held:
        held = self.held.get(lease_id)
        if held is not None:
            return held
        if self.restarted:
            raise SandboxLost("lease %s: its handle host %s was restarted after its process "
                              "or Ray node died, and the sandbox is lost" % (lease_id, self.name))
        raise SandboxLost("lease %s is not held (released, reclaimed or lost)" % lease_id)

    async def _call(self, lease_id: str, op: str, args, kwargs):
        held = self._holding(lease_id)
        lease, now = held.lease, time.monotonic()
        if now - held.touched > TOUCH_EVERY_S:
            held.touched = now
            self._pool(lease.pool).touch.remote(lease_id)
        held.calls += 1
        held.quiet.clear()
        try:
            result = await getattr(held.client, op)(*args, **kwargs)
            handle_call_latency().observe(time.monotonic() - now,
                                          tags={"pool": lease.pool, "op": op})
            return result
        except ConnectionLost as exc:
            raise SandboxLost("sandbox %s is gone (%s during %s)"
                              % (lease.sandbox_id, exc, op)) from exc
        except CallTimeout as exc:
            raise ExecTimeout("%s on sandbox %s: %s" % (op, lease.sandbox_id, exc)) from exc
        finally:
            held.calls -= 1
            if held.calls == 0:
                held.quiet.set()


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (the property reads an API Ray deprecated
    itself, which would print a warning in every host)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _forward(op: str):
    async def method(self, lease_id: str, *args, **kwargs):
        return await self._call(lease_id, op, args, kwargs)
    method.__name__ = op
    method.__doc__ = "Forwarded to the daemon: see DaemonClient.%s." % op
    return method


for _op in FORWARDED:
    setattr(_HandleHost, _op, _forward(_op))

HandleHost = ray.remote(num_cpus=0, max_restarts=HOST_RESTARTS, max_task_retries=-1,
                        max_concurrency=10000)(_HandleHost)


class _Method:
    """``handle.<op>``: ``.remote(...)`` gives the call's ObjectRef, as on an actor."""

    __slots__ = ("handle", "op")

    def __init__(self, handle: "SandboxHandle", op: str):
        self.handle, self.op = handle, op

    def remote(self, *args, **kwargs):
        return getattr(self.handle._host, self.op).remote(self.handle.lease_id, *args, **kwargs)


class SandboxHandle:
    """One leased sandbox, used like an actor handle: ``ray.get(sb.exec.remote("ls"))``.
    Its operations are those of ``sandman_ray.client.DaemonClient`` plus ``sandbox_id``
    and ``node_id``. Give it back with ``sandman_ray.release``."""

    def __init__(self, host, lease_id: str, sandbox_id: str, node_id: Optional[str],
                 pool: str, owned: bool = True):
        self._host, self.lease_id, self.pool = host, lease_id, pool
        self.sandbox, self.node = sandbox_id, node_id
        # the lease is released when this object is collected, unless it was passed on
        self._finalizer = None
        if owned:
            self._finalizer = weakref.finalize(self, _release_quietly, host, lease_id, pool)
            self._finalizer.atexit = False  # at exit the host dies with this process

    def __getattr__(self, op: str):
        if op in FORWARDED or op in DESCRIBED:
            return _Method(self, op)
        raise AttributeError("SandboxHandle has no operation %r" % op)

    def __reduce__(self):
        # passed to another process: it may use the lease after this object is gone
        if self._finalizer is not None:
            self._finalizer.detach()
        return (SandboxHandle, (self._host, self.lease_id, self.sandbox, self.node, self.pool,
                                False))

    def _released(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()

    def __repr__(self) -> str:
        return "SandboxHandle(%s, lease %s)" % (self.sandbox, self.lease_id)


def _release_quietly(host, lease_id: str, pool: str) -> None:
    """A handle was dropped without ``release``: give its lease back once the calls in
    flight on it are answered, without waiting here (this runs in the garbage
    collector)."""
    try:
        if ray.is_initialized():
            host.release.remote(lease_id, pool, True)
    except Exception:  # noqa: BLE001 - the owner's death or the watchdog reclaims it
        pass
