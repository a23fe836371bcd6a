"""Connect's protocol, the part that envd's clients speak: unary calls in JSON, server
streams of JSON messages in envelopes, client streams read envelope by envelope, and
errors in its shape (``{"code": "not_found", "message": ...}``).

An envelope is one flags byte, the message's length (4 bytes, big-endian) and the
message; a stream's last envelope has flag END_STREAM and holds ``{}`` or
``{"error": ...}``. Messages are protobuf's JSON mapping: fields in lowerCamelCase,
bytes in base64, 64-bit integers as strings, enums by name.
"""

import base64
import binascii
import json
import struct
from typing import AsyncIterator, Optional

from aiohttp import web

from sandman_ray.service.answers import read_at_most

JSON = "application/json"
STREAM_JSON = "application/connect+json"
END_STREAM = 0x02
COMPRESSED = 0x01
MESSAGE_MAX = 4 * 1024 * 1024  # most bytes one request message may hold

# Connect's codes, as HTTP statuses (a unary call's error; a stream's is in its end)
STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400,
          "deadline_exceeded": 504, "not_found": 404, "already_exists": 409,
          "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
          "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500,
          "unavailable": 503, "data_loss": 500, "unauthenticated": 401}


class RpcError(Exception):
    """A call's failure: one of Connect's codes and a message."""

    def __init__(self, code: str, message: str):
        assert code in STATUS, code
        super().__init__(message)
        self.code, self.message = code, message

    def body(self) -> dict:
        return {"code": self.code, "message": self.message}


def invalid(message: str) -> RpcError:
    return RpcError("invalid_argument", message)


def envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(error: Optional[RpcError] = None) -> bytes:
    return envelope({"error": error.body()} if error is not None else {}, END_STREAM)


def error_response(error: RpcError) -> web.Response:
    return web.json_response(error.body(), status=STATUS[error.code])


def _message(data: bytes) -> dict:
    try:
        message = json.loads(data or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise invalid("the message is not JSON") from None
    if not isinstance(message, dict):
        raise invalid("the message is a JSON object")
    return message


def _content_type(request) -> str:
    return request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()


async def unary_request(request) -> dict:
    """The message of a unary call (``application/json``)."""
    if _content_type(request) != JSON:
        raise RpcError("unimplemented", "unary calls are served in JSON (application/json), "
                       "not %r" % _content_type(request))
    data = await read_at_most(request, MESSAGE_MAX)
    if len(data) > MESSAGE_MAX:
        raise RpcError("resource_exhausted", "a message is at most %d bytes" % MESSAGE_MAX)
    return _message(data)


async def envelopes(request) -> AsyncIterator[dict]:
    """The messages of a streamed request (``application/connect+json``), as they come."""
    if _content_type(request) != STREAM_JSON:
        raise RpcError("unimplemented", "streaming calls are served in JSON "
                       "(application/connect+json), not %r" % _content_type(request))
    while True:
        try:
            head = await request.content.readexactly(5)
        except Exception:  # noqa: BLE001 - the body ended (between envelopes: its end)
            return
        flags, length = struct.unpack(">BI", head)
        if flags & COMPRESSED:
            raise invalid("compressed messages are not served")
        if length > MESSAGE_MAX:
            raise RpcError("resource_exhausted", "a message is at most %d bytes" % MESSAGE_MAX)
        try:
            data = await request.content.readexactly(length)
        except Exception:  # noqa: BLE001
            raise invalid("the body ended inside a message") from None
        if flags & END_STREAM:
            return
        yield _message(data)


async def stream_request(request) -> dict:
    """The one message of a server-streaming call."""
    async for message in envelopes(request):
        return message
    raise invalid("the request holds no message")


def timeout_s(request) -> Optional[float]:
    """The call's deadline (``Connect-Timeout-Ms``), in seconds from now; None: none."""
    value = request.headers.get("Connect-Timeout-Ms")
    if value is None:
        return None
    if not value.isdigit() or len(value) > 10:
        raise invalid("Connect-Timeout-Ms is a positive integer of at most 10 digits")
    return int(value) / 1000.0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text, name: str) -> bytes:
    """Bytes of protobuf's JSON mapping (standard or URL-safe base64, padded or not)."""
    if not isinstance(text, str):
        raise invalid("%s is base64 text" % name)
    text = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise invalid("%s is not base64" % name) from None


def text(message: dict, name: str, default: Optional[str] = "") -> Optional[str]:
    value = message.get(name, default)
    if value is not None and not isinstance(value, str):
        raise invalid("%s is a string" % name)
    return value


def integer(value, name: str, low: int = 0, high: int = (1 << 32) - 1) -> int:
    """An integer field (64-bit ones come as strings)."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise invalid("%s is an integer from %d to %d" % (name, low, high))
    return value
