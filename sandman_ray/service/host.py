"""The service's actor: it holds the leases of its tenants and serves them over the
network (``sandman serve``).

One ServiceHost per pool, a detached Ray actor on the node it was started from, named
under the handle hosts' prefix: to the pool it is the holder of every lease it took for
a tenant (``_HandleHost``: offered, told when a lease ends, asked by a restarted pool),
so leasing, pacing, fairness and reclaiming are the pool's own. Its leases are kept
alive by their callers (``keepalive_s``): a relayed call or a keepalive renews one, and
a client that stops (SIGKILLed, cut off) loses its leases within that time plus one
sweep of the pool.

It listens twice: the control plane (service/http.py, aiohttp) and the data plane
(service/relay.py), both on ``host``. Its leases are placed on any node of the cluster
(or the one an acquire names); a daemon's socket is on its own node, so each other node
that holds a lease gets a gateway of the service (service/gateways.py), which the lease
names (``gateway_url``), and the data plane here relays onward to it for clients that
reach only this address.
"""

import asyncio
import hashlib
import hmac
import os
import secrets
import time
from typing import Dict, Optional, Tuple

import ray

from sandman_ray import touches
from sandman_ray.errors import ProviderError
from sandman_ray.host import HOST_CALLS, _HandleHost
from sandman_ray.names import HOST_PREFIX, NAMESPACE
from sandman_ray.pool.pacing import AdaptiveTokenBucket
from sandman_ray.pool.states import pack_lease_request, unpack_lease
from sandman_ray.service.answers import Refusal
from sandman_ray.service.fusion_leases import FusionLeases
from sandman_ray.service.gateways import (onward_context, serve_at_normal_priority,
                                          server_context, start_gateway, stop_gateways)
from sandman_ray.service.relay import Gateway, Held, Refused, admitting
from sandman_ray.service.tenants import KeyStore
from sandman_ray.spec import ANYWHERE, SandboxSpec, parse_image

SERVICE_PREFIX = HOST_PREFIX + "svc-"
CLIENT_PREFIX = "svc:"  # the pool's client name of a tenant: svc:<tenant>
SLOW_AFTER = 5  # failed keys from one address a minute before each more one is slowed
FUSION_IMAGE = "builtin:code"  # SandboxFusion's requests run here (image_builders.py)


def snapshot_prefix(tenant: str) -> str:
    """What the pool's names of a tenant's snapshots begin with (10 characters)."""
    return "t%s-" % hashlib.sha256(tenant.encode()).hexdigest()[:8]


def service_name(pool: str) -> str:
    return SERVICE_PREFIX + pool


