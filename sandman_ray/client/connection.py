"""What both clients need to reach a daemon and read its answers: addresses, a
unix socket's path held open, the value or error of a reply, the hello."""

import errno
import os
import socket
import stat
from typing import Any, Dict

from sandman_ray.daemon.sandmand.wire import PROTOCOL_VERSION
from sandman_ray.errors import AuthError, DaemonError, ProtocolError


def _parse_address(address: str):
    kind, _, where = address.partition(":")
    if kind == "unix" and where:
        return socket.AF_UNIX, where
    if kind == "tcp":
        host, _, port = where.rpartition(":")
        if host and port.isdigit():
            return socket.AF_INET, (host, int(port))
    raise ValueError("daemon address must be unix:PATH or tcp:HOST:PORT, got %r" % address)


class _SocketPath:
    """A unix socket's path, held open without following a symlink in its last part,
    and reached through ``/proc/self/fd``: a sandbox that can write the directory of its
    daemon's socket (a bind-mounted host directory) cannot point the host's connect at
    some other socket of the host by swapping the socket for a symlink."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not stat.S_ISSOCK(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(errno.ENOTSOCK, "not a socket (a symlink or a file): %s" % path)
        self.path = "/proc/self/fd/%d" % self.fd

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _reply_value(reply: Dict[str, Any], op: str):
    if reply.get("ok"):
        return reply.get("result")
    err = reply.get("error") or {}
    raise DaemonError(str(err.get("type", "Error")), str(err.get("message", "")), op,
                      err.get("errno"))


# how long a client whose send failed looks for the daemon's reason (already sent)
REFUSAL_WAIT_S = 0.5


def _connection_error(reply: Dict[str, Any]) -> Exception:
    """The exception for a frame with no request id: the daemon is closing on us."""
    err = reply.get("error") or {}
    kind, message = err.get("type", "ProtocolError"), err.get("message", "")
    if kind == "AuthError":
        return AuthError(message)
    return ProtocolError("%s: %s" % (kind, message))


def _hello_fields(token: str) -> Dict[str, Any]:
    return {"op": "hello", "token": token, "version": PROTOCOL_VERSION}
