"""This process's pool actor handles, looked up once (a name lookup is a GCS call) and
forgotten with the Ray session they belong to (after ``ray.shutdown()`` and a new
``ray.init()`` they name actors that are gone). A handle that turns out dead, the pool
shut down and created anew by another process, is looked up once more
(``call_pool``)."""

import threading
from typing import Dict, Optional

import ray

from sandman_ray.errors import SandmanError
from sandman_ray.spec import check_pool_name
from sandman_ray.names import NAMESPACE, pool_actor_name
from sandman_ray.pool_calls import another, asking, carried, carried_async

_pools: Dict[str, object] = {}  # pool name -> actor handle
_cached_for = [None]  # the Ray session the caches belong to
_lock = threading.Lock()
# other caches of this process's actors (api's handle hosts), emptied with this one
_session_caches: list = [_pools]


def ray_session() -> tuple:
    """What names this process's Ray session: caches of actors belong to one."""
    ctx = ray.get_runtime_context()
    return (ctx.gcs_address, ctx.get_node_id(), ctx.get_job_id())


def current() -> None:
    """Empty every cache of actors that belong to an earlier Ray session."""
    session = ray_session()
    if _cached_for[0] != session:
        with _lock:
            if _cached_for[0] != session:
                for cache in _session_caches:
                    cache.clear()
                _cached_for[0] = session


def session_cache(cache: dict) -> dict:
    """``cache`` (of actor handles), emptied by ``current`` with a new Ray session."""
    _session_caches.append(cache)
    return cache


def get_pool(name: str = "default", refresh: bool = False):
    """The pool's actor handle, looked up once per process; ``refresh``: look it up
    again (a pool shut down and created anew by another process is a new actor)."""
    current()
    pool = None if refresh else _pools.get(name)
    if pool is not None:
        return pool
    check_pool_name(name)  # a name that no pool can have is the caller's mistake: say so
    try:
        pool = ray.get_actor(pool_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        raise SandmanError("no pool named %r: create it with sandman_ray.create_pool(%r)"
                           % (name, name)) from None
    _pools[name] = pool
    return pool


def forget_pool(name: str, pool: Optional[object] = None) -> None:
    """Drop the cached handle of pool ``name`` (only if it is ``pool``, when given)."""
    with _lock:
        if pool is None or _pools.get(name) is pool:
            _pools.pop(name, None)


def looked_up_again(name: str, pool):
    """The pool's handle looked up anew, once ``pool`` (a cached one) turned out dead;
    None when it is the same actor (the pool itself is gone)."""
    forget_pool(name, pool)
    return another(get_pool(name, refresh=True), pool)


def call_pool(name: str, method: str, *args):
    """``ray.get`` of one call to pool ``name``, made again while Ray restarts the pool,
    and of the pool looked up once more when a cached handle's actor is dead
    (``pool_calls``)."""
    return carried(_asking(name, method, args))


async def call_pool_async(name: str, method: str, *args):
    """``call_pool`` for asyncio code."""
    return await carried_async(_asking(name, method, args))


def _asking(name: str, method: str, args: tuple):
    return asking(lambda actor: getattr(actor, method).remote(*args), get_pool(name),
                  lambda dead: looked_up_again(name, dead))


_named: Dict[str, object] = session_cache({})  # actor name -> handle (pause controllers)


def get_named(name: str):
    """The actor named ``name`` in the ``sandman`` namespace, looked up once per
    process (None when there is none); ``forget_named`` drops one found dead."""
    current()
    actor = _named.get(name)
    if actor is None:
        try:
            actor = _named[name] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
    return actor


def forget_named(name: str) -> None:
    _named.pop(name, None)


# node controllers' control sockets (sandman_ray.control), by controller name: asked of
# each once per process (None: it serves none, and is asked by Ray calls)
_control_paths: Dict[str, Optional[str]] = session_cache({})


def control_path(name: str, controller) -> Optional[str]:
    """The control socket of ``controller``, the actor named ``name`` (RayActorError
    when it is gone)."""
    current()
    if name not in _control_paths:
        try:
            _control_paths[name] = ray.get(controller.control_address.remote())
        except ray.exceptions.RayTaskError:  # it could not serve one
            _control_paths[name] = None
    return _control_paths[name]


async def control_path_async(name: str, controller) -> Optional[str]:
    """``control_path`` for asyncio code."""
    current()
    if name not in _control_paths:
        try:
            _control_paths[name] = await controller.control_address.remote()
        except ray.exceptions.RayTaskError:
            _control_paths[name] = None
    return _control_paths[name]


def forget_control_path(name: str) -> None:
    """A control socket that did not answer: asked for again next time."""
    _control_paths.pop(name, None)