class ServiceHost(_HandleHost):
    """See the module's docstring."""

    async def start(self, pool: str, keys_path: str, host: str, port: int,
                    data_port: int, tls: Optional[Tuple[str, str]] = None,
                    slow_after: int = SLOW_AFTER,
                    fusion_image: str = FUSION_IMAGE, insecure: bool = False,
                    e2b_templates: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Listen (with TLS: ``tls`` the certificate's and its key's files); the
        control plane's and the data plane's URLs, and the serving process's pid.
        ``slow_after``: failed keys from one address a minute before each more one is
        slowed (0: never); ``fusion_image``: the image SandboxFusion's requests run in;
        ``insecure``: leases may go to other nodes without TLS (their gateways' keys
        cross the cluster's network in the clear), else only with it; ``e2b_templates``:
        E2B's templates, by name, as the images they run (over service/e2b's own)."""
        self.slow_after = slow_after
        self.fusion_image, self.fusion_carried = fusion_image, set()
        self.spread = tls is not None or insecure  # leases on other nodes
        serve_at_normal_priority()
        from aiohttp import web
        from sandman_ray.service.http import app
        context = self.tls_pem = onward = None
        if tls is not None:
            context = server_context(*tls)
            self.tls_pem = tuple(open(path).read() for path in tls)
            onward = onward_context(self.tls_pem[0])
        scheme = "https" if context else "http"
        self.pool = pool
        self.keys = KeyStore(keys_path)
        self.secret = secrets.token_bytes(32)  # request ids -> lease ids, per incarnation
        self.served: Dict[str, Tuple[str, object]] = {}  # lease id -> (tenant, Lease)
        self.per_tenant: Dict[str, int] = {}  # tenant -> leases served (not _HandleHost.held)
        self.waiting: Dict[str, int] = {}  # tenant -> acquires under way
        self.underway: Dict[str, asyncio.Future] = {}  # lease id -> its acquire
        self.fusion = FusionLeases(self)  # the leases kept for /run_code
        self.buckets: Dict[str, AdaptiveTokenBucket] = {}  # tenant -> its creates per second
        self.failures: Dict[str, list] = {}  # address -> times of its failed keys
        self.ended_for: Dict[str, str] = {}  # ended leases -> their tenant (410, not 404)
        self.gateways: Dict[str, Tuple[object, str]] = {}  # node id -> (its gateway, URL)
        self.gateway_starts: Dict[str, asyncio.Future] = {}  # node id -> its gateway's start
        stop_gateways(pool)  # an earlier incarnation's: they ask this one from now on
        from sandman_ray.service.e2b.sandboxes import Sandboxes
        self.e2b = Sandboxes(self, e2b_templates)
        self.gateway = Gateway(admitting(self.keys.verify, self._find), self._used,
                               onward_ssl=onward)
        self.data = await self.gateway.serve(host, data_port, ssl=context)
        runner = web.AppRunner(app(self, self.keys.verify), access_log=None,
                               handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=context)
        await site.start()
        self.runner = runner
        self.urls = {"url": "%s://%s:%d" % (scheme, host, runner.addresses[0][1]),
                     "data_url": "%s://%s:%d" % (scheme, host,
                                                 self.data.sockets[0].getsockname()[1])}
        await self._adopt()
        return dict(self.urls, pid=os.getpid())  # the process that serves

    async def _adopt(self) -> None:
        """The leases the pool says this service holds (a service that stopped without
        giving them back, started again under its name): served again, as they were.
        Their keepalives kept them meanwhile."""
        for lease in await self._tell_pool(self.pool, "held_by", self.name):
            if FusionLeases.holds(lease.lease_id):  # kept for requests that are over
                await self._tell_pool(self.pool, "release", lease.lease_id, self.name)
            elif lease.client.startswith(CLIENT_PREFIX) and lease.keepalive_s:
                await self._gateway_of(lease.node_id)
                self._serve(lease.client[len(CLIENT_PREFIX):], lease.lease_id, lease)
                await self.take(lease)

    async def stop(self) -> int:
        """Stop listening and give back every lease; how many there were."""
        self.data.close()
        self.e2b.close()
        await self.runner.cleanup()
        await self.fusion.close()
        ids = list(self.served)
        for lease_id in ids:
            await self.release(lease_id, self.pool)
        self.served.clear()
        self.per_tenant.clear()
        self.keys.close()
        stop_gateways(self.pool)
        return len(ids)

    def _gateway_url(self, node_id: str) -> Optional[str]:
        """The URL of the gateway that serves leases on ``node_id``: this process's
        own on its node, else that node's (None: it has none)."""
        if node_id == self.node:
            return self.urls["data_url"]
        return self.gateways[node_id][1] if node_id in self.gateways else None

    async def _gateway_of(self, node_id: str) -> str:
        """``_gateway_url``, the gateway started at the node's first lease."""
        url = self._gateway_url(node_id)
        if url is not None:
            return url
        start = self.gateway_starts.get(node_id)
        if start is None:  # one start however many acquires land there at once
            start = self.gateway_starts[node_id] = asyncio.ensure_future(
                self._start_gateway(node_id))
        try:
            return await asyncio.shield(start)
        finally:
            if start.done():
                self.gateway_starts.pop(node_id, None)

    async def _start_gateway(self, node_id: str) -> str:
        actor, url = start_gateway(self.pool, self.name, node_id, self.tls_pem)
        try:
            url = await url
        except ray.exceptions.RayError as exc:
            ray.kill(actor)
            raise ProviderError("the service's gateway on node %s did not start: %s"
                                % (node_id, exc), "transient") from None
        self.gateways[node_id] = (actor, url)
        return url

    def _serve(self, tenant: str, lease_id: str, lease) -> None:
        if lease_id not in self.served:
            self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        self.served[lease_id] = (tenant, lease)

    def renewed(self, lease_id: str, lease) -> None:
        """``lease`` (``lease_id``, served) goes on with a new token: its sandbox was
        renewed for its holder (service/fusion_leases.py)."""
        tenant = self.served[lease_id][0]
        self.served[lease_id] = (tenant, lease)
        if lease_id in self.held:  # what the pool asks of a host after its restart
            self.held[lease_id].lease = lease

    def _tenants(self, lease_id: str):
        """What the service serves a tenant under ``lease_id``: (tenant, lease), or None
        (none, or a lease the service keeps for itself)."""
        return None if FusionLeases.holds(lease_id) else self.served.get(lease_id)

    # ---- what the relay asks
    def _find(self, lease_id: str) -> Optional[Held]:
        served = self._tenants(lease_id)
        if served is None:
            return None
        tenant, lease = served
        if lease.node_id == self.node:
            return Held(tenant, lease.address, lease.token)
        onward = self._gateway_url(lease.node_id)  # one hop more: its node's gateway
        if onward is None:
            raise Refused(502, "GatewayLost", "its node's gateway is gone")
        return Held(tenant, "", "", onward)

    async def admit(self, key: Optional[str], lease_id: str, node_id: str) -> list:
        """A node's gateway asks about an upgrade for ``lease_id`` with ``key``: the
        lease's [tenant, daemon address, token] when the key is live and its tenant
        holds the lease on that node, else ["refused", status, type, message]."""
        served = self._tenants(lease_id)
        try:
            if served is not None and served[1].node_id != node_id:
                served = None  # a gateway learns only of its own node's leases
            held = await admitting(self.keys.verify, lambda _: served and Held(
                served[0], served[1].address, served[1].token))(key, lease_id)
        except Refused as no:
            return ["refused", no.status, no.kind, no.message]
        return [held.tenant, held.address, held.token]

    def _used(self, lease_id: str) -> None:
        """A relayed call: the lease is in use, and kept alive (touches.py: one round a
        second to the pool)."""
        touches.note(self._pool(self.pool), lease_id, self.name)

    # ---- the control plane's core (service/http.py)
    async def acquire(self, tenant: str, spec: SandboxSpec, timeout_s: float,
                      keepalive_s: float, request_id: Optional[str],
                      node: Optional[str] = None, prefix: str = "L-") -> dict:
        """A lease for ``tenant``, on ``node`` (a node id) or wherever the pool finds
        one (None; on this node alone when the service has no TLS and was not told
        ``insecure``: another node's gateway would carry keys in the clear).
        ``prefix``: its id's (fusion_leases.KEPT_PREFIX: one the service keeps)."""
        if node is not None and node != self.node and not self.spread:
            raise Refusal(400, "ValidationError", "a lease on another node needs the "
                          "service's TLS (--tls-cert/--tls-key) or --insecure")
        self._allowed(tenant, spec)
        if request_id is None:
            lease_id = prefix + secrets.token_hex(16)
        else:  # the same request id of the same tenant: the same lease, never a second
            lease_id = "L-" + hmac.new(self.secret, ("%s\0%s" % (tenant, request_id)).encode(),
                                       hashlib.sha256).hexdigest()[:32]
            served = self.served.get(lease_id)
            if served is not None:  # (a tenant at its limit finds it too)
                return self._described(lease_id, served[1])
            if lease_id in self.underway:
                return self._described(lease_id, await asyncio.shield(self.underway[lease_id]))
        limits = self.keys.tenant(tenant) or {}
        held = self.per_tenant.get(tenant, 0)
        most = limits.get("max_sandboxes")
        while most is not None and held + self.waiting.get(tenant, 0) >= most and \
                await self.fusion.make_room(tenant):  # an idle kept lease's room
            held = self.per_tenant.get(tenant, 0)
        if most is not None and held + self.waiting.get(tenant, 0) >= most:
            raise Refusal(429, "TenantLimit", "tenant %s holds or waits for %d sandboxes, its "
                          "most" % (tenant, most), retry_after=1.0)
        rate = limits.get("creates_per_s")
        if rate:
            bucket = self.buckets.get(tenant)
            if bucket is None or bucket.max_rate != rate:  # a second's worth at once
                bucket = self.buckets[tenant] = AdaptiveTokenBucket(rate, max(1, int(rate)))
            if not bucket.take():
                raise Refusal(429, "TenantLimit", "tenant %s may acquire %g sandboxes a second"
                              % (tenant, rate), retry_after=bucket.wait_s())
        request = pack_lease_request(spec, CLIENT_PREFIX + tenant, timeout_s, self.name,
                                     self.node, lease_id,
                                     node or (ANYWHERE if self.spread else self.node),
                                     keepalive_s, limits.get("weight"))
        underway = self.underway[lease_id] = asyncio.ensure_future(
            self._lease(tenant, lease_id, request))
        underway.add_done_callback(lambda _: self.underway.pop(lease_id, None))
        # a client that hangs up does not stop it: its lease is served, counted in the
        # tenant's limits, found by a retry with its request id, and otherwise ends
        # with its keepalive
        return self._described(lease_id, await asyncio.shield(underway))

    async def _lease(self, tenant: str, lease_id: str, request: bytes):
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1
        try:
            lease = unpack_lease(await self._tell_pool(self.pool, "lease", request))
        finally:
            self.waiting[tenant] -= 1
        try:
            await self._gateway_of(lease.node_id)
        except BaseException:
            await self.release(lease_id, self.pool)
            raise
        self._serve(tenant, lease_id, lease)
        return lease

    def _allowed(self, tenant: str, spec: SandboxSpec) -> None:
        """What a tenant may not ask of the node: the host's files, another tenant's
        snapshots, or the kernel's calls the policy refuses."""
        kind, where, _ = parse_image(spec.image)
        if kind in ("host", "dir"):
            raise Refusal(403, "Forbidden", "image %r: a tenant of the service runs images, "
                          "not the host's files" % spec.image)
        pool, _, name = where.partition("/")
        if kind == "snapshot" and (pool != self.pool or
                                   not name.startswith(snapshot_prefix(tenant))):
            raise ProviderError("image %r: pool %s has no such snapshot" % (spec.image, pool),
                                "fatal")
        if spec.capabilities or spec.network_allow:
            raise Refusal(403, "Forbidden", "capabilities and network_allow are the "
                          "operator's: a tenant of the service may not ask for them")

    def _described(self, lease_id: str, lease) -> dict:
        """A lease as a tenant sees it: never its daemon's address or token."""
        return {"lease_id": lease_id, "sandbox_id": lease.sandbox_id, "node_id": lease.node_id,
                "pool": lease.pool, "keepalive_s": lease.keepalive_s,
                "leased_at": lease.leased_wall, "data_url": self.urls["data_url"],
                "gateway_url": self._gateway_url(lease.node_id),
                "connect": "/v1/leases/%s/connect" % lease_id}

    def _mine(self, tenant: str, lease_id: str):
        served = self._tenants(lease_id)
        if served is None or served[0] != tenant:
            reason = self.ended.get(lease_id)
            if reason is not None and self.ended_for.get(lease_id) == tenant:
                raise Refusal(410, "LeaseEnded", "lease %s ended: %s" % (lease_id, reason))
            raise Refusal(404, "LeaseNotFound", "no lease %s" % lease_id)
        return served[1]

    def leases_of(self, tenant: str) -> list:
        return [self._described(i, lease) for i, (t, lease) in self.served.items()
                if t == tenant and not FusionLeases.holds(i)]

    def lease_of(self, tenant: str, lease_id: str) -> dict:
        return self._described(lease_id, self._mine(tenant, lease_id))

    async def give_back(self, tenant: str, lease_id: str) -> None:
        self._mine(tenant, lease_id)
        await self.release(lease_id, self.pool)

    async def keep(self, tenant: str, lease_id: str) -> None:
        self._mine(tenant, lease_id)
        kept = await self._tell_pool(self.pool, "keep_many", [(lease_id, self.name)])
        if not kept:
            raise Refusal(410, "LeaseEnded", "lease %s ended" % lease_id)

    async def keep_many(self, tenant: str, lease_ids: list) -> dict:
        """Keep the tenant's leases ``lease_ids`` alive; those that ended (or were
        never its) are named."""
        mine = [i for i in lease_ids if (self._tenants(i) or ("",))[0] == tenant]
        kept = await self._tell_pool(self.pool, "keep_many", [(i, self.name) for i in mine])
        ended = [i for i in lease_ids if (self._tenants(i) or ("",))[0] != tenant]
        return {"kept": kept, "ended": ended}

    async def pause(self, tenant: str, lease_id: str, reclaim: bool) -> None:
        self._mine(tenant, lease_id)
        if not await self._tell_pool(self.pool, "pause", lease_id, self.name, reclaim):
            raise Refusal(410, "LeaseEnded", "lease %s ended" % lease_id)

    async def resume(self, tenant: str, lease_id: str) -> None:
        self._mine(tenant, lease_id)
        if not await self._tell_pool(self.pool, "resume", lease_id, self.name):
            raise Refusal(410, "LeaseEnded", "lease %s ended" % lease_id)

    async def snapshot(self, tenant: str, lease_id: str, name: Optional[str],
                       for_fork: bool) -> dict:
        """The lease's files as a snapshot of the tenant's (``name``: 1 to 53 letters,
        digits, '.', '_' or '-'); only this tenant can start sandboxes of it."""
        self._mine(tenant, lease_id)
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 53):
            raise Refusal(400, "ValidationError", "a snapshot's name is 1 to 53 letters, "
                          "digits, '.', '_' or '-'")
        name = snapshot_prefix(tenant) + (name or "snap-" + secrets.token_hex(6))
        info = await self._tell_pool(self.pool, "snapshot", lease_id, self.name, name, for_fork)
        return self._snapshot_seen(tenant, info)

    async def snapshots_of(self, tenant: str) -> list:
        prefix = snapshot_prefix(tenant)
        return [self._snapshot_seen(tenant, info)
                for info in await self._tell_pool(self.pool, "snapshots")
                if info["name"].startswith(prefix)]

    async def delete_snapshot(self, tenant: str, name: str) -> None:
        full = snapshot_prefix(tenant) + name
        if not any(i["name"] == full for i in await self._tell_pool(self.pool, "snapshots")):
            raise Refusal(404, "SnapshotNotFound", "no snapshot %r" % name)
        await self._tell_pool(self.pool, "delete_snapshot", full)

    @staticmethod
    def _snapshot_seen(tenant: str, info: dict) -> dict:
        """A snapshot as its tenant sees it: its own name, not the node's paths."""
        keep = ("image", "size_bytes", "created_at", "sandboxes", "warm", "for_fork", "spec")
        return dict({k: info[k] for k in keep if k in info},
                    name=info["name"][len(snapshot_prefix(tenant)):])

    async def status_of(self, tenant: str) -> dict:
        pool = await self._tell_pool(self.pool, "status")
        return {"tenant": tenant, "leases": len(self.leases_of(tenant)),
                "limits": {k: v for k, v in (self.keys.tenant(tenant) or {}).items()
                           if k in ("weight", "max_sandboxes", "creates_per_s")},
                "pool": {k: pool.get(k) for k in ("name", "states", "waiting") if k in pool}}

    async def run_code(self, tenant: str, request) -> dict:
        """SandboxFusion's ``/run_code`` (service/fusion.py): ``request`` run in a
        sandbox of the fusion image on this node, lent for it alone and renewed before
        another program runs there (service/fusion_leases.py; a tenant at its limit
        waits for room rather than be refused, as long as the request's timeouts
        together; then 504, which SandboxFusion's clients retry)."""
        return await self.fusion.run(tenant, self.fusion_image, request)

    async def failed_key(self, address: Optional[str]) -> None:
        """A request without a valid key from ``address``: after a few a minute, each
        more one waits, longer and longer (at most 5 s), before its 401."""
        now = time.monotonic()
        seen = [t for t in self.failures.get(address or "", []) if now - t < 60.0][-64:]
        seen.append(now)
        if len(self.failures) > 10000:
            self.failures.clear()
        self.failures[address or ""] = seen
        extra = len(seen) - self.slow_after
        if self.slow_after and extra > 0:
            await asyncio.sleep(min(0.1 * 2 ** extra, 5.0))

    # ---- the pool's word (``_HandleHost``): an ended lease's relays are cut
    def _take(self, lease_id: str, reason: str = "released by its holder"):
        served = self.served.pop(lease_id, None)
        if served is not None:
            self.per_tenant[served[0]] -= 1
            if len(self.ended_for) > 4096:
                self.ended_for.clear()
            self.ended_for[lease_id] = served[0]
            self.gateway.cut(lease_id)
            self.e2b.ended(lease_id)
            self.fusion.ended(served[0], lease_id)  # (its oldest request waiting: room)
            if served[1].node_id in self.gateways:
                self.gateways[served[1].node_id][0].cut.remote(lease_id)
        return super()._take(lease_id, reason)


