"""The wire: the protocol's constants and limits, its codec, its frames and its op table.

Imported by both ends: the daemon, and the client on the host (``sandman_ray.client``),
so both share one definition of the wire format and of every op. The protocol is
documented in ``docs/protocol.md`` beside the package: 4-byte big-endian length + one
msgpack map per frame.
"""

import struct

try:  # the C extension when the image (or the client) has it; the bundle does not
    import msgpack as _msgpack
except ImportError:  # pragma: no cover - exercised by the bundle tests
    _msgpack = None

PROTOCOL_VERSION = 2  # 2: ops named as the client's methods (run, read_file, ...)
MAX_FRAME = 64 * 1024 * 1024          # contract: a larger length closes the connection
MAX_STREAM_CAP = 16 * 1024 * 1024     # output cap per stream (two streams fit one frame)
DEFAULT_OUTPUT_CAP = 4 * 1024 * 1024
MAX_READ = 32 * 1024 * 1024           # read_file answers at most this many bytes per call
MAX_IN_FLIGHT = 1024                  # requests in flight per connection
MAX_DEPTH = 64                        # nesting limit of decoded msgpack values
HELLO_TIMEOUT_S = 10.0                # a connection that does not say hello is closed
HELLO_MAX_FRAME = 4096                # before the hello, frames are at most this long
MAX_UNAUTHENTICATED = 64              # connections at once that have not said hello
MAX_UPLOADS_PER_CONNECTION = 16       # tar uploads open on one connection
MAX_UPLOADS = 64                      # ... and on all connections together
MAX_LIST_BYTES = MAX_FRAME // 2       # a directory listing stops (truncated) past this
DEFAULT_KILL_GRACE_S = 2.0            # TERM, then KILL after this long
KILL_SETTLE_S = 2.0                   # how long to watch killed processes disappear
PROC_RING_BYTES = 1024 * 1024         # per-stream ring buffer of a background process
MAX_FINISHED_PROCS = 256              # exited background processes remembered
MAX_COMMAND_ID = 256                  # characters of a command id
MAX_RUNNING_COMMANDS = 4096           # commands with an id running at once
MAX_KEPT_ANSWERS = 1024               # answers of finished commands with an id kept ...
MAX_KEPT_ANSWER_BYTES = 64 * 1024 * 1024  # ... holding at most this much output
MAX_REMEMBERED_IDS = 65536            # ids of older commands, whose retry is refused
MAX_TERMINALS = 64                    # terminals open at once
TERMINAL_RING_BYTES = 1024 * 1024     # output a terminal keeps
CHUNK = 1024 * 1024                   # tar stream chunk size
_HEADER = struct.Struct(">I")


# --------------------------------------------------------------------------- codec
class CodecError(ValueError):
    """A value cannot be encoded, or bytes are not one valid msgpack value."""


