"""The public API: pools, acquire and release, a context manager."""

import asyncio
import contextlib
import os
import threading
import time
import uuid
from typing import Dict, Iterator, List, Optional, Sequence, Union

import ray

from sandman_ray.direct import Direct
from sandman_ray.errors import AcquireTimeout, SandboxLost, SandmanError
from sandman_ray.handle import SandboxHandle
from sandman_ray.host import HandleHost
from sandman_ray.lookup import current, forget_pool, get_pool, looked_up_again, session_cache
from sandman_ray.pool.actor import PoolActor
from sandman_ray.names import HOST_PREFIX, NAMESPACE, pool_actor_name, pool_task_name
from sandman_ray.providers.base import reachable
from sandman_ray.pool.states import pack_lease_request, unpack_lease
from sandman_ray.pool_calls import asking, carried, carried_async
from sandman_ray.raised import plain_errors
from sandman_ray.spec import ANYWHERE, DEFAULT_IMAGE, PoolConfig, SandboxSpec, check_pool_name

SpecLike = Union[SandboxSpec, str, dict]
BIND_ATTEMPTS = 3  # leases an acquire takes when the sandboxes it is lent turn out gone

# node id ("" for anywhere) -> this process's HandleHost, forgotten with its Ray session
_hosts: Dict[str, object] = session_cache({})
_hosts_lock = threading.Lock()

# The pool's process runs some thirty threads (Ray's and its own); glibc gives each its
# own malloc arena, and over a day of leases their free space fragments: the pool's RSS
# climbed ~2 MB per 10,000 lease cycles while Python's allocations stayed flat. Two
# arenas hold it flat (bench/soak.py), and the pool starts no processes to inherit it.
POOL_ENV = {"MALLOC_ARENA_MAX": "2"}


@plain_errors
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
                             max_concurrency=100000, runtime_env={"env_vars": POOL_ENV},
                             **options).remote(name, cfg)
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


@plain_errors
def shutdown_pool(name: str = "default") -> int:
    """Delete every sandbox of the pool and stop it; returns how many were deleted."""
    pool = get_pool(name)
    try:
        try:
            return ray.get(pool.shutdown.remote())
        except ray.exceptions.ActorDiedError:  # a cached actor, the pool created anew since
            pool = looked_up_again(name, pool)
            if pool is None:
                raise
            return ray.get(pool.shutdown.remote())
    finally:  # also when the provider could not delete everything: the error says so
        if pool is not None:
            ray.kill(pool, no_restart=True)
        forget_pool(name)


@plain_errors
def prefetch(pool: str, images: Sequence[str], nodes: Optional[Sequence[str]] = None,
             timeout: float = 3600.0) -> List[dict]:
    """Fetch and unpack ``images`` on the pool's nodes (``nodes``: those Ray node ids;
    None: all) ahead of the sandboxes that will need them, paced like the pool's
    creates. One dict per image and node, in order: ``image``, ``node_id``, ``ok``,
    ``ready_s`` (seconds from the call until it was ready), and ``digest`` or
    ``error``. An image past the node's cache budget may be evicted again before it
    is used."""
    if isinstance(images, str) or isinstance(nodes, str):
        raise ValueError("prefetch takes lists of images and nodes, got %r and %r"
                         % (images, nodes))
    images, nodes = list(images), None if nodes is None else list(nodes)
    return ray.get(get_pool(pool).prefetch.remote(images, nodes), timeout=timeout)


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


class _Host:
    """This process's handle host on one node: its actor, its name (the holder the
    pool knows) and whether it has answered once (started)."""

    __slots__ = ("actor", "name", "started")

    def __init__(self, actor, name: str):
        self.actor, self.name, self.started = actor, name, False

    def started_ref(self):
        """An ObjectRef that resolves once the host runs (None: it answered before)."""
        return None if self.started else self.actor.__ray_ready__.remote()


