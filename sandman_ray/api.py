"""The public API: pools, acquire and release, a context manager."""

import asyncio
import contextlib
import os
import threading
import time
import uuid
from typing import Dict, Optional, Union

import ray

from sandman_ray.errors import AcquireTimeout, SandboxLost, SandmanError
from sandman_ray.handle import HandleHost, SandboxHandle
from sandman_ray.pool.actor import NAMESPACE, PoolActor, pool_actor_name
from sandman_ray.pool.cluster import HOST_PREFIX
from sandman_ray.spec import DEFAULT_IMAGE, PoolConfig, SandboxSpec, check_pool_name

SpecLike = Union[SandboxSpec, str]
POOL_RESTART_RETRIES = 20  # times a lease request is asked again of a restarting PoolActor
BIND_ATTEMPTS = 3  # leases an acquire takes when the sandboxes it is lent turn out gone

_hosts: Dict[str, object] = {}  # node id ("" for anywhere) -> this process's HandleHost
_hosts_lock = threading.Lock()
_pools: Dict[str, object] = {}  # pool name -> actor handle (a name lookup is a GCS call)
_cached_for = [None]  # the Ray session the two caches above belong to


def _caches_current() -> None:
    """Forget handles and pools of an earlier Ray session of this process (after
    ``ray.shutdown()`` and a new ``ray.init()`` they name actors that are gone)."""
    ctx = ray.get_runtime_context()
    session = (ctx.gcs_address, ctx.get_node_id(), ctx.get_job_id())
    if _cached_for[0] != session:
        with _hosts_lock:
            if _cached_for[0] != session:
                _hosts.clear()
                _pools.clear()
                _cached_for[0] = session


def create_pool(name: str = "default", provider=None, *, warm=None, **config):
    """Create the pool ``name`` (or return it if it exists): a detached actor that
    outlives this driver. ``config`` takes the fields of ``PoolConfig``."""
    check_pool_name(name)
    if provider is None:
        from sandman_ray.providers.local import LocalProvider
        provider = LocalProvider()
    cfg = PoolConfig(provider=provider, warm=dict(warm or {}), **config)
    head = _head_node()
    # worker nodes come and go (autoscaling, failures); the head stays
    options = _on_node(head) if head else {}
    pool = PoolActor.options(name=pool_actor_name(name), namespace=NAMESPACE,
                             lifetime="detached", get_if_exists=True,
                             max_concurrency=100000, **options).remote(name, cfg)
    ray.get(pool.start.remote())
    return pool


def _on_node(node_id: str) -> dict:
    """Actor options that place an actor on the Ray node ``node_id`` (by the node's
    built-in ``ray.io/node-id`` label) and let Ray restart it on another node once
    that one is gone. (NodeAffinitySchedulingStrategy's soft mode spreads actors over
    the nodes even while the node asked for is alive and has room.)"""
    return {"label_selector": {"ray.io/node-id": node_id},
            "fallback_strategy": [{"label_selector": {}}]}


def _head_node() -> Optional[str]:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return None


