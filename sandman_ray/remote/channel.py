"""A lease's data plane through the service's gateway (sandman_ray/service/relay.py):
one HTTP/1.1 upgrade request with the API key, then the daemon's own protocol on the
same socket, driven by the same client as a direct connection. Imports no Ray."""

import json
import socket
import ssl
from typing import Optional
from urllib.parse import urlsplit

from sandman_ray.client.blocking import DaemonClient
from sandman_ray.errors import (
    AcquireTimeout, AuthError, ConnectionLost, LeaseEnded, LeaseNotHeld, ProtocolError,
    ProviderError, SandboxLost, ServiceLimit)

UPGRADE = "sandman-daemon/2"  # as service/relay.py answers it
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
        sock.sendall(("GET /v1/leases/%s/connect HTTP/1.1\r\nHost: %s\r\n"
                      "Authorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n"
                      % (lease_id, parts.netloc, api_key, UPGRADE)).encode())
        status, body = _answer(sock)
        if status != 101:
            raise service_error(status, body)
    except BaseException:
        sock.close()
        raise
    return DaemonClient("%s/v1/leases/%s" % (url, lease_id), None, sock=sock,
                        connect_timeout=timeout, default_timeout=default_timeout)


def service_url(url: str):
    """``url`` split (urllib's SplitResult), if it is a service's: http or https, a
    host; else ValueError naming it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("a service URL is http://HOST:PORT or https://HOST:PORT, got %r"
                         % url)
    return parts


def _answer(sock) -> tuple:
    """(status, body) of the gateway's answer: the head alone for a 101 (nothing may
    follow it before the client's first frame), the head and its JSON body else."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1 if len(head) < 12 else _HEAD_MAX - len(head))
        if not data:
            raise ConnectionLost("the service closed the connection before answering")
        head += data
        if len(head) > _HEAD_MAX:
            raise ProtocolError("the service's answer has a head over %d bytes" % _HEAD_MAX)
    head, _, rest = head.partition(b"\r\n\r\n")
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
    while len(rest) < length:
        data = sock.recv(length - len(rest))
        if not data:
            break
        rest += data
    return status, rest


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
