"""Everything the reconciler asks of Ray, in one class, and the clock it reads.

``RayCluster`` answers which handle hosts are alive (by name) and which leases of a
pool they hold (a restarted pool's record of its leases), hands a host the leases it
holds and tells it of those that ended (each host's handle is looked up by name once,
and dropped once the host is gone), and answers which Ray nodes are alive. Every call
that crosses the network runs off the pool's event loop. The unit tests give the
reconciler a fake of it instead, and a fake ``Clock``.
"""

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Deque, Dict, Optional, Tuple

import ray

from sandman_ray.names import HOST_PREFIX, NAMESPACE

logger = logging.getLogger(__name__)

HOSTS_ANSWER_S = 10.0  # how long a restarted pool waits for the hosts' leases


class Clock:
    """The reconciler's time: monotonic for decisions, wall for records and events."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    @staticmethod
    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)


class RayCluster:
    def __init__(self):
        self.host_thread: Optional[ThreadPoolExecutor] = None  # telling hosts
        # host name -> its actor handle, looked up once (on the host thread)
        self.hosts: Dict[str, object] = {}
        # offers sent and not yet answered: (host name, the ref of its ``take``); and
        # hosts found gone when an offer was to be sent (appended from the host thread)
        self.offers: Deque[Tuple[str, object]] = collections.deque()
        self.gone_at_offer: Deque[str] = collections.deque()

    async def live_hosts(self) -> set:
        names = await asyncio.get_running_loop().run_in_executor(None, live_host_names)
        if self.host_thread is not None:
            self.host_thread.submit(self.forget_hosts, names)
        return names

    async def answered_hosts(self) -> set:
        """The hosts that answered an offer (or were found gone when one was sent)
        since the last call: each existed, so its death ends every lease it holds."""
        if not self.offers and not self.gone_at_offer:
            return set()
        return await asyncio.get_running_loop().run_in_executor(None, self._answered)

    def _answered(self) -> set:
        answered = set()
        while self.gone_at_offer:
            answered.add(self.gone_at_offer.popleft())
        pending = []
        while self.offers:
            pending.append(self.offers.popleft())
        if pending:
            ready, _ = ray.wait([ref for _, ref in pending], num_returns=len(pending),
                                timeout=0, fetch_local=False)
            done = set(ready)
            for host, ref in pending:
                if ref in done:  # taken, or failed because the host died: it existed
                    answered.add(host)
                else:
                    self.offers.append((host, ref))
        return answered

    async def alive_nodes(self) -> set:
        return await asyncio.get_running_loop().run_in_executor(None, alive_nodes)

    # ---- leases
    async def held_leases(self, pool: str) -> Dict[str, tuple]:
        """sandbox id -> (Lease, host name) for every lease of ``pool`` that a live host
        holds (a restarted pool's record of its leases). A host that does not answer
        within HOSTS_ANSWER_S counts as holding none."""
        names = await self.live_hosts()
        return await asyncio.get_running_loop().run_in_executor(None, _held_by, names, pool)

    # ---- hosts
    def offer(self, host: str, lease) -> None:
        """Hand the host named ``host`` the lease it now holds (it connects to the
        sandbox before its client's first call arrives)."""
        self._to_host(host, "take", lease)

    def tell_host(self, host: str, lease_id: str, reason: str) -> None:
        """Tell the host named ``host`` that ``lease_id`` ended."""
        self._to_host(host, "lease_ended", lease_id, reason)

    def _to_host(self, host: str, method: str, *args) -> None:
        """A call to the host named ``host``, without waiting for its answer: sent at
        once when its handle is known (an offer then reaches the host about when the
        lease's answer reaches the client), else from a thread that looks the name up
        (a GCS call; never on the event loop)."""
        actor = self.hosts.get(host)
        if actor is not None:
            try:
                self._call(host, actor, method, args)
                return
            except Exception:  # noqa: BLE001 - gone: the thread looks it up again
                self.hosts.pop(host, None)
        if self.host_thread is None:
            self.host_thread = ThreadPoolExecutor(1, thread_name_prefix="sandman-hosts")
        self.host_thread.submit(self._send, host, method, args)

    def _send(self, host: str, method: str, args: tuple) -> None:
        actor = self.hosts.get(host)
        if actor is None:
            try:
                actor = self.hosts[host] = ray.get_actor(host, namespace=NAMESPACE)
            except ValueError:  # gone: nothing holds the lease any more
                if method == "take":
                    self.gone_at_offer.append(host)
                return
        try:
            self._call(host, actor, method, args)
        except Exception:  # noqa: BLE001 - a host that died meanwhile holds nothing
            self.hosts.pop(host, None)
            logger.debug("host %s could not be sent %s%r", host, method, args[:1])

    def _call(self, host: str, actor, method: str, args: tuple) -> None:
        ref = getattr(actor, method).remote(*args)
        if method == "take":  # its answer shows the host existed (answered_hosts)
            self.offers.append((host, ref))

    def forget_hosts(self, live: set) -> None:
        """Drop the handles of hosts that are no longer among the ``live`` ones."""
        for name in [n for n in list(self.hosts) if n not in live]:
            self.hosts.pop(name, None)


def _held_by(names: set, pool: str) -> Dict[str, tuple]:
    asked = {}
    for name in names:
        try:
            asked[ray.get_actor(name, namespace=NAMESPACE).leases.remote(pool)] = name
        except ValueError:  # gone meanwhile: it holds nothing
            continue
    if not asked:
        return {}
    ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=HOSTS_ANSWER_S)
    found = {}
    for ref in ready:
        try:
            leases = ray.get(ref)
        except ray.exceptions.RayError:
            continue
        for lease in leases:
            found[lease.sandbox_id] = (lease, asked[ref])
    return found


def alive_nodes() -> set:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def live_host_names() -> set:
    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith(HOST_PREFIX)}