def _host(node_id: Optional[str]) -> _Host:
    """This process's HandleHost on ``node_id`` (anywhere for None), started once
    (without waiting for it)."""
    current()  # hosts of an earlier Ray session name actors that are gone
    key = node_id or ""
    with _hosts_lock:
        host = _hosts.get(key)
        if host is None:
            name = "%s%s-%s" % (HOST_PREFIX, ray.get_runtime_context().get_worker_id()[:12],
                                uuid.uuid4().hex[:6])
            options = {"name": name, "namespace": NAMESPACE}
            if node_id:  # when the node dies, Ray restarts the host elsewhere to say SandboxLost
                options.update(_on_node(node_id))
            host = _hosts[key] = _Host(HandleHost.options(**options).remote(), name)
        return host


def _forget_host(node_id: Optional[str], host: _Host) -> None:
    with _hosts_lock:
        if _hosts.get(node_id or "") is host:
            del _hosts[node_id or ""]


@plain_errors
def prepare(pool: str = "default") -> None:
    """Find ``pool`` (the default pool is created if missing) and start this process's
    handle host on this node, and wait for both: a rollout worker that calls it as it
    starts pays for neither at its first acquire. (``acquire`` starts the host too,
    while the pool finds it a sandbox.) A host is one Ray actor process per client
    process and node: ~0.35 s of CPU to start, and see the README for its memory."""
    _pool_for(pool)
    host = _host(_this_node())
    started = host.started_ref()
    if started is not None:
        ray.get(started)
        host.started = True


@plain_errors
def acquire(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
            client: Optional[str] = None, node: Optional[str] = None,
            auto_resume: bool = False) -> SandboxHandle:
    """Lease a sandbox and return its SandboxHandle (use it like an actor handle, with
    ``ray.get``). Raises AcquireTimeout when none is ready within ``timeout`` seconds.
    ``auto_resume``: a call on the handle while it has the sandbox paused
    (``handle.pause()``) resumes it first, instead of raising SandboxPaused.

    ``node``: where the sandbox runs. By default on this process's Ray node when one is
    ready or can be created there (a sandbox ready on another node is lent rather than
    waited for), so that direct calls take its unix socket; ``"anywhere"``
    (``sandman_ray.ANYWHERE``): wherever the provider places it; a Ray node id: on that
    node only (ValueError for one that is not an alive node of the pool's provider).

    One Ray call: the pool lends the sandbox to this process's handle host on this node
    (started meanwhile if this is the first acquire), and hands the host the lease to
    connect. Only a sandbox the host cannot reach (a unix socket on another node)
    takes a second call, to the host there."""
    spec = _spec_of(spec)  # a bad spec is said before anything starts
    actor = _pool_for(pool)  # no pool: fails here
    where = _placement(node)
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        node = _this_node()
        host, lease_id = _host(node), "L-" + uuid.uuid4().hex
        started = host.started_ref()
        host_died = False
        try:
            lease = _leased(actor, host, node, pool, spec, client, deadline, lease_id, where)
            if started is not None:
                host_died = True  # an error from here on is the host's
                ray.get(started, timeout=max(deadline - time.monotonic(), 0) + 30)
                host.started = True
        except BaseException as exc:
            _after_failure(host, node, pool, lease_id, exc, attempt, deadline, host_died)
            continue
        handle = _handle_for(lease, host, node, attempt, deadline)
        if handle is not None:
            handle.auto_resume = auto_resume
            return handle


@plain_errors
async def acquire_async(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
                        client: Optional[str] = None, node: Optional[str] = None,
                        auto_resume: bool = False) -> SandboxHandle:
    """``acquire`` for async actors and tasks: ``handle = await acquire_async(...)``."""
    spec = _spec_of(spec)
    actor = _pool_for(pool)
    where = _placement(node)
    deadline = time.monotonic() + timeout
    for attempt in range(BIND_ATTEMPTS):
        node = _this_node()
        host, lease_id = _host(node), "L-" + uuid.uuid4().hex
        started = host.started_ref()
        host_died = False
        try:
            lease = await _leased_async(actor, host, node, pool, spec, client, deadline,
                                        lease_id, where)
            if started is not None:
                host_died = True
                await asyncio.wait_for(started, max(deadline - time.monotonic(), 0) + 30)
                host.started = True
        except BaseException as exc:
            _after_failure(host, node, pool, lease_id, exc, attempt, deadline, host_died)
            continue
        if reachable(lease, node):
            return _handle(_taken(lease, host), host, auto_resume)
        there = _host(lease.node_id)
        try:
            await there.actor.bind.remote(lease)
            return _handle(lease, there, auto_resume)
        except BaseException as exc:
            _after_failure(there, lease.node_id, lease.pool, lease.lease_id, exc, attempt,
                           deadline, False)