RemoteServiceHost = ray.remote(num_cpus=0, max_restarts=0,
                               max_concurrency=HOST_CALLS)(ServiceHost)


def start_service(pool: str, keys_path: str, host: str = "127.0.0.1", port: int = 0,
                  data_port: int = 0, tls: Optional[Tuple[str, str]] = None,
                  slow_after: int = SLOW_AFTER, fusion_image: str = FUSION_IMAGE,
                  insecure: bool = False, e2b_templates: Optional[Dict[str, str]] = None
                  ) -> Tuple[object, Dict[str, str]]:
    """The service of ``pool`` on this node, started (detached: it outlives the
    process that started it, until ``stop_service``); (its actor, its URLs)."""
    actor = RemoteServiceHost.options(
        name=service_name(pool), namespace=NAMESPACE, lifetime="detached",
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)).remote()
    try:
        urls = ray.get(actor.start.remote(pool, keys_path, host, port, data_port, tls,
                                          slow_after, fusion_image, insecure,
                                          e2b_templates))
    except BaseException:
        ray.kill(actor)
        raise
    return actor, urls


def stop_service(pool: str) -> int:
    """Stop the service of ``pool``: its leases given back, its actor gone."""
    try:
        actor = ray.get_actor(service_name(pool), namespace=NAMESPACE)
    except ValueError:
        return 0
    try:
        return ray.get(actor.stop.remote())
    finally:
        ray.kill(actor)