def _pack_into(out, obj, depth):
    if depth > MAX_DEPTH:
        raise CodecError("value nested deeper than %d" % MAX_DEPTH)
    if obj is None:
        out += b"\xc0"
    elif obj is True:
        out += b"\xc3"
    elif obj is False:
        out += b"\xc2"
    elif isinstance(obj, int):
        if 0 <= obj < 0x80:
            out.append(obj)
        elif -32 <= obj < 0:
            out.append(obj & 0xFF)
        elif obj >= 0:
            if obj <= 0xFF:
                out += struct.pack(">BB", 0xCC, obj)
            elif obj <= 0xFFFF:
                out += struct.pack(">BH", 0xCD, obj)
            elif obj <= 0xFFFFFFFF:
                out += struct.pack(">BI", 0xCE, obj)
            elif obj <= 0xFFFFFFFFFFFFFFFF:
                out += struct.pack(">BQ", 0xCF, obj)
            else:
                raise CodecError("integer too large for msgpack: %d" % obj)
        elif obj >= -0x80:
            out += struct.pack(">Bb", 0xD0, obj)
        elif obj >= -0x8000:
            out += struct.pack(">Bh", 0xD1, obj)
        elif obj >= -0x80000000:
            out += struct.pack(">Bi", 0xD2, obj)
        elif obj >= -0x8000000000000000:
            out += struct.pack(">Bq", 0xD3, obj)
        else:
            raise CodecError("integer too small for msgpack: %d" % obj)
    elif isinstance(obj, float):
        out += struct.pack(">Bd", 0xCB, obj)
    elif isinstance(obj, str):
        try:
            data = obj.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: msgpack refuses it too
            raise CodecError("string not encodable as UTF-8: %s" % exc)
        n = len(data)
        if n < 32:
            out.append(0xA0 | n)
        elif n <= 0xFF:
            out += struct.pack(">BB", 0xD9, n)
        elif n <= 0xFFFF:
            out += struct.pack(">BH", 0xDA, n)
        else:
            out += struct.pack(">BI", 0xDB, n)
        out += data
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        n = len(obj)
        if n <= 0xFF:
            out += struct.pack(">BB", 0xC4, n)
        elif n <= 0xFFFF:
            out += struct.pack(">BH", 0xC5, n)
        else:
            out += struct.pack(">BI", 0xC6, n)
        out += obj
    elif isinstance(obj, (list, tuple)):
        n = len(obj)
        if n < 16:
            out.append(0x90 | n)
        elif n <= 0xFFFF:
            out += struct.pack(">BH", 0xDC, n)
        else:
            out += struct.pack(">BI", 0xDD, n)
        for item in obj:
            _pack_into(out, item, depth + 1)
    elif isinstance(obj, dict):
        n = len(obj)
        if n < 16:
            out.append(0x80 | n)
        elif n <= 0xFFFF:
            out += struct.pack(">BH", 0xDE, n)
        else:
            out += struct.pack(">BI", 0xDF, n)
        for key, value in obj.items():
            _pack_into(out, key, depth + 1)
            _pack_into(out, value, depth + 1)
    else:
        raise CodecError("cannot encode %s" % type(obj).__name__)


def pack_native(obj):
    """Encode like ``msgpack.packb(obj, use_bin_type=True)``, byte for byte."""
    out = bytearray()
    _pack_into(out, obj, 0)
    return bytes(out)


# (struct format, payload size) of fixed-width scalars by type byte
_SCALARS = {
    0xCA: (">f", 4), 0xCB: (">d", 8),
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
}
# (kind, length format, length size) of sized values by type byte
_SIZED = {
    0xC4: ("bin", ">B", 1), 0xC5: ("bin", ">H", 2), 0xC6: ("bin", ">I", 4),
    0xD9: ("str", ">B", 1), 0xDA: ("str", ">H", 2), 0xDB: ("str", ">I", 4),
    0xDC: ("array", ">H", 2), 0xDD: ("array", ">I", 4),
    0xDE: ("map", ">H", 2), 0xDF: ("map", ">I", 4),
}


class _Reader:
    """Decodes one msgpack value from untrusted bytes: every length and count is checked
    against the bytes that remain before anything is allocated."""

    __slots__ = ("data", "pos")

    def __init__(self, data):
        self.data = data
        self.pos = 0

    def take(self, n):
        end = self.pos + n
        if end > len(self.data):
            raise CodecError("truncated value: need %d bytes at offset %d, have %d"
                             % (n, self.pos, len(self.data) - self.pos))
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def value(self, depth):
        if depth > MAX_DEPTH:
            raise CodecError("value nested deeper than %d" % MAX_DEPTH)
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, depth)
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        scalar = _SCALARS.get(b)
        if scalar is not None:
            return struct.unpack(scalar[0], self.take(scalar[1]))[0]
        sized = _SIZED.get(b)
        if sized is None:
            raise CodecError("unsupported msgpack type byte 0x%02x" % b)
        kind, fmt, size = sized
        n = struct.unpack(fmt, self.take(size))[0]
        if kind == "bin":
            return bytes(self.take(n))
        if kind == "str":
            return self.text(n)
        if kind == "array":
            return self.array(n, depth)
        return self.map(n, depth)

    def text(self, n):
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError("invalid utf-8 in str: %s" % exc)

    def _check_count(self, n, min_bytes_each):
        if n * min_bytes_each > len(self.data) - self.pos:
            raise CodecError("count %d exceeds the %d bytes left"
                             % (n, len(self.data) - self.pos))

    def array(self, n, depth):
        self._check_count(n, 1)
        return [self.value(depth + 1) for _ in range(n)]

    def map(self, n, depth):
        self._check_count(n, 2)
        out = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if not isinstance(key, (str, bytes)):
                raise CodecError("map key must be str or bytes, got %s" % type(key).__name__)
            out[key] = self.value(depth + 1)
        return out


