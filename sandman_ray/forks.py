"""Snapshots, forks and pauses: one prepared state, many rollouts.

    snap = sandman.snapshot(sb)              # "snapshot:<pool>/<name>": an image
    sandman.set_warm(snap, 8)                # 8 sandboxes of it kept READY
    forks = sandman.fork(sb, 8)              # 8 leases that start from sb's files
    sandman.pause(sb); sandman.resume(sb)    # frozen: no CPU, memory kept

A snapshot is the sandbox's files (its writable layer over its image), owned by the
sandbox's pool: listed with its size (``snapshots``), deleted by ``delete_snapshot``,
and all of them with the pool. A fork is a snapshot plus ``n`` acquires of it, paced
and owned like any other: each fork is a lease of its own, independent afterwards,
and starts in the working directory and with the exported variables of ``sb``'s
default session (``sb.run``). Processes are not carried: a fork starts with its
daemon alone. The snapshot a fork takes is deleted with the last sandbox started from
it (``keep_snapshot=True`` keeps it).

A paused lease is not reclaimed for idleness, but its TTL still runs; calls to its
daemon wait until ``resume`` (its daemon is frozen too). Releasing a paused sandbox
thaws it before it is reset for the next holder.
"""

from typing import List, Optional

from sandman_ray.api import SpecLike, acquire_async, get_pool, release_async
from sandman_ray.handle import SandboxHandle
from sandman_ray.lookup import call_pool, call_pool_async
from sandman_ray.forking import (
    SESSION_STATE, check_count, run_to_end, session_state, start_forks)
from sandman_ray.raised import plain_errors
from sandman_ray.spec import SandboxSpec


def _pool_of(handle: SandboxHandle):
    if not isinstance(handle, SandboxHandle):
        raise TypeError("expected a SandboxHandle (from sandman_ray.acquire), got %r"
                        % (handle,))
    return get_pool(handle.pool)


@plain_errors
def snapshot(handle: SandboxHandle, name: Optional[str] = None) -> str:
    """Capture ``handle``'s files as a snapshot of its pool; the image reference that
    starts sandboxes from it (``SandboxSpec(image=...)``, ``acquire(...)``). ``name``:
    1 to 63 letters, digits, '.', '_' or '-' (default: a new one)."""
    _pool_of(handle)
    return call_pool(handle.pool, "snapshot", handle.lease_id, handle._host_name, name,
                     False)["image"]


@plain_errors
def snapshots(pool: str = "default") -> List[dict]:
    """The pool's snapshots: name, image, base, size_bytes, node_id, source,
    created_at, and the sandboxes started from each (``sandboxes``)."""
    return call_pool(pool, "snapshots")


@plain_errors
def delete_snapshot(snapshot: str, pool: Optional[str] = None) -> None:
    """Delete a snapshot (its image reference, or its name in ``pool``), its warm
    target and the idle sandboxes started from it. SnapshotInUse while a lease holds
    one of them."""
    if pool is None:
        if not snapshot.startswith("snapshot:"):
            raise ValueError("delete_snapshot(%r): give the snapshot's image reference "
                             "(snapshot:<pool>/<name>) or its pool" % (snapshot,))
        pool = snapshot[len("snapshot:"):].partition("/")[0]
    call_pool(pool, "delete_snapshot", snapshot)


@plain_errors
def set_warm(spec: SpecLike, count: int, pool: Optional[str] = None) -> dict:
    """Keep ``count`` READY sandboxes of ``spec`` (an image, a snapshot's included, or
    a SandboxSpec) in the pool from now on; 0 stops. The pool of a snapshot is its own
    by default. Returns the pool's warm targets by image."""
    image = spec if isinstance(spec, str) else SandboxSpec.of(spec).image
    if pool is None:
        pool = image[len("snapshot:"):].partition("/")[0] \
            if image.startswith("snapshot:") else "default"
    return call_pool(pool, "set_warm", spec, count)


def _fork_spec(info: dict) -> SandboxSpec:
    """The forks' spec: the parent's, with the snapshot as its image."""
    return SandboxSpec.from_dict(dict(info["spec"], image=info["image"]))


@plain_errors
def fork(handle: SandboxHandle, n: int, timeout: float = 60.0,
         keep_snapshot: bool = False) -> List[SandboxHandle]:
    """``n`` new leased sandboxes that start from ``handle``'s files, in the working
    directory and with the exported variables of its default session; each is
    released like any other. All or none: when one cannot be acquired within
    ``timeout``, those acquired are released and the error is raised. (``fork_async``
    on an event loop of this call's own: on a thread of its own where this thread
    already runs one, a notebook's say.)"""
    return run_to_end(fork_async(handle, n, timeout, keep_snapshot))


@plain_errors
async def fork_async(handle: SandboxHandle, n: int, timeout: float = 60.0,
                     keep_snapshot: bool = False) -> List[SandboxHandle]:
    """``fork`` for async actors and tasks: ``forks = await fork_async(sb, 8)``."""
    check_count(n)
    _pool_of(handle)
    state = session_state(await handle.run_async(SESSION_STATE))
    spec = _fork_spec(await call_pool_async(handle.pool, "snapshot", handle.lease_id,
                                            handle._host_name, None, not keep_snapshot))
    return await start_forks(lambda: acquire_async(spec, handle.pool, timeout), n, state,
                             release_async)


@plain_errors
def pause(handle: SandboxHandle, reclaim: bool = False) -> None:
    """Freeze every process of the sandbox (no CPU; memory kept) until ``resume``:
    ``handle.pause(reclaim)``."""
    _pool_of(handle)
    handle.pause(reclaim)


@plain_errors
def resume(handle: SandboxHandle) -> None:
    """Let a paused sandbox's processes run again where they stopped:
    ``handle.resume()``."""
    _pool_of(handle)
    handle.resume()
