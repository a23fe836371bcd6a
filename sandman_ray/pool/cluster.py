"""Everything the reconciler asks of Ray, in one class, and the clock it reads.

``RayCluster`` answers which handle hosts are alive (by name, never by reference: a
reference would keep a host alive), which Ray nodes are alive, keeps lease records in
the GCS key-value store, and tells a host that one of its leases ended. Every call
that crosses the network runs off the pool's event loop. The unit tests give the
reconciler a fake of it instead, and a fake ``Clock``.
"""

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import ray

logger = logging.getLogger(__name__)

NAMESPACE = "sandman"
KV_NAMESPACE = "sandman"
HOST_PREFIX = "sandman:sbx:"  # the names of handle hosts


def pool_actor_name(pool: str) -> str:
    return "sandman:pool:%s" % pool


class Clock:
    """The reconciler's time: monotonic for decisions, wall for records and events."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    @staticmethod
    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)


class RayCluster:
    def __init__(self):
        self.kv_thread: Optional[ThreadPoolExecutor] = None    # lease records, in order
        self.host_thread: Optional[ThreadPoolExecutor] = None  # telling hosts

    async def live_hosts(self) -> set:
        return await asyncio.get_running_loop().run_in_executor(None, live_host_names)

    async def alive_nodes(self) -> set:
        return await asyncio.get_running_loop().run_in_executor(None, alive_nodes)

    # ---- lease records
    def _kv(self, fn, *args):
        """A GCS key-value call, off the event loop (each is a network round trip), in
        order (one thread)."""
        if self.kv_thread is None:
            self.kv_thread = ThreadPoolExecutor(1, thread_name_prefix="sandman-kv")
        return self.kv_thread.submit(fn, *args, namespace=KV_NAMESPACE)

    def persist(self, key: str, record: dict) -> None:
        from ray.experimental import internal_kv
        self._kv(internal_kv._internal_kv_put, key, json.dumps(record))

    def forget(self, key: str) -> None:
        from ray.experimental import internal_kv
        self._kv(internal_kv._internal_kv_del, key)

    async def recall(self, key: str) -> Optional[dict]:
        from ray.experimental import internal_kv
        raw = await asyncio.wrap_future(self._kv(internal_kv._internal_kv_get, key))
        return json.loads(raw) if raw else None

    # ---- hosts
    def tell_host(self, host: str, lease_id: str, reason: str) -> None:
        """Tell the host named ``host`` that ``lease_id`` ended, off the event loop (a
        name lookup is a GCS call). The host's handle is dropped at once."""
        if self.host_thread is None:
            self.host_thread = ThreadPoolExecutor(1, thread_name_prefix="sandman-hosts")
        self.host_thread.submit(_tell_host, host, lease_id, reason)


def _tell_host(host: str, lease_id: str, reason: str) -> None:
    try:
        actor = ray.get_actor(host, namespace=NAMESPACE)
    except ValueError:  # gone: nothing holds the lease any more
        return
    try:
        actor.lease_ended.remote(lease_id, reason)
    except Exception:  # noqa: BLE001 - a host that died meanwhile holds nothing
        logger.debug("host %s could not be told that %s ended", host, lease_id)


def alive_nodes() -> set:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def live_host_names() -> set:
    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith(HOST_PREFIX)}