def unpack_native(data):
    """Decode exactly one msgpack value (``msgpack.unpackb`` semantics, no ext types)."""
    reader = _Reader(memoryview(data))
    value = reader.value(0)
    if reader.pos != len(data):
        raise CodecError("%d bytes of extra data after the value" % (len(data) - reader.pos))
    return value


if _msgpack is not None:
    def pack(obj):
        try:
            return _msgpack.packb(obj, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise CodecError(str(exc))

    def unpack(data):
        try:
            return _msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise CodecError("%s: %s" % (type(exc).__name__, exc))
else:
    pack = pack_native
    unpack = unpack_native


def encode_frame(msg):
    body = pack(msg)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into frame bodies; refuses a length over ``max_frame``."""

    def __init__(self, max_frame=MAX_FRAME):
        self.max_frame = max_frame
        self.buf = bytearray()

    def feed(self, data, one=False):
        """Add bytes; return the list of complete frame bodies (``one``: at most one,
        the rest stays buffered). Raises CodecError when a header announces more than
        ``max_frame`` bytes (the stream cannot be trusted)."""
        if not self.buf and len(data) >= 4:
            (n,) = _HEADER.unpack_from(data)
            if n == len(data) - 4 and n <= self.max_frame:
                return [data[4:]]  # exactly one whole frame: the usual case, no copying
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > self.max_frame:
                raise CodecError("frame of %d bytes exceeds the limit of %d" % (n, self.max_frame))
            if len(self.buf) < 4 + n:
                break
            with memoryview(self.buf) as view:  # one copy, not a slice and a copy
                frames.append(bytes(view[4:4 + n]))
            del self.buf[:4 + n]
            if one:
                break
        return frames


# --------------------------------------------------------------------------- op table
class Field:
    """One field of a request: the types it takes and whether it must be given.

    types: the Python types the value may decode to, compared exactly (msgpack decodes
        to these very types; a bool is never taken where an int is asked for).
    required: it must be present and not null; an optional field may be absent or null,
        and then the op's default applies (docs/protocol.md says which).
    """

    __slots__ = ("types", "required")

    def __init__(self, types, required):
        self.types, self.required = types, required


def required(*types):
    return Field(types, True)


def optional(*types):
    return Field(types, False)


class Op:
    """One operation, named as the client's method that sends it.

    kind: how the daemon answers it. ``sync``: at once, from the request; ``conn``: at
        once, given the connection (uploads belong to one); ``async``: from a task;
        ``callback``: from the event that ends it, without a task (the hot path:
        ``exec``, ``run``); ``stream``: from a task that sends events before its reply;
        ``hello``: the connection's first frame, answered by the connection itself;
        ``composite``: not on the wire, the client's sequence of ``steps``.
    public: a SandboxHandle forwards it, by this name, to the client's method.
    fields: field name -> Field; a request with any other field is refused.
    steps: for a composite, the wire ops it is made of, in order.
    """

    __slots__ = ("name", "kind", "public", "fields", "steps", "accepts", "required")

    def __init__(self, name, kind, public, fields, steps=()):
        self.name, self.kind, self.public, self.fields, self.steps = (
            name, kind, public, fields, steps)
        # what a request may hold, for the daemon's check: exact types by field name,
        # null included where the field is optional
        self.accepts = {"op": frozenset((str,)), "id": frozenset((int,))}
        for key, spec in fields.items():
            self.accepts[key] = frozenset(spec.types + (() if spec.required else (type(None),)))
        self.required = tuple(key for key, spec in fields.items() if spec.required)


# Every op of the protocol, once. What each field means and its default are in
# docs/protocol.md, beside each op (tests/test_protocol_doc.py checks that every op and
# field is there); the client's method of each name takes its fields as parameters
# (tests/test_op_table.py).
_NUMBER = (int, float)
_GRACE = {"kill_grace_s": optional(*_NUMBER)}
_COMMAND = {"cmd": required(str, list), "cwd": optional(str), "env": optional(dict),
            "stdin": optional(bytes, str)}
_PID = {"pid": required(int)}
_PATH = {"path": required(str)}

# Ops only a connection that said hello with the admin token may call.
ADMIN_OPS = frozenset({"renew"})

OPS = (
    # the daemon (daemon.py)
    Op("hello", "hello", False, {"token": required(str), "version": required(int)}),
    Op("ping", "sync", True, {}),
    Op("info", "sync", True, {}),
    Op("shutdown", "async", False, _GRACE),
    # the launcher's own (its admin token, not a lease's): the sandbox for its next lease
    Op("renew", "stream", False, {"phase": required(str), "root": optional(str),
                                  "token": optional(str), "admin": optional(str)}),
    # the lease's own environment and working directory, until a renew (daemon.py)
    Op("bind", "sync", False, {"env": optional(dict), "workdir": optional(str)}),
    # one-shot commands (ops/exec.py)
    Op("exec", "callback", True, dict(_COMMAND, timeout=optional(*_NUMBER), **_GRACE,
                                      max_output=optional(*_NUMBER), stream=optional(bool),
                                      command_id=optional(str))),
    # a request in flight on this connection, given up (connection.py)
    Op("cancel", "conn", False, {"target": required(int)}),
    # shell sessions (ops/sessions.py)
    Op("session_open", "async", True, {"session": optional(str), "shell": optional(str),
                                       "cwd": optional(str), "env": optional(dict)}),
    Op("run", "callback", True, {"session": optional(str), "cmd": required(str),
                                 "timeout": optional(*_NUMBER), "max_output": optional(*_NUMBER),
                                 "command_id": optional(str), **_GRACE}),
    Op("session_close", "async", True, dict({"session": optional(str)}, **_GRACE)),
    Op("session_list", "sync", True, {}),
    # background processes (ops/procs.py)
    Op("spawn", "sync", True, dict(_COMMAND, buffer_bytes=optional(*_NUMBER),
                                   command_id=optional(str), stdin_open=optional(bool))),
    Op("proc_status", "sync", True, _PID),
    Op("proc_list", "sync", True, {}),
    Op("proc_output", "sync", True, dict(_PID, stream=optional(str), cursor=optional(int),
                                         max_bytes=optional(*_NUMBER))),
    Op("proc_wait", "async", True, dict(_PID, timeout=optional(*_NUMBER))),
    Op("proc_follow", "stream", True, dict(_PID, stdout_cursor=optional(int),
                                           stderr_cursor=optional(int))),
    Op("proc_stdin", "async", True, dict(_PID, data=optional(bytes, str), close=optional(bool))),
    Op("proc_signal", "sync", True, dict(_PID, signal=optional(int, str), group=optional(bool))),
    # terminals (ops/terminals.py)
    Op("pty_open", "sync", True, dict(_COMMAND, cmd=optional(str, list), cols=optional(int),
                                      rows=optional(int), buffer_bytes=optional(*_NUMBER))),
    Op("pty_write", "async", True, {"pty": required(int), "data": required(bytes, str)}),
    Op("pty_read", "async", True, {"pty": required(int), "cursor": optional(int),
                                   "max_bytes": optional(*_NUMBER), "timeout": optional(*_NUMBER)}),
    Op("pty_resize", "sync", True, {"pty": required(int), "cols": required(int),
                                    "rows": required(int)}),
    Op("pty_close", "async", True, dict({"pty": required(int)}, **_GRACE)),
    Op("pty_list", "sync", True, {}),
    # files and archives (ops/files.py)
    Op("read_file", "async", True, dict(_PATH, offset=optional(int), length=optional(int))),
    Op("write_file", "sync", True, dict(_PATH, data=required(bytes, str), mode=optional(int),
                                        parents=optional(bool), append=optional(bool))),
    Op("stat", "sync", True, dict(_PATH, follow_symlinks=optional(bool))),
    Op("list_dir", "sync", True, dict(_PATH, limit=optional(int))),
    Op("mkdir", "sync", True, dict(_PATH, parents=optional(bool), mode=optional(int))),
    Op("remove", "async", True, dict(_PATH, recursive=optional(bool), missing_ok=optional(bool))),
    Op("move", "async", True, {"src": required(str), "dst": required(str),
                               "overwrite": optional(bool)}),
    Op("watch_dir", "stream", True, dict(_PATH, recursive=optional(bool))),
    Op("get_archive", "stream", True, _PATH),
    Op("put_archive", "composite", True, dict(_PATH, tar=required(bytes)),
       steps=("put_archive_begin", "put_archive_data", "put_archive_end")),
    Op("put_archive_begin", "conn", False, _PATH),
    Op("put_archive_data", "conn", False, {"upload": required(int), "data": required(bytes)}),
    Op("put_archive_end", "stream", False, {"upload": required(int)}),
)
