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
    ``ray.get``). Raises AcquireTimeout when none is ready within ``timeout`` seconds.

    One Ray call: this process's handle host on this node asks the pool for the lease,
    naming itself as its holder, and connects to the sandbox. Only a sandbox it cannot
    reach (a unix socket on another node) takes a second call, to the host there."""
    _pool_for(pool)  # no pool: fails here
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        host, lease_id = _host(_this_node()), "L-" + uuid.uuid4().hex
        try:
            held, lease = ray.get(_ask(host, pool, spec, client, deadline, lease_id),
                                  timeout=max(deadline - time.monotonic(), 0) + 30)
        except BaseException as exc:
            _after_failure(host, _this_node(), pool, lease_id, exc, attempt, deadline)
            continue
        handle = _handle_for(held, lease, host, attempt, deadline)
        if handle is not None:
            return handle


async def acquire_async(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
                        client: Optional[str] = None) -> SandboxHandle:
    """``acquire`` for async actors and tasks: ``handle = await acquire_async(...)``."""
    _pool_for(pool)
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        host, lease_id = _host(_this_node()), "L-" + uuid.uuid4().hex
        try:
            held, lease = await asyncio.wait_for(
                _ask(host, pool, spec, client, deadline, lease_id),
                max(deadline - time.monotonic(), 0) + 30)
        except BaseException as exc:
            _after_failure(host, _this_node(), pool, lease_id, exc, attempt, deadline)
            continue
        if held:
            return SandboxHandle(host, lease.lease_id, lease.sandbox_id, lease.node_id, lease.pool)
        there = _host(lease.node_id)
        try:
            await there.bind.remote(lease)
            return SandboxHandle(there, lease.lease_id, lease.sandbox_id, lease.node_id,
                                 lease.pool)
        except BaseException as exc:
            _after_failure(there, lease.node_id, lease.pool, lease.lease_id, exc, attempt, deadline)


def _this_node() -> str:
    return ray.get_runtime_context().get_node_id()


def _ask(host, pool: str, spec: SpecLike, client: Optional[str], deadline: float,
         lease_id: str):
    """The host's ``acquire`` call (an ObjectRef), under a task name the Ray dashboard
    shows; ``deadline`` (monotonic here) travels as wall-clock time (the host runs on
    this node)."""
    wall = time.time() + max(deadline - time.monotonic(), 0.001)
    return host.acquire.options(name="sandman:acquire:%s" % pool).remote(
        pool, SandboxSpec.of(spec), client or _client_id(), wall, lease_id)


def _handle_for(held: bool, lease, host, attempt: int, deadline: float):
    """The handle of a lease the host holds; one the host could not reach is bound
    by the host of the sandbox's node (None: it was lost meanwhile, ask again)."""
    if held:
        return SandboxHandle(host, lease.lease_id, lease.sandbox_id, lease.node_id, lease.pool)
    there = _host(lease.node_id)
    try:
        ray.get(there.bind.remote(lease))
        return SandboxHandle(there, lease.lease_id, lease.sandbox_id, lease.node_id, lease.pool)
    except BaseException as exc:
        _after_failure(there, lease.node_id, lease.pool, lease.lease_id, exc, attempt, deadline)
    return None


def _after_failure(host, node: str, pool: str, lease_id: str, exc: BaseException,
                   attempt: int, deadline: float) -> None:
    """A host's acquire (or bind) of ``lease_id`` failed or was given up; returns to
    ask again, else raises. A sandbox found gone (the host gave the lease back) is
    replaced by another while the acquire has time; a host that died for good is
    replaced and the request cancelled at the pool. Whatever else happened (cancelled,
    interrupted, timed out, the pool's own error), the host cancels the request, so
    that no lease is kept, whether or not it took it."""
    last = attempt + 1 >= BIND_ATTEMPTS or time.monotonic() >= deadline
    if isinstance(exc, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError)) \
            and not isinstance(exc, AcquireTimeout):
        exc = AcquireTimeout("pool %s did not answer the acquire in time" % pool)
    if isinstance(exc, ray.exceptions.ActorDiedError) \
            and not isinstance(exc, ray.exceptions.RayTaskError):  # the host, not the pool
        _forget_host(node, host)
        try:
            get_pool(pool).cancel.remote(lease_id)
        except SandmanError:
            pass  # the pool is gone too
    elif not isinstance(exc, SandboxLost):
        try:
            host.cancel.remote(pool, lease_id)
        except Exception:  # noqa: BLE001 - a dead host holds nothing; the pool reclaims
            pass
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


@contextlib.contextmanager
def sandbox(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0):
    """``with sandman_ray.sandbox() as sb: ray.get(sb.exec.remote("ls"))``"""
    handle = acquire(spec, pool, timeout)
    try:
        yield handle
    finally:
        release(handle)
