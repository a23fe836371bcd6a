"""The service's data plane: a client's connection relayed to its lease's daemon.

A client outside Ray reaches a sandbox through the gateway of the sandbox's node with
one HTTP/1.1 request::

    GET /v1/leases/<lease id>/connect HTTP/1.1
    Authorization: Bearer sk_sandman_...
    Connection: Upgrade
    Upgrade: sandman-daemon/2

The gateway checks the key, and that the lease is one its tenant holds (another
tenant's lease answers 404, as one that never existed); it opens the daemon's socket
and says the hello with the lease's token, which never leaves the gateway; then it
answers ``101 Switching Protocols`` and relays bytes both ways, untouched: from there
the connection is a daemon connection after its hello (sandman_ray/daemon/docs/protocol.md), which
the client drives with the same code as a direct one (``DaemonClient(sock=...)``).
So an op costs what it costs directly, plus two copies in the gateway and the TCP hop.

Everything before the 101 is bounded: a request head of at most HEAD_MAX bytes, read
within HEAD_TIMEOUT_S, at most ``pending_per_address`` (PENDING_PER_ADDRESS) such
connections from one address at a time (past them a connection is answered 429 at
once, without reading it), and at most RELAYS_PER_LEASE relays of one lease; every
refusal is an HTTP status with a JSON body naming the error, and the connection is
closed.
"""

import asyncio
import json
import re
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, Optional, Tuple

from sandman_ray.client.connection import _SocketPath, _hello_fields, _parse_address
from sandman_ray.daemon.sandmand.wire import MAX_FRAME, FrameReader, encode_frame, unpack
from sandman_ray.errors import ProtocolError
from sandman_ray.remote.channel import UPGRADE, parse_answer, service_url, upgrade_request

HEAD_MAX = 8192
HEAD_TIMEOUT_S = 10.0
DAEMON_TIMEOUT_S = 10.0
CHUNK = 1 << 16
PENDING_PER_ADDRESS = 1024  # connections of one address not yet admitted (a client's
# burst of upgrades, one per lease, may come from one address: a NAT's, a trainer's)
RELAYS_PER_LEASE = 64  # a client needs one per thread or event loop it calls from
_CONNECT = re.compile(r"^/v1/leases/([A-Za-z0-9_-]{1,128})/connect$")