def get_pool(name: str = "default"):
    _caches_current()
    pool = _pools.get(name)
    if pool is not None:
        return pool
    try:
        pool = ray.get_actor(pool_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        raise SandmanError("no pool named %r: create it with sandman_ray.create_pool(%r)"
                           % (name, name)) from None
    _pools[name] = pool
    return pool


def shutdown_pool(name: str = "default") -> int:
    """Delete every sandbox of the pool and stop it; returns how many were deleted."""
    pool = get_pool(name)
    try:
        return ray.get(pool.shutdown.remote())
    finally:  # also when the provider could not delete everything: the error says so
        ray.kill(pool, no_restart=True)
        _pools.pop(name, None)


def _client_id() -> str:
    ctx = ray.get_runtime_context()
    return "%s/%s" % (ctx.get_job_id(), ctx.get_worker_id()[:12] or os.getpid())


def _pool_for(pool: str):
    try:
        return get_pool(pool)
    except SandmanError:
        if pool != "default":
            raise
        return create_pool("default")


def _request_lease(pool: str, spec: SpecLike, client: Optional[str], timeout: float):
    """The pool's ``lease`` call (an ObjectRef), under a task name the Ray dashboard
    shows."""
    return _pool_for(pool).lease.options(name="sandman:lease:%s" % pool).remote(
        SandboxSpec.of(spec), client or _client_id(), timeout)


def _host(node_id: Optional[str]):
    """This process's HandleHost on ``node_id`` (anywhere for None), started once."""
    key = node_id or ""
    with _hosts_lock:
        host = _hosts.get(key)
        if host is None:
            name = "%s%s-%s" % (HOST_PREFIX, ray.get_runtime_context().get_worker_id()[:12],
                                uuid.uuid4().hex[:6])
            options = {"name": name, "namespace": NAMESPACE}
            if node_id:  # when the node dies, Ray restarts the host elsewhere to say SandboxLost
                options.update(_on_node(node_id))
            host = _hosts[key] = HandleHost.options(**options).remote(name)
        return host


def _forget_host(node_id: Optional[str], host) -> None:
    with _hosts_lock:
        if _hosts.get(node_id or "") is host:
            del _hosts[node_id or ""]


def acquire(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
            client: Optional[str] = None) -> SandboxHandle:
    """Lease a sandbox and return its SandboxHandle (use it like an actor handle, with
    ``ray.get``). Raises AcquireTimeout when none is ready within ``timeout`` seconds."""
    _pool_for(pool)  # no pool: fails here
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        lease = _lease(pool, spec, client, deadline)
        host = _host(lease.node_id)
        try:
            ray.get(host.bind.remote(lease))
            return SandboxHandle(host, lease.lease_id, lease.sandbox_id, lease.node_id, lease.pool)
        except BaseException as exc:
            _after_failed_bind(lease, host, exc, attempt, deadline)


def _lease(pool: str, spec: SpecLike, client: Optional[str], deadline: float):
    for attempt in range(POOL_RESTART_RETRIES + 1):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            return ray.get(_request_lease(pool, spec, client, left), timeout=left + 30)
        except ray.exceptions.GetTimeoutError:
            raise AcquireTimeout("pool %s did not answer within %.0f s" % (pool, left + 30))
        except BaseException as exc:
            time.sleep(_retry_after(exc, attempt, deadline))


async def acquire_async(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
                        client: Optional[str] = None) -> SandboxHandle:
    """``acquire`` for async actors and tasks: ``handle = await acquire_async(...)``."""
    _pool_for(pool)
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        lease = await _lease_async(pool, spec, client, deadline)
        host = _host(lease.node_id)
        try:
            await host.bind.remote(lease)
            return SandboxHandle(host, lease.lease_id, lease.sandbox_id, lease.node_id, lease.pool)
        except BaseException as exc:
            _after_failed_bind(lease, host, exc, attempt, deadline)


async def _lease_async(pool: str, spec: SpecLike, client: Optional[str], deadline: float):
    for attempt in range(POOL_RESTART_RETRIES + 1):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            return await asyncio.wait_for(_request_lease(pool, spec, client, left), left + 30)
        except asyncio.TimeoutError:
            raise AcquireTimeout("pool %s did not answer within %.0f s" % (pool, left + 30))
        except BaseException as exc:
            await asyncio.sleep(_retry_after(exc, attempt, deadline))


def _after_failed_bind(lease, host, exc: BaseException, attempt: int, deadline: float) -> None:
    """A host could not take ``lease``; returns to ask for another lease, else raises.
    A host that died for good is replaced and the lease given back to the pool. A
    sandbox found gone (its node or agent just died; the host gave the lease back) is
    replaced by another lease while the acquire has time. Otherwise (cancelled,
    interrupted, or the pool failed during the bind) the host is asked to give the
    lease back, whether or not it took it."""
    last = attempt + 1 >= BIND_ATTEMPTS or time.monotonic() >= deadline
    if isinstance(exc, ray.exceptions.ActorDiedError) \
            and not isinstance(exc, ray.exceptions.RayTaskError):  # the host, not the pool
        _forget_host(lease.node_id, host)
        try:
            get_pool(lease.pool).release.remote(lease.lease_id)
        except SandmanError:
            pass  # the pool is gone too
    elif not isinstance(exc, SandboxLost):
        host.release.remote(lease.lease_id, lease.pool)
        raise exc
    if last:
        raise exc


def release(handle: SandboxHandle) -> None:
    """End the lease; the sandbox is reset for the next user (or deleted). A handle
    whose host died is released quietly: the pool reclaims the leases of a dead host."""
    handle._released()
    try:
        ray.get(handle._host.release.remote(handle.lease_id, handle.pool))
    except ray.exceptions.RayActorError as exc:
        if isinstance(exc, ray.exceptions.RayTaskError):  # raised in the host: the pool's
            raise


async def release_async(handle: SandboxHandle) -> None:
    handle._released()
    try:
        await handle._host.release.remote(handle.lease_id, handle.pool)
    except ray.exceptions.RayActorError as exc:
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise


def _retry_after(exc: BaseException, attempt: int, deadline: float) -> float:
    """After a failed lease request: how long to wait before asking again, or re-raise.
    Only a PoolActor that Ray is restarting is asked again, until the acquire's
    deadline. A sandbox the dead incarnation lent is reclaimed: no host registers it."""
    if not isinstance(exc, ray.exceptions.ActorUnavailableError) \
            or attempt >= POOL_RESTART_RETRIES or time.monotonic() >= deadline:
        raise exc
    return min(0.05 * 2 ** attempt, 1.0, max(deadline - time.monotonic(), 0.0))


@contextlib.contextmanager
def sandbox(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0):
    """``with sandman_ray.sandbox() as sb: ray.get(sb.exec.remote("ls"))``"""
    handle = acquire(spec, pool, timeout)
    try:
        yield handle
    finally:
        release(handle)
