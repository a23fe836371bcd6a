"""A node agent's control socket: a holder on the agent's node pauses, resumes and
renews its sandbox there without a Ray call (LocalProvider's agent serves it; the
handle and the service's SandboxFusion leases ask).

One request per connection, a line of JSON: ``{"op": "pause" | "resume" | "renew",
"sandbox": id, "token": the lease's token, "reclaim": bool}``, answered by a line
``{"done": bool}`` (False: a token the sandbox does not take, or no such sandbox; a
renew that was done says the sandbox's new ``token`` and ``address`` too) or
``{"error": kind, "message": text}``. A renew is the pool's reset, for the holder:
the sandbox as new, under a new token, and the lease goes on. The socket is the
agent's (root's, mode 0600) in its incarnation's state directory, which no sandbox
sees; a request longer than REQUEST_LIMIT or not of that shape is refused, and the
token is checked before anything is done.
"""

import asyncio
import json
import os
import socket
from typing import Awaitable, Callable, Dict, Optional, Union

from sandman_ray.errors import NotSupported, ProtocolError, ProviderError

OPS = ("pause", "resume", "renew")
REQUEST_LIMIT = 4096  # bytes of one request line (ids and a token are far shorter)
ANSWER_LIMIT = 4096
READ_TIMEOUT_S = 5.0  # a client that sends no whole line in this time is dropped
CONNECT_TIMEOUT_S = 5.0
# a freeze or thaw takes milliseconds; a pause with reclaim pushes out a sandbox's
# memory, which takes as long as it is big
ANSWER_TIMEOUT_S = 30.0
RECLAIM_TIMEOUT_S = 300.0
RENEW_TIMEOUT_S = 120.0  # a renew that falls back to a fresh start waits for its daemon
MESSAGE_LIMIT = 1000  # characters of an error's message in an answer
PATH_LIMIT = 107  # sun_path holds 108 bytes with its terminating NUL

# (op, sandbox id, token, reclaim) -> done, or for a renew done, the sandbox's new token
# and address
Handler = Callable[[str, str, str, bool], Awaitable[Union[bool, Dict[str, str]]]]


async def serve(path: str, handler: Handler) -> Optional[asyncio.AbstractServer]:
    """Listen on ``path``: ``await handler(op, sandbox_id, token, reclaim)`` answers
    each well-formed request. None where ``path`` is too long for a unix socket."""
    if len(os.fsencode(path)) > PATH_LIMIT:
        return None

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            answer = await _answer(line, handler)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (OSError, ValueError, asyncio.TimeoutError):
            pass  # a line past the limit, a client gone or too slow: nothing was done
        finally:
            writer.close()
    if os.path.exists(path):
        os.unlink(path)
    server = await asyncio.start_unix_server(one, path=path, limit=REQUEST_LIMIT)
    os.chmod(path, 0o600)
    return server


async def _answer(line: bytes, handler: Handler) -> dict:
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        request = None
    if not isinstance(request, dict) or request.get("op") not in OPS or \
            not isinstance(request.get("sandbox"), str) or \
            not isinstance(request.get("token"), str) or \
            not isinstance(request.get("reclaim", False), bool):
        return {"error": "ProtocolError",
                "message": "a control request is one line of JSON: op (%s), sandbox, token "
                           "and reclaim (a bool)" % " or ".join(OPS)}
    try:
        done = await handler(request["op"], request["sandbox"], request["token"],
                             request.get("reclaim", False))
    except ProviderError as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:MESSAGE_LIMIT],
                "kind": exc.kind}
    except Exception as exc:  # noqa: BLE001 - said to the holder, as a Ray call would
        return {"error": "ProviderError", "kind": "transient",
                "message": ("%s: %s" % (type(exc).__name__, exc))[:MESSAGE_LIMIT]}
    if isinstance(done, dict):
        return dict(done, done=True)
    return {"done": bool(done)}


def _request(op: str, sandbox_id: str, token: str, reclaim: bool) -> bytes:
    return json.dumps({"op": op, "sandbox": sandbox_id, "token": token,
                       "reclaim": reclaim}).encode() + b"\n"


def _outcome(line: bytes) -> dict:
    """The answer (its ``done`` a bool), or the agent's error raised here."""
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        raise ProtocolError("the agent's control socket answered %r" % line[:200])
    if "error" in answer:
        kind = answer.get("kind") if answer.get("kind") in ("throttled", "transient") else "fatal"
        if answer["error"] == "NotSupported":
            raise NotSupported(answer.get("message", ""))
        if answer["error"] == "ProtocolError":
            raise ProtocolError(answer.get("message", ""))
        raise ProviderError(answer.get("message", ""), kind)
    return dict(answer, done=bool(answer.get("done")))


def ask(path: str, op: str, sandbox_id: str, token: str, reclaim: bool = False) -> Optional[bool]:
    """The agent's answer to one request (True: done); None when the socket cannot be
    reached (nothing listens at ``path``, it is not this process's to open, its backlog
    is full) or the agent went away before it answered: ask its actor, or the pool."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(path)
        except OSError:
            return None
        sock.settimeout(_timeout(op, reclaim))
        answer = b""
        try:
            sock.sendall(_request(op, sandbox_id, token, reclaim))
            while not answer.endswith(b"\n") and len(answer) <= ANSWER_LIMIT:
                chunk = sock.recv(ANSWER_LIMIT)
                if not chunk:
                    break
                answer += chunk
        except socket.timeout:
            raise _late(op, sandbox_id, reclaim) from None
        except ConnectionError:
            return None  # the agent went away meanwhile
    return _outcome(answer)["done"] if answer else None


async def ask_async(path: str, op: str, sandbox_id: str, token: str,
                    reclaim: bool = False) -> Optional[bool]:
    """``ask`` for asyncio code."""
    answer = await _exchange_async(path, op, sandbox_id, token, reclaim)
    return None if answer is None else answer["done"]


async def renew_async(path: str, sandbox_id: str, token: str) -> Optional[Dict[str, str]]:
    """A renew of the sandbox by its holder: its new ``token`` and ``address``; None when
    it was not done (a token it does not take) or the socket cannot be reached (then
    the pool resets it, at the lease's release)."""
    answer = await _exchange_async(path, "renew", sandbox_id, token, False)
    if answer is None or not answer["done"] or not isinstance(answer.get("token"), str) or \
            not isinstance(answer.get("address"), str):
        return None
    return {"token": answer["token"], "address": answer["address"]}


async def _exchange_async(path: str, op: str, sandbox_id: str, token: str,
                          reclaim: bool) -> Optional[dict]:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(path, limit=ANSWER_LIMIT), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(_request(op, sandbox_id, token, reclaim))
        answer = await asyncio.wait_for(reader.readline(), _timeout(op, reclaim))
    except asyncio.TimeoutError:
        raise _late(op, sandbox_id, reclaim) from None
    except ConnectionError:
        return None
    except ValueError:  # an answer past ANSWER_LIMIT
        raise ProtocolError("the agent's control socket answered more than %d bytes"
                            % ANSWER_LIMIT) from None
    finally:
        writer.close()
    return _outcome(answer) if answer else None


def _timeout(op: str, reclaim: bool) -> float:
    return RENEW_TIMEOUT_S if op == "renew" else RECLAIM_TIMEOUT_S if reclaim else \
        ANSWER_TIMEOUT_S


def _late(op: str, sandbox_id: str, reclaim: bool) -> ProviderError:
    return ProviderError("%s of sandbox %s: the node agent did not answer within %.0f s"
                         % (op, sandbox_id, _timeout(op, reclaim)), "transient")