class Refused(Exception):
    """An HTTP answer before any relay: status, the error's type and message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def unauthorized() -> Refused:
    """The refusal of an upgrade without a live API key."""
    return Refused(401, "Unauthorized", "no valid API key (Authorization: Bearer ...)")


_REASONS = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            403: "Forbidden", 405: "Method Not Allowed", 408: "Request Timeout", 410: "Gone",
            426: "Upgrade Required", 429: "Too Many Requests",
            431: "Request Header Fields Too Large",
            502: "Bad Gateway"}


@dataclass(frozen=True)
class Held:
    """A lease the gateway holds for a tenant: where its daemon is, and its token; or,
    for a sandbox of another node, ``onward``: the URL of that node's gateway, which
    the connection is relayed to (with the client's key, which it checks again)."""

    tenant: str
    address: str
    token: str
    onward: Optional[str] = None


Admit = Callable[[Optional[str], str], Awaitable[Held]]


def admitting(verify: Callable[[str], Optional[str]],
              find: Callable[[str], Optional[Held]]) -> Admit:
    """A gateway's ``admit`` from ``verify(key)``: the tenant of a live API key, else
    None (``tenants.KeyStore.verify``), and ``find(lease id)``: the Held of a lease
    held, else None."""
    async def admit(key: Optional[str], lease_id: str) -> Held:
        tenant = verify(key) if key is not None else None
        if tenant is None:
            raise unauthorized()
        held = find(lease_id)
        if held is None or held.tenant != tenant:
            raise Refused(404, "LeaseNotFound", "no lease %s" % lease_id)
        return held
    return admit


class Gateway:
    """Relays the upgraded connections of tenants to the daemons of the leases they
    hold. ``admit(key or None, lease id)``: the Held of a lease the key's tenant holds,
    else Refused (401 for no valid key, 404 for a lease not its: ``admitting``);
    ``used(lease id)``, if given: called as a client's bytes pass (the lease is in
    use); ``onward_ssl``: the TLS context of relays to other nodes' gateways."""

    def __init__(self, admit: Admit, used: Optional[Callable[[str], None]] = None,
                 pending_per_address: int = PENDING_PER_ADDRESS, onward_ssl=None):
        self.admit = admit
        self.used = used
        self.onward_ssl = onward_ssl
        self.pending_per_address = pending_per_address
        self.relays: Dict[str, set] = {}  # lease id -> its relays' client writers
        self.pending: Dict[str, int] = {}  # address -> its connections not yet admitted

    async def serve(self, host: str = "127.0.0.1", port: int = 0,
                    ssl=None) -> asyncio.AbstractServer:
        return await asyncio.start_server(self.handle, host, port, limit=HEAD_MAX, ssl=ssl,
                                          ssl_handshake_timeout=HEAD_TIMEOUT_S if ssl else None)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: its upgrade, then its relay until either side ends."""
        daemon = None
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else ""
        try:
            if self.pending.get(address, 0) >= self.pending_per_address:
                raise Refused(429, "TooManyConnections", "%d connections of this address are "
                              "not through their upgrade yet" % self.pending_per_address)
            self.pending[address] = self.pending.get(address, 0) + 1
            try:
                lease_id, key, held = await self._admit(reader)
            finally:
                self.pending[address] -= 1
                if not self.pending[address]:
                    del self.pending[address]
            relays = self.relays.setdefault(lease_id, set())
            if len(relays) >= RELAYS_PER_LEASE:
                raise Refused(429, "TooManyConnections", "lease %s has %d connections, its "
                              "most" % (lease_id, RELAYS_PER_LEASE))
            relays.add(writer)  # its slot, taken before the daemon is reached
            try:
                if held.onward is not None:
                    daemon = await open_onward(held.onward, lease_id, key, self.onward_ssl)
                else:
                    daemon = await open_daemon(held.address, held.token)
                if writer not in self.relays.get(lease_id, ()):  # cut meanwhile: it ended
                    raise Refused(410, "LeaseEnded", "lease %s ended" % lease_id)
            except BaseException:
                self._forget(lease_id, writer)
                raise
            writer.write(("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                          "Upgrade: %s\r\n\r\n" % UPGRADE).encode())
            try:
                await relay(reader, writer, *daemon,
                            used=(lambda: self.used(lease_id)) if self.used else None)
            finally:
                self._forget(lease_id, writer)
        except Refused as no:
            body = json.dumps({"error": {"type": no.kind, "message": no.message}}).encode()
            writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (no.status, _REASONS[no.status].encode(), len(body), body))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            if daemon is not None:
                daemon[1].close()
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader) -> Tuple[str, str, Held]:
        method, target, headers = await read_head(reader)
        found = _CONNECT.match(target)
        if not found:
            raise Refused(404, "NotFound", "no such route: %s" % target[:200])
        if method != "GET":
            raise Refused(405, "MethodNotAllowed", "connect is a GET")
        auth = headers.get("authorization", "")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        if key is None:
            raise unauthorized()
        if headers.get("upgrade", "").lower() != UPGRADE or \
                "upgrade" not in headers.get("connection", "").lower():
            raise Refused(426, "UpgradeRequired", "connect upgrades to %s" % UPGRADE)
        lease_id = found.group(1)
        return lease_id, key, await self.admit(key, lease_id)

    def _forget(self, lease_id: str, writer) -> None:
        relays = self.relays.get(lease_id)
        if relays is not None:
            relays.discard(writer)
            if not relays:
                del self.relays[lease_id]

    def cut(self, lease_id: str) -> int:
        """Close the relays of ``lease_id`` (its lease ended); how many there were."""
        writers = self.relays.pop(lease_id, set())
        for writer in writers:
            writer.close()
        return len(writers)


async def read_head(reader: asyncio.StreamReader) -> Tuple[str, str, Dict[str, str]]:
    """(method, target, headers with lower-case names) of an HTTP/1.1 request head."""
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise Refused(408, "RequestTimeout",
                      "no whole request head within %g s" % HEAD_TIMEOUT_S) from None
    except asyncio.LimitOverrunError:
        raise Refused(431, "HeadersTooLarge",
                      "a request head is at most %d bytes" % HEAD_MAX) from None
    try:
        lines = raw.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise Refused(400, "BadRequest", "not an HTTP/1.1 request line") from None
    if version != "HTTP/1.1":
        raise Refused(400, "BadRequest", "HTTP/1.1 only, got %r" % version[:20])
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise Refused(400, "BadRequest", "a malformed header line")
            headers[name.lower()] = value.strip()
    return method, target, headers


async def open_daemon(address: str, token: str):
    """(reader, writer) of a connection to the daemon at ``address`` after its hello
    with ``token``; Refused(410) when the daemon does not answer or refuses it."""
    family, where = _parse_address(address)
    try:
        if family == socket.AF_UNIX:
            with _SocketPath(where) as path:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(path, limit=CHUNK), DAEMON_TIMEOUT_S)
        else:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*where, limit=CHUNK), DAEMON_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        raise Refused(410, "SandboxLost", "its sandbox does not answer: %s" % exc) from None
    try:
        hello = _hello_fields(token)
        hello["id"] = 0
        writer.write(encode_frame(hello))
        frames = FrameReader(MAX_FRAME)
        got = []
        while not got:
            data = await asyncio.wait_for(reader.read(CHUNK), DAEMON_TIMEOUT_S)
            if not data:
                raise ConnectionError("closed at the hello")
            got = frames.feed(data, one=True)
        if not unpack(got[0]).get("ok") or frames.buf:
            raise ConnectionError("the hello was refused")
    except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
        writer.close()
        raise Refused(410, "SandboxLost", "its sandbox does not answer: %s" % exc) from None
    return reader, writer


async def open_onward(url: str, lease_id: str, key: str, context=None):
    """(reader, writer) of a connection to the gateway at ``url`` upgraded for
    ``lease_id`` with ``key``, as a client upgrades one (remote/channel.py): its
    daemon's connection after the hello, one hop further. The gateway's refusal is
    passed on as it was; Refused(502) when it does not answer."""
    parts = service_url(url)
    secure = context if parts.scheme == "https" else None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            parts.hostname, parts.port, limit=CHUNK, ssl=secure,
            server_hostname=parts.hostname if secure else None), DAEMON_TIMEOUT_S)
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        raise Refused(502, "GatewayLost", "the gateway of its node does not answer: %s"
                      % exc) from None
    try:
        writer.write(upgrade_request(parts, key, lease_id))
        data = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DAEMON_TIMEOUT_S)
        answer = parse_answer(data, final=False)
        while answer is None:  # a refusal's body, still coming
            more = await asyncio.wait_for(reader.read(CHUNK), DAEMON_TIMEOUT_S)
            data += more
            answer = parse_answer(data, final=not more)
        status, body = answer
        if status != 101:
            error = json.loads(body or b"{}")
            error = error.get("error") if isinstance(error, dict) else None
            error = error if isinstance(error, dict) else {}
            writer.close()
            raise Refused(status if status in _REASONS else 502,
                          str(error.get("type", "GatewayError")),
                          str(error.get("message", "its node's gateway answered %d" % status)))
    except (OSError, ValueError, ProtocolError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError, asyncio.TimeoutError) as exc:
        writer.close()
        raise Refused(502, "GatewayLost", "the gateway of its node does not answer: %s"
                      % exc) from None
    return reader, writer


async def relay(c_reader, c_writer, d_reader, d_writer,
                used: Optional[Callable[[], None]] = None) -> None:
    """Bytes both ways until either side closes; then both are closed. ``used`` is
    called as the client's bytes pass."""
    async def pipe(src, dst, note=None):
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                if note is not None:
                    note()
                dst.write(data)
                await dst.drain()  # a slow reader holds its sender back
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()
    await asyncio.gather(pipe(c_reader, d_writer, used), pipe(d_reader, c_writer))
