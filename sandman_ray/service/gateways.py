"""The service's gateways on the other nodes of its cluster.

A daemon listens on a unix socket of its own node, so the service's own data plane
(service/relay.py, in the ServiceHost's process) reaches only the sandboxes of its
node. Each other node that holds a lease of the service gets a NodeGateway: a Ray
actor on that node, listening on the node's address, that relays to the daemons there
exactly as the service's own gateway does. It keeps no table of its own: each upgrade
it is asked for, it asks the service (``ServiceHost.admit``) whether the key is live
and the lease is its tenant's on this node, and gets the daemon's address and token;
so a revoked key or an ended lease is refused there at once, as at the front.

A client reaches a lease of another node either at the lease's ``gateway_url`` (this
gateway, one hop) or at the service's ``data_url``, the front, which relays the
connection onward to this gateway (for clients that reach only one address). With
TLS, the gateway serves the service's certificate and the front trusts exactly that
certificate for the hop.
"""

import os
import ssl
import tempfile
from typing import Optional, Tuple

import ray

from sandman_ray import touches
from sandman_ray.lookup import get_pool
from sandman_ray.names import NAMESPACE
from sandman_ray.service.relay import Gateway, Held, Refused, unauthorized
from sandman_ray.service.tenants import of_a_key_form

GATEWAY_PREFIX = "sandman-gw-"


def gateway_name(pool: str, node_id: str) -> str:
    return "%s%s-%s" % (GATEWAY_PREFIX, node_id[:16], pool)


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS server context of a certificate and its key (TLS 1.2 at least)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def server_context_of(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """server_context of PEM text: written to files only this process can read, loaded,
    and removed."""
    with tempfile.TemporaryDirectory(prefix="sandman-tls-") as where:
        cert, key = os.path.join(where, "cert.pem"), os.path.join(where, "key.pem")
        for path, text in ((cert, cert_pem), (key, key_pem)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
                fh.write(text)
        return server_context(cert, key)


def onward_context(cert_pem: str) -> ssl.SSLContext:
    """The front's TLS context for the hop to a node's gateway: it trusts the service's
    own certificate, the first of its file, and nothing else (not the CA of a chain
    after it, which would trust every certificate that CA signed; the hop goes by node
    address, not by the name the certificate was made for)."""
    end = "-----END CERTIFICATE-----"
    if end not in cert_pem:
        raise ValueError("the service's certificate file holds no PEM certificate")
    leaf = cert_pem[cert_pem.index("-----BEGIN CERTIFICATE-----"):cert_pem.index(end) + len(end)]
    context = ssl.create_default_context(cadata=leaf)
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def serve_at_normal_priority() -> bool:
    """Raise this process's threads from the nice value Ray gives its workers (15) to
    0, as the node's other servers run: a gateway relays every tenant's calls, and at
    nice 15 any busy process of the node (a sandbox's commands, a client on the same
    machine) delays it, and every tenant's calls with it (a tenant's flood of cheap
    calls took another's p99 from 1.6 to 44 ms here, 23 ms at nice 0). False where
    the process may not (no CAP_SYS_NICE)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except PermissionError:
            return False
    return True


class NodeGateway:
    """See the module's docstring."""

    def __repr__(self) -> str:
        """What the Ray dashboard and Ray's messages call this actor."""
        return "NodeGateway(pool=%s, node=%s)" % (getattr(self, "pool", "?"),
                                                  (getattr(self, "node", None) or "?")[:12])

    async def start(self, pool: str, service: str, tls_pem: Optional[Tuple[str, str]]) -> str:
        """Listen on this node's address (with TLS: ``tls_pem``, the certificate's and
        its key's PEM text); the URL it serves at. ``service``: the ServiceHost's
        actor name, asked about each upgrade."""
        self.pool, self.service_name = pool, service
        self.service = self.pool_actor = None
        self.node = ray.get_runtime_context().get_node_id()
        serve_at_normal_priority()
        host = ray.util.get_node_ip_address()
        context = server_context_of(*tls_pem) if tls_pem else None
        self.gateway = Gateway(self._admit, self._used)
        self.server = await self.gateway.serve(host, 0, ssl=context)
        port = self.server.sockets[0].getsockname()[1]
        return "%s://%s:%d" % ("https" if context else "http",
                               "[%s]" % host if ":" in host else host, port)

    async def _admit(self, key: Optional[str], lease_id: str) -> Held:
        if not of_a_key_form(key):  # refused here: not a call to the service for each
            raise unauthorized()
        if self.service is None:
            self.service = ray.get_actor(self.service_name, namespace=NAMESPACE)
        try:
            answer = await self.service.admit.remote(key, lease_id, self.node)
        except ray.exceptions.RayActorError:
            self.service = None
            raise Refused(502, "ServiceLost", "the service does not answer") from None
        if answer[0] == "refused":
            raise Refused(*answer[1:])
        return Held(*answer)

    def _used(self, lease_id: str) -> None:
        """A relayed call (each of a client's reads: the handle is looked up once)."""
        if self.pool_actor is None:
            self.pool_actor = get_pool(self.pool)
        touches.note(self.pool_actor, lease_id, self.service_name)

    def cut(self, lease_id: str) -> int:
        """Close the relays of ``lease_id`` (its lease ended)."""
        return self.gateway.cut(lease_id)

    def stop(self) -> None:
        self.server.close()


RemoteNodeGateway = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)(NodeGateway)


def start_gateway(pool: str, service: str, node_id: str,
                  tls_pem: Optional[Tuple[str, str]]):
    """The gateway of ``service`` on ``node_id``, started (detached: the service stops
    it); (its actor, the ref of its URL)."""
    actor = RemoteNodeGateway.options(
        name=gateway_name(pool, node_id), namespace=NAMESPACE, lifetime="detached",
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote()
    return actor, actor.start.remote(pool, service, tls_pem)


def stop_gateways(pool: str) -> int:
    """Every gateway of ``pool``'s service there is, stopped (of this incarnation of
    the service or an earlier one); how many."""
    stopped = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry.get("namespace") == NAMESPACE and name.startswith(GATEWAY_PREFIX) and \
                name[len(GATEWAY_PREFIX) + 17:] == pool:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
                stopped += 1
            except ValueError:
                pass
    return stopped