def _this_node() -> str:
    return ray.get_runtime_context().get_node_id()


def _placement(node: Optional[str]) -> Optional[str]:
    if node is not None and (not isinstance(node, str) or not node):
        raise ValueError("node must be None, %r or a Ray node id, got %r" % (ANYWHERE, node))
    return node


def _leased(actor, host: _Host, node: str, pool: str, spec: SpecLike,
            client: Optional[str], deadline: float, lease_id: str, where: Optional[str]):
    """The pool's lease of ``lease_id`` for ``host``, asked again (the same lease id: a
    restarted pool serves it once) while Ray restarts the pool (``pool_calls``)."""
    return unpack_lease(carried(
        _asking_lease(actor, host, node, pool, spec, client, deadline, lease_id, where),
        lambda: max(deadline - time.monotonic(), 0) + 30))


async def _leased_async(actor, host: _Host, node: str, pool: str, spec: SpecLike,
                        client: Optional[str], deadline: float, lease_id: str,
                        where: Optional[str]):
    return unpack_lease(await carried_async(
        _asking_lease(actor, host, node, pool, spec, client, deadline, lease_id, where),
        lambda: max(deadline - time.monotonic(), 0) + 30))


def _asking_lease(actor, host: _Host, node: str, pool: str, spec: SpecLike,
                  client: Optional[str], deadline: float, lease_id: str, where: Optional[str]):
    return asking(lambda current: _ask(current, host, node, pool, spec, client, deadline,
                                       lease_id, where),
                  actor, lambda dead: looked_up_again(pool, dead), deadline)


def _spec_of(spec: SpecLike) -> Union[SandboxSpec, str]:
    """What an acquire asks the pool for: an image string as it is (the pool reads it),
    any other spec as a SandboxSpec (a ValueError or TypeError naming what is wrong)."""
    return spec if isinstance(spec, str) else SandboxSpec.of(spec)


def _ask(actor, host: _Host, node: str, pool: str, spec: SpecLike, client: Optional[str],
         deadline: float, lease_id: str, where: Optional[str]):
    """The pool's ``lease`` call for ``host`` (an ObjectRef), under a task name the Ray
    dashboard shows."""
    return actor.lease.options(name=pool_task_name("acquire", pool)).remote(pack_lease_request(
        spec, client or _client_id(), max(deadline - time.monotonic(), 0.001), host.name,
        node, lease_id, where))


def _handle(lease, host: _Host, auto_resume: bool = False) -> SandboxHandle:
    """The handle of a lease ``host`` holds; its direct calls connect from this process
    when it reaches the daemon (sandman_ray.direct)."""
    direct = Direct(lease, host.name, get_pool(lease.pool)) \
        if reachable(lease, _this_node()) else None
    handle = SandboxHandle(host.actor, lease.lease_id, lease.sandbox_id, lease.node_id,
                           lease.pool, host_name=host.name, direct=direct,
                           auto_resume=auto_resume)
    handle.pause_between_steps = lease.pause_between_steps
    handle._controller = lease.controller if direct is not None else None
    return handle


def _taken(lease, host: _Host):
    """``lease``, handed to this process's ``host`` by this process too (without waiting):
    the pool offers it to the host as it answers, but a pool that dies right after
    its answer may never have sent the offer, and its restarted self would then take
    the sandbox back as held by no one. The host takes a lease once."""
    host.actor.take.remote(lease)
    return lease


def _handle_for(lease, host: _Host, node: str, attempt: int, deadline: float):
    """The handle of a lease this node's host holds; one it cannot reach is bound by
    the host of the sandbox's node (None: it was lost meanwhile, ask again)."""
    if reachable(lease, node):
        return _handle(_taken(lease, host), host)
    there = _host(lease.node_id)
    try:
        ray.get(there.actor.bind.remote(lease))
        return _handle(lease, there)
    except BaseException as exc:
        _after_failure(there, lease.node_id, lease.pool, lease.lease_id, exc, attempt, deadline,
                       False)
    return None


