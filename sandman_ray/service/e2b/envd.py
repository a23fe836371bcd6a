"""envd, E2B's in-sandbox API, served by the service for its E2B sandboxes: the
Connect-RPC process service (start, connect, list, input, stdin, signals, terminals),
the filesystem service (stat, list, make dir, move, remove, watch), HTTP ``/files``
(upload and download) and ``/health``; each call made of the sandbox daemon's
operations. This module finds a request's sandbox and answers in Connect's shape;
processes.py and files.py serve the two services.

A request names its sandbox by the ``E2b-Sandbox-Id`` header (the SDK's sandbox URL) or
by its host name, ``<port>-<sandbox id>.<domain>``, and proves it may use it with the
sandbox's access token (``X-Access-Token``), which only its creator was told. A sandbox
that is not found, or not with that token, answers as one that has ended.

Commands run as the sandbox's user (``user``, in /home/user); a call that asks for
another user (``Authorization: Basic``) is refused, since the sandbox has no way to
become it.
"""

import asyncio
import base64
import posixpath
from typing import Optional

from aiohttp import web

from sandman_ray.errors import DaemonError, SandmanError
from sandman_ray.service.e2b import connect
from sandman_ray.service.e2b.connect import RpcError, invalid
from sandman_ray.service.e2b.sandboxes import USER

HOME = "/home/user"
KEEPALIVE_DEFAULT_S = 50.0
# the daemon's error kinds, as Connect's codes
CODES = {"FileNotFoundError": "not_found", "ProcessNotFound": "not_found",
         "TerminalNotFound": "not_found", "FileExistsError": "already_exists",
         "PermissionError": "permission_denied", "NotADirectoryError": "invalid_argument",
         "IsADirectoryError": "invalid_argument", "BadRequest": "invalid_argument",
         "LimitExceeded": "resource_exhausted", "StdinClosed": "failed_precondition",
         "TerminalClosed": "failed_precondition", "OSError": "internal"}


def sandbox_id_of(request) -> Optional[str]:
    """The sandbox a request is for: its header, else its host name's."""
    named = request.headers.get("E2b-Sandbox-Id")
    if named:
        return named
    host = request.host.split(":", 1)[0]
    port, dash, rest = host.partition("-")
    if dash and port.isdigit():
        return rest.split(".", 1)[0]
    return None


def _user_of(request) -> str:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return USER
    try:
        user = base64.b64decode(header[6:]).decode().split(":", 1)[0]
    except (ValueError, UnicodeDecodeError):
        raise invalid("the Authorization header is not Basic <base64 of user:>") from None
    return user or USER


def _path(value, name: str = "path") -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise invalid("%s is a non-empty path" % name)
    if value == "~" or value.startswith("~/"):
        value = HOME + value[1:]
    return posixpath.normpath(posixpath.join(HOME, value))


def _rpc_error(exc: Exception) -> RpcError:
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, DaemonError):
        return RpcError(CODES.get(exc.type, "internal"), exc.message)
    if isinstance(exc, LookupError):
        return RpcError("unavailable", str(exc))
    if isinstance(exc, SandmanError):  # the daemon's connection lost: the sandbox ended
        return RpcError("unavailable", "the sandbox was not found: %s" % exc)
    if isinstance(exc, (TypeError, ValueError, KeyError, AttributeError)):
        return invalid("a field is not of its type: %s: %s" % (type(exc).__name__, exc))
    return RpcError("internal", "%s: %s" % (type(exc).__name__, exc))


class EnvdPart:
    """What envd's services share: the sandbox a request is for, and a unary call's
    answer in Connect's shape."""

    def __init__(self, sandboxes):
        self.sandboxes = sandboxes

    async def _sandbox(self, request):
        box = self.sandboxes.for_envd(sandbox_id_of(request), request.headers.get("X-Access-Token"))
        if box.paused:
            raise RpcError("unavailable", "sandbox %s is paused: connect to it to resume it"
                           % box.id)
        user = _user_of(request)
        if user != USER:
            raise RpcError("permission_denied", "commands and files of a sandman sandbox are "
                           "its user %r's; user %r is not served" % (USER, user))
        return box, await self.sandboxes.client_of(box)

    async def _unary(self, request, work) -> web.Response:
        try:
            box, client = await self._sandbox(request)  # its token before its body
            message = await connect.unary_request(request)
            return web.json_response(await work(box, client, message))
        except Exception as exc:  # noqa: BLE001 - in Connect's shape, or raised on
            return connect.error_response(_rpc_error(exc))


async def relay(response, events, request, keepalive: dict) -> None:
    """Write each message of ``events`` (an async iterator) to the stream ``response``
    as it comes, and a keepalive whenever none came for the interval the client asked
    (``Keepalive-Ping-Interval``): the message ``keepalive``."""
    try:
        every = float(request.headers.get("Keepalive-Ping-Interval") or KEEPALIVE_DEFAULT_S)
    except ValueError:
        every = KEEPALIVE_DEFAULT_S
    every = min(max(every, 1.0), 600.0) if every == every else KEEPALIVE_DEFAULT_S
    pending = None
    events = events.__aiter__()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                await response.write(connect.envelope(keepalive))
                continue
            try:
                message = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            await response.write(connect.envelope(message))
    finally:
        if pending is not None:  # its end first: a running generator cannot be closed
            pending.cancel()
            try:
                await pending
            except BaseException:  # noqa: BLE001 - cancelled, or ended meanwhile
                pass
        await events.aclose()


async def stream_response(request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": connect.STREAM_JSON})
    await response.prepare(request)
    return response


def health(sandboxes):
    """``/health``: 204 while the sandbox (by its id and token) is there, else 502 with
    the words the SDK reads as "not found"."""
    async def answer(request):
        try:
            sandboxes.for_envd(sandbox_id_of(request), request.headers.get("X-Access-Token"))
        except LookupError as exc:
            return web.json_response({"message": "%s; it was not found" % exc}, status=502)
        return web.Response(status=204)
    return answer
