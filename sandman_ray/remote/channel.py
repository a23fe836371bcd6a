"""A lease's data plane through the service's gateway (sandman_ray/service/relay.py):
one HTTP/1.1 upgrade request with the API key, then the daemon's own protocol on the
same socket, driven by the same client as a direct connection. Imports no Ray."""

import asyncio
import json
import socket
import ssl
from typing import Optional
from urllib.parse import urlsplit

from sandman_ray.client.aio import AsyncDaemonClient
from sandman_ray.client.blocking import DaemonClient
from sandman_ray.errors import (
    AcquireTimeout, AuthError, ConnectionLost, LeaseEnded, LeaseNotHeld, ProtocolError,
    ProviderError, SandboxLost, ServiceLimit)

UPGRADE = "sandman-daemon/2"  # the protocol a connect upgrades to (service/relay.py)
_HEAD_MAX = 8192


def connect_lease(url: str, api_key: str, lease_id: str, *, timeout: float = 10.0,
                  context: Optional[ssl.SSLContext] = None,
                  default_timeout: Optional[float] = None) -> DaemonClient:
    """A DaemonClient of lease ``lease_id`` through the gateway at ``url``
    (``http://host:port`` or ``https://...``). Raises AuthError (no valid key),
    LeaseNotHeld (not a lease of the key's tenant), SandboxLost (its sandbox does not
    answer), ConnectionLost (the gateway cannot be reached)."""
    parts = service_url(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=timeout)
    except OSError as exc:
        raise ConnectionLost("cannot reach the service at %s: %s" % (url, exc)) from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if parts.scheme == "https":
            sock = (context or ssl.create_default_context()).wrap_socket(
                sock, server_hostname=parts.hostname)
        sock.sendall(upgrade_request(parts, api_key, lease_id))
        status, body = _answer(sock)
        if status != 101:
            raise service_error(status, body)
    except BaseException:
        sock.close()
        raise
    return DaemonClient("%s/v1/leases/%s" % (url, lease_id), None, sock=sock,
                        connect_timeout=timeout, default_timeout=default_timeout)


async def connect_lease_async(url: str, api_key: str, lease_id: str, *,
                              timeout: float = 10.0, context: Optional[ssl.SSLContext] = None,
                              default_timeout: Optional[float] = None) -> AsyncDaemonClient:
    """``connect_lease`` for asyncio: an AsyncDaemonClient of the lease, many calls in
    flight on its connection."""
    parts = service_url(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    secure = (context or ssl.create_default_context()) if parts.scheme == "https" else None
    try:
        transport, upgrade = await asyncio.wait_for(loop.create_connection(
            _Upgrade, parts.hostname, port, ssl=secure,
            server_hostname=parts.hostname if secure else None), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise ConnectionLost("cannot reach the service at %s: %s" % (url, exc)) from exc
    try:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(upgrade_request(parts, api_key, lease_id))
        try:
            status, body = await asyncio.wait_for(upgrade.answer, timeout)
        except asyncio.TimeoutError:
            raise ConnectionLost("the service at %s did not answer in %g s"
                                 % (url, timeout)) from None
        if status != 101:
            raise service_error(status, body)
    except BaseException:
        transport.close()
        raise
    return AsyncDaemonClient.over(transport, "%s/v1/leases/%s" % (url, lease_id),
                                  default_timeout)


class _Upgrade(asyncio.Protocol):
    """The gateway's answer to the upgrade request: (status, body) in ``answer``; the
    connection then passes to the daemon's client (``AsyncDaemonClient.over``)."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()
        self.data = b""

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            return
        self.data += data
        try:
            parsed = parse_answer(self.data, final=False)
        except ProtocolError as exc:
            self.answer.set_exception(exc)
            return
        if parsed is not None:
            self.answer.set_result(parsed)

    def eof_received(self):
        self.connection_lost(None)

    def connection_lost(self, exc) -> None:
        if self.answer.done():
            return
        try:
            parsed = parse_answer(self.data, final=True)
        except ProtocolError as error:
            self.answer.set_exception(error)
            return
        if parsed is None:
            self.answer.set_exception(ConnectionLost(
                "the service closed the connection before answering"))
        else:
            self.answer.set_result(parsed)


def upgrade_request(parts, api_key: str, lease_id: str) -> bytes:
    return ("GET /v1/leases/%s/connect HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
            "Connection: Upgrade\r\nUpgrade: %s\r\n\r\n"
            % (lease_id, parts.netloc, api_key, UPGRADE)).encode()


def service_url(url: str):
    """``url`` split (urllib's SplitResult), if it is a service's: http or https, a
    host; else ValueError naming it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("a service URL is http://HOST:PORT or https://HOST:PORT, got %r"
                         % url)
    return parts


def _answer(sock) -> tuple:
    """(status, body) of the gateway's answer, read from ``sock``: the head alone for
    a 101 (nothing may follow it before the client's first frame), the head and its
    JSON body else."""
    data = b""
    while True:
        parsed = parse_answer(data, final=False)
        if parsed is not None:
            return parsed
        more = sock.recv(1 if b"\r\n\r\n" not in data and len(data) < 12 else _HEAD_MAX)
        if not more:
            parsed = parse_answer(data, final=True)
            if parsed is None:
                raise ConnectionLost("the service closed the connection before answering")
            return parsed
        data += more


def parse_answer(data: bytes, final: bool) -> Optional[tuple]:
    """(status, body) of an answer whose bytes so far are ``data``; None while more
    must come (``final``: none will: the body is what came)."""
    if b"\r\n\r\n" not in data:
        if len(data) > _HEAD_MAX:
            raise ProtocolError("the service's answer has a head over %d bytes" % _HEAD_MAX)
        return None
    head, _, rest = data.partition(b"\r\n\r\n")
    if len(head) > _HEAD_MAX:
        raise ProtocolError("the service's answer has a head over %d bytes" % _HEAD_MAX)
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ")[1])
    except (IndexError, ValueError):
        raise ProtocolError("not an HTTP answer: %r" % lines[0][:80]) from None
    if status == 101:
        if rest:
            raise ProtocolError("the service sent data before the client's first frame")
        return status, b""
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length" and value.strip().isdigit():
            length = min(int(value), 1 << 16)
    if len(rest) < length and not final:
        return None
    return status, rest[:length] if length else rest


def service_error(status: int, data: bytes, retry_after: Optional[str] = None) -> Exception:
    """The Python API's error for the service's refusal (``status``, its JSON body)."""
    try:
        error = json.loads(data)["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "Error", data[:300].decode("utf-8", "replace")
    if status == 400:
        return ValueError(message)
    if status == 401:
        return AuthError(message)
    if status == 403:
        return PermissionError(message)
    if status == 404:
        return LeaseNotHeld(message)
    if status == 408:
        return AcquireTimeout(message)
    if status == 410:
        return LeaseEnded(message) if kind == "LeaseEnded" else SandboxLost(message)
    if status == 422 and kind in ("ProviderError", "NotSupported"):
        return ProviderError(message, "fatal")
    if status in (429, 503):
        try:
            wait = float(retry_after or 1)
        except ValueError:
            wait = 1.0
        return ServiceLimit("%s: %s" % (kind, message), wait)
    return ProtocolError("the service answered %d %s: %s" % (status, kind, message))