def _after_failure(host: _Host, node: str, pool: str, lease_id: str, exc: BaseException,
                   attempt: int, deadline: float, host_died: bool) -> None:
    """An acquire (or a bind) of ``lease_id`` failed or was given up; returns to ask
    again, else raises. A sandbox found gone (the host gave the lease back) is replaced
    by another while the acquire has time; a host that died for good (``host_died``:
    the error came from it) is replaced and the lease cancelled at the pool. Whatever
    else happened (cancelled, interrupted, timed out, the pool's own error), the host
    cancels the request, so that no lease is kept, whether or not it was lent."""
    last = attempt + 1 >= BIND_ATTEMPTS or time.monotonic() >= deadline
    if isinstance(exc, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError)) \
            and not isinstance(exc, AcquireTimeout):
        exc = AcquireTimeout("pool %s did not answer the acquire in time" % pool)
    if host_died and isinstance(exc, ray.exceptions.ActorDiedError) \
            and not isinstance(exc, ray.exceptions.RayTaskError):
        _forget_host(node, host)
        try:
            get_pool(pool).cancel.remote(lease_id, host.name)
        except SandmanError:
            pass  # the pool is gone too
    elif not isinstance(exc, SandboxLost):
        try:
            host.actor.cancel.remote(pool, lease_id)
        except Exception:  # noqa: BLE001 - a dead host holds nothing; the pool reclaims
            pass
        raise exc
    if last:
        raise exc


@plain_errors
def release(handle: SandboxHandle) -> None:
    """End the lease; the sandbox is reset for the next user (or deleted). The host
    stops forwarding and the pool ends the lease, both at once (asked again while Ray
    restarts the pool). A handle whose host died is released at the pool all the
    same."""
    carried(_releasing(handle))


@plain_errors
async def release_async(handle: SandboxHandle) -> None:
    await carried_async(_releasing(handle))


def _releasing(handle: SandboxHandle):
    """A release's plan (``pool_calls``): the host's release and the pool's are sent
    together, the pool's made again while Ray restarts the pool; it raises what the
    release must."""
    host_ref, ask_pool = _release_calls(handle)
    pool_plan = asking(ask_pool, get_pool(handle.pool), lambda dead: None) \
        if ask_pool else None
    pool_step = next(pool_plan) if pool_plan is not None else None  # (sent at once)
    ok, value = yield host_ref
    errors = [None if ok else value]
    if pool_plan is not None:
        try:
            while True:
                pool_step = pool_plan.send((yield pool_step))
        except StopIteration:
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - sorted out below
            errors.append(exc)
    _check_released(errors)


def _release_calls(handle: SandboxHandle) -> tuple:
    """The host's release (an ObjectRef, sent now) and how to ask the pool's of a pool
    actor (a handle that does not name its host leaves the pool's to the host: None)."""
    handle._released()
    if handle._host_name is None:
        return handle._host.release.remote(handle.lease_id, handle.pool), None
    named = ("%s\0%s" % (handle.lease_id, handle._host_name)).encode()
    return handle._host.drop.remote(handle.lease_id), lambda pool: pool.release.remote(named)


def _check_released(errors: list) -> None:
    """Raise what a release must (``errors``: the host's, then the pool's, None for
    none): the pool's refusal (LeaseNotHeld), an error raised in the host; not a host
    that is gone (the pool ended the lease, or reclaims it)."""
    for i, exc in enumerate(errors):
        host_gone = i == 0 and isinstance(exc, ray.exceptions.RayActorError) and \
            not isinstance(exc, ray.exceptions.RayTaskError)
        if exc is not None and not host_gone:
            raise exc


@contextlib.contextmanager
def sandbox(spec: SpecLike = DEFAULT_IMAGE, pool: str = "default", timeout: float = 60.0,
            node: Optional[str] = None, auto_resume: bool = False) -> Iterator[SandboxHandle]:
    """``with sandman_ray.sandbox() as sb: ray.get(sb.exec.remote("ls"))``"""
    handle = acquire(spec, pool, timeout, node=node, auto_resume=auto_resume)
    try:
        yield handle
    finally:
        release(handle)
