"""The public API: pools, acquire and release, a context manager."""

import asyncio
import contextlib
import os
import threading
import time
import uuid
from typing import Dict, List, Optional, Union

import ray

from sandman_ray.errors import AcquireTimeout, SandmanError
from sandman_ray.handle import SandboxHandle
from sandman_ray.pool.actor import NAMESPACE, PoolActor, handle_name_prefix, pool_actor_name
from sandman_ray.spec import PoolConfig, SandboxSpec

SpecLike = Union[SandboxSpec, str]
MAX_IDLE_HANDLES = 64  # released handles this process keeps for the next acquires
POOL_RESTART_RETRIES = 20  # times a lease request is asked again of a restarting PoolActor

_idle: Dict[str, List] = {}   # node id -> idle handles
_idle_lock = threading.Lock()
_pools: Dict[str, object] = {}  # pool name -> actor handle (a name lookup is a GCS call)
_cached_for = [None]  # the Ray session the two caches above belong to


def _caches_current() -> None:
    """Forget handles and pools of an earlier Ray session of this process (after
    ``ray.shutdown()`` and a new ``ray.init()`` they name actors that are gone)."""
    ctx = ray.get_runtime_context()
    session = (ctx.gcs_address, ctx.get_node_id())
    if _cached_for[0] != session:
        with _idle_lock:
            _idle.clear()
            _pools.clear()
            _cached_for[0] = session


def create_pool(name: str = "default", provider=None, *, warm=None, **config):
    """Create the pool ``name`` (or return it if it exists): a detached actor that
    outlives this driver. ``config`` takes the fields of ``PoolConfig``."""
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


def _request_lease(pool: str, spec: SpecLike, client: Optional[str], timeout: float,
                   handle_name: str):
    """The pool's ``lease`` call (an ObjectRef), under a task name the Ray dashboard
    shows."""
    return _pool_for(pool).lease.options(name="sandman:lease:%s" % pool).remote(
        SandboxSpec.of(spec), client or _client_id(), timeout, handle_name)


def _take_idle():
    """An idle handle of this process, or None. Its name goes with the lease request:
    if the lease lands on its node it holds the lease without registering again."""
    with _idle_lock:
        for handles in _idle.values():
            if handles:
                return handles.pop()
    return None


def _holder(lease, pool: str, idle, claimed: str):
    """(handle, must_register): ``idle`` when the lease is on its node; else a new
    handle on the lease's node, named ``claimed`` when that name is free (the pool
    already watches it), else a fresh name that must register with the pool."""
    if idle is not None and getattr(idle, "_sandman_node", None) == lease.node_id:
        return idle, False
    must_register = idle is not None
    if idle is not None:
        _keep_idle(idle)
    name = _new_handle_name() if must_register else claimed
    options = {"name": name, "namespace": NAMESPACE}
    if lease.node_id:  # when the node dies, Ray restarts the handle elsewhere to say SandboxLost
        options.update(_on_node(lease.node_id))
    handle = SandboxHandle.options(**options).remote(name, pool_actor_name(pool))
    handle._sandman_node, handle._sandman_name = lease.node_id, name
    return handle, must_register


def _new_handle_name() -> str:
    return handle_name_prefix() + uuid.uuid4().hex[:12]


def acquire(spec: SpecLike = "host", pool: str = "default", timeout: float = 60.0,
            client: Optional[str] = None):
    """Lease a sandbox and return its SandboxHandle actor (use it with ``ray.get``).
    Raises AcquireTimeout when none is ready within ``timeout`` seconds."""
    _pool_for(pool)  # no pool: fails here, before an idle handle is taken
    idle = _take_idle()
    name = idle._sandman_name if idle is not None else _new_handle_name()
    deadline = time.monotonic() + timeout
    for attempt in range(POOL_RESTART_RETRIES + 1):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            lease = ray.get(_request_lease(pool, spec, client, left, name), timeout=left + 30)
            break
        except BaseException as exc:
            _after_failed_lease(idle, exc)
            idle = None
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise AcquireTimeout("pool %s did not answer within %.0f s" % (pool, left + 30))
            time.sleep(_retry_after(exc, attempt, deadline))
            name = _new_handle_name()
    handle, must_register = _holder(lease, pool, idle, name)
    ray.get(handle.bind.remote(lease, must_register))
    return handle


async def acquire_async(spec: SpecLike = "host", pool: str = "default", timeout: float = 60.0,
                        client: Optional[str] = None):
    """``acquire`` for async actors and tasks: ``handle = await acquire_async(...)``."""
    _pool_for(pool)
    idle = _take_idle()
    name = idle._sandman_name if idle is not None else _new_handle_name()
    deadline = time.monotonic() + timeout
    for attempt in range(POOL_RESTART_RETRIES + 1):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            lease = await _request_lease(pool, spec, client, left, name)
            break
        except BaseException as exc:
            _after_failed_lease(idle, exc)
            idle = None
            await asyncio.sleep(_retry_after(exc, attempt, deadline))
            name = _new_handle_name()
    handle, must_register = _holder(lease, pool, idle, name)
    await handle.bind.remote(lease, must_register)
    return handle


def release(handle) -> None:
    """End the lease; the sandbox is reset for the next user (or deleted). The handle
    actor is kept for the next acquire in this process."""
    _after_release(handle, ray.get(handle.release.remote()))


async def release_async(handle) -> None:
    _after_release(handle, await handle.release.remote())


def _after_release(handle, reusable: bool) -> None:
    if reusable:
        _keep_idle(handle)
    else:  # Ray restarted it: it may sit on another node than the one it is filed under
        ray.kill(handle)


def _retry_after(exc: BaseException, attempt: int, deadline: float) -> float:
    """After a failed lease request: how long to wait before asking again, or re-raise.
    Only a PoolActor that Ray is restarting is asked again, until the acquire's
    deadline; the caller asks under a fresh handle name, so a sandbox the dead
    incarnation lent to the old name is reclaimed when no handle of that name appears."""
    if not isinstance(exc, ray.exceptions.ActorUnavailableError) \
            or attempt >= POOL_RESTART_RETRIES or time.monotonic() >= deadline:
        raise exc
    return min(0.05 * 2 ** attempt, 1.0, max(deadline - time.monotonic(), 0.0))


def _after_failed_lease(idle, exc: BaseException) -> None:
    """A lease request that named ``idle`` failed. When the pool refused it (an error
    of ours), ``idle`` holds nothing and is kept; when the request was cancelled or not
    answered, the pool may still lend a sandbox to that name, so the handle is killed
    and the pool's watchdog reclaims the lease."""
    if idle is None:
        return
    if isinstance(exc, SandmanError):
        _keep_idle(idle)
    else:
        ray.kill(idle)


def _keep_idle(handle) -> None:
    node = getattr(handle, "_sandman_node", None) or ""
    with _idle_lock:
        if sum(len(v) for v in _idle.values()) < MAX_IDLE_HANDLES:
            _idle.setdefault(node, []).append(handle)
            return
    ray.kill(handle)


@contextlib.contextmanager
def sandbox(spec: SpecLike = "host", pool: str = "default", timeout: float = 60.0):
    """``with sandman_ray.sandbox("host") as sb: ray.get(sb.exec.remote("ls"))``"""
    handle = acquire(spec, pool, timeout)
    try:
        yield handle
    finally:
        release(handle)
