#!/usr/bin/env python3
"""sandmand: the daemon that runs inside a sandbox.

One file, standard library only, Python 3.8 or newer. It is mounted read-only into an
unmodified task image (at ``/.sandman``) and keeps files, shell sessions and background
processes alive across calls. The wire protocol is documented in ``docs/protocol.md``
beside this file: 4-byte big-endian length + one msgpack map per frame.

Usage::

    sandmand.py --listen unix:/run/sandman/sock | tcp:HOST:PORT | fd:N
                [--token-file FILE | --token-fd N]   (else the SANDMAN_TOKEN variable;
                                                      the file is removed once read)
                [--workdir DIR] [--ready-fd N] [--max-output BYTES]
                [--hello-timeout SECONDS] [--user UID[:GID]] [--limits K=V,...]
                [--socket-mode OCTAL]   (a unix socket's mode, default 0600)
                [--oom-counter FILE]    (the sandbox's cgroup OOM kill count: v2
                                         memory.events or v1 memory.oom_control; else
                                         the first of OOM_COUNTERS that can be read)

--user drops to that uid/gid once listening (the socket is handed to it too);
--limits records the limits the launcher applied, reported by ``info``.

The client side (``sandman_ray.client``) imports this module for its frame constants
and its codec, so both ends share one definition of the wire format.
"""

import errno
import os
import stat
import struct
import sys
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)
import _socket            # likewise socket.py

try:  # the C extension when the image (or the client) has it; the bundle does not
    import msgpack as _msgpack
except ImportError:  # pragma: no cover - exercised by the bundle tests
    _msgpack = None

try:
    from _operator import _compare_digest as _tokens_equal
except ImportError:  # pragma: no cover - every CPython has it
    from hmac import compare_digest as _tokens_equal

PROTOCOL_VERSION = 1
MAX_FRAME = 64 * 1024 * 1024          # contract: a larger length closes the connection
MAX_STREAM_CAP = 16 * 1024 * 1024     # output cap per stream (two streams fit one frame)
DEFAULT_OUTPUT_CAP = 4 * 1024 * 1024
MAX_READ = 32 * 1024 * 1024           # file_read answers at most this many bytes per call
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
CHUNK = 1024 * 1024                   # tar stream chunk size
_HEADER = struct.Struct(">I")
# stdlib modules imported on first use; the bundle builder packs these too
LAZY_IMPORTS = ("resource", "subprocess", "shutil", "tarfile", "io", "threading", "heapq",
                "collections", "select")


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
            frames.append(bytes(self.buf[4:4 + n]))
            del self.buf[:4 + n]
            if one:
                break
        return frames


# --------------------------------------------------------------------------- errors
class RequestError(Exception):
    """An error answered to the client: ``{"type": kind, "message": str(self)}``."""

    def __init__(self, kind, message):
        Exception.__init__(self, message)
        self.kind = kind


def bad_request(message):
    return RequestError("BadRequest", message)


def _error_body(exc):
    if isinstance(exc, RequestError):
        return {"type": exc.kind, "message": str(exc)}
    if isinstance(exc, OSError):
        body = {"type": type(exc).__name__, "message": str(exc)}
        if exc.errno:
            body["errno"] = errno.errorcode.get(exc.errno, str(exc.errno))
        return body
    return {"type": "InternalError", "message": "%s: %s" % (type(exc).__name__, exc)}


_MISSING = object()


def field(req, name, types, default=_MISSING):
    """Read ``req[name]``, checking its type; never trust the wire."""
    value = req.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise bad_request("field %r is required" % name)
        return default
    if isinstance(value, bool) and bool not in types:
        raise bad_request("field %r must be %s, got bool" % (name, _type_names(types)))
    if not isinstance(value, types):
        raise bad_request("field %r must be %s, got %s"
                          % (name, _type_names(types), type(value).__name__))
    return value


def _type_names(types):
    return " or ".join(t.__name__ for t in types)


def number_field(req, name, default, low=0.0, high=None):
    value = field(req, name, (int, float), default)
    if value is None:
        return None
    if value < low or (high is not None and value > high):
        raise bad_request("field %r must be in [%s, %s], got %s" % (name, low, high, value))
    return float(value)


def path_field(req, name="path"):
    path = field(req, name, (str,))
    if not path or "\0" in path:
        raise bad_request("field %r must be a non-empty path without NUL bytes" % name)
    return path


def env_field(req, base):
    """The sandbox environment with the request's ``env`` merged over it (None unsets)."""
    extra = field(req, "env", (dict,), None)
    if not extra:
        return base
    env = dict(base)
    for key, value in extra.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise bad_request("env name %r is not a valid variable name" % (key,))
        if value is None:
            env.pop(key, None)
        elif isinstance(value, str) and "\0" not in value:
            env[key] = value
        else:
            raise bad_request("env value of %r must be a string without NUL bytes" % key)
    return env


# --------------------------------------------------------------------------- event loop
# A small event loop of our own instead of asyncio: importing asyncio costs ~140 ms of
# CPU on a small machine (concurrent.futures, logging, inspect ...), paid by every
# sandbox start and reset; this loop and the C modules it uses import in ~5 ms.
class CancelledError(BaseException):
    """A task was cancelled (its connection closed)."""


class Timeout(Exception):
    """wait_for ran out of time."""


class Future:
    """A result that arrives later; ``await`` it inside a Task."""

    __slots__ = ("loop", "_state", "_value", "_callbacks")

    def __init__(self, loop):
        self.loop = loop
        self._state = 0  # 0 pending, 1 result, 2 exception
        self._value = None
        self._callbacks = []

    def done(self):
        return self._state != 0

    def result(self):
        if self._state == 2:
            raise self._value
        if self._state == 0:
            raise RuntimeError("future is not done")
        return self._value

    def exception(self):
        return self._value if self._state == 2 else None

    def set_result(self, value):
        self._settle(1, value)

    def set_exception(self, exc):
        self._settle(2, exc)

    def _settle(self, state, value):
        if self._state:
            raise RuntimeError("future already done")
        self._state, self._value = state, value
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self.loop.call_soon(callback, self)

    def add_done_callback(self, callback):
        if self._state:
            self.loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def remove_done_callback(self, callback):
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def __await__(self):
        if not self._state:
            yield self
        return self.result()

    __iter__ = __await__


class Task(Future):
    """Runs a coroutine: each ``await`` of a pending Future suspends it until the
    Future is done. Cancelling throws CancelledError at the ``await``; the awaited
    Future itself is left alone (others may wait on it too)."""

    __slots__ = ("coro", "waiting")

    def __init__(self, loop, coro):
        Future.__init__(self, loop)
        self.coro = coro
        self.waiting = None
        loop.call_soon(self._step, None, None)

    def _step(self, value, exc):
        if self._state:
            return
        try:
            fut = self.coro.throw(exc) if exc is not None else self.coro.send(value)
        except StopIteration as stop:
            self.set_result(stop.value)
        except BaseException as error:  # CancelledError included: the task is done
            self.set_exception(error)
        else:
            self.waiting = fut
            fut.add_done_callback(self._wakeup)

    def _wakeup(self, fut):
        if fut is not self.waiting:
            return
        self.waiting = None
        if fut._state == 2:
            self._step(None, fut._value)
        else:
            self._step(fut._value, None)

    def cancel(self):
        if self._state:
            return
        if self.waiting is not None:
            self.waiting.remove_done_callback(self._wakeup)
            self.waiting = None
        self.loop.call_soon(self._step, None, CancelledError())


class _Timer:
    __slots__ = ("when", "seq", "callback", "args", "cancelled")

    def __init__(self, when, seq, callback, args):
        self.when, self.seq, self.callback, self.args = when, seq, callback, args
        self.cancelled = False

    def __lt__(self, other):
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self):
        self.cancelled = True


class Loop:
    """epoll readiness, timers, callbacks, signals and calls from threads."""

    def __init__(self):
        import select
        from collections import deque
        self.select = select
        self.epoll = select.epoll()
        self.readers, self.writers, self.masks = {}, {}, {}
        self.ready = deque()
        self.timers = []
        self.seq = 0
        self.signal_handlers = {}
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.add_reader(self.wake_r, self._woken)

    # fds
    def _update(self, fd):
        mask = (self.select.EPOLLIN if fd in self.readers else 0) | \
               (self.select.EPOLLOUT if fd in self.writers else 0)
        old = self.masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            del self.masks[fd]
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass
        elif old:
            self.masks[fd] = mask
            self.epoll.modify(fd, mask)
        else:
            self.masks[fd] = mask
            self.epoll.register(fd, mask)

    def add_reader(self, fd, callback, *args):
        self.readers[fd] = (callback, args)
        self._update(fd)

    def remove_reader(self, fd):
        if self.readers.pop(fd, None) is not None:
            self._update(fd)

    def add_writer(self, fd, callback, *args):
        self.writers[fd] = (callback, args)
        self._update(fd)

    def remove_writer(self, fd):
        if self.writers.pop(fd, None) is not None:
            self._update(fd)

    # callbacks
    def call_soon(self, callback, *args):
        self.ready.append((callback, args))

    def call_soon_threadsafe(self, callback, *args):
        self.ready.append((callback, args))  # deque.append is atomic
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def call_later(self, delay, callback, *args):
        import heapq
        self.seq += 1
        timer = _Timer(time.monotonic() + delay, self.seq, callback, args)
        heapq.heappush(self.timers, timer)
        return timer

    def create_future(self):
        return Future(self)

    def create_task(self, coro):
        return Task(self, coro)

    def run_in_executor(self, _executor, fn, *args):
        """Run a blocking ``fn`` in a thread; the Future settles on the loop."""
        import threading
        fut = self.create_future()

        def work():
            try:
                value = fn(*args)
            except BaseException as exc:
                self.call_soon_threadsafe(_settle, fut, 2, exc)
            else:
                self.call_soon_threadsafe(_settle, fut, 1, value)
        threading.Thread(target=work, daemon=True).start()
        return fut

    # signals
    def add_signal_handler(self, sig, callback, *args):
        import _signal
        self.signal_handlers[sig] = (callback, args)
        _signal.signal(sig, _ignore_signal)
        _signal.set_wakeup_fd(self.wake_w)

    def _woken(self):
        try:
            data = os.read(self.wake_r, 4096)
        except BlockingIOError:
            return
        for sig in set(data):
            handler = self.signal_handlers.get(sig)
            if handler is not None:
                self.call_soon(handler[0], *handler[1])

    # running
    def run_until(self, fut):
        import heapq
        ready, timers = self.ready, self.timers
        poll, readers, writers = self.epoll.poll, self.readers, self.writers
        select = self.select
        in_mask = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
        out_mask = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
        while not fut.done():
            if ready:
                timeout = 0
            elif timers:
                timeout = max(0.0, timers[0].when - time.monotonic())
            else:
                timeout = -1
            try:
                events = poll(timeout)
            except InterruptedError:
                events = ()
            for fd, mask in events:
                if mask & in_mask:
                    handler = readers.get(fd)
                    if handler is not None:
                        ready.append(handler)
                if mask & out_mask:
                    handler = writers.get(fd)
                    if handler is not None:
                        ready.append(handler)
            if timers:
                now = time.monotonic()
                while timers and timers[0].when <= now:
                    timer = heapq.heappop(timers)
                    if not timer.cancelled:
                        ready.append((timer.callback, timer.args))
            for _ in range(len(ready)):
                callback, args = ready.popleft()
                try:
                    callback(*args)
                except Exception as exc:  # a bug in one callback must not stop the daemon
                    _log("callback %r failed: %s: %s" % (callback, type(exc).__name__, exc))
        return fut.result()


def _resolve_once(fut):
    if not fut.done():
        fut.set_result(None)


def _settle(fut, state, value):
    if not fut.done():
        fut._settle(state, value)


def _log(message):
    try:
        os.write(2, ("sandmand: %s\n" % message).encode("utf-8", "replace"))
    except OSError:
        pass


def _ignore_signal(signum, frame):
    pass  # the wake-up fd carries the signal to the loop


def wait_for(loop, fut, timeout):
    """A Future of ``fut``'s result, or Timeout after ``timeout`` seconds (None: no
    limit). ``fut`` is not cancelled on timeout."""
    if timeout is None:
        return fut
    out = loop.create_future()

    def done(f):
        if not out.done():
            timer.cancel()
            out._settle(f._state, f._value)

    def expire():
        if not out.done():
            fut.remove_done_callback(done)
            out.set_exception(Timeout())
    timer = loop.call_later(timeout, expire)
    fut.add_done_callback(done)
    return out


def wait_all(loop, futs, timeout):
    """A Future that resolves (to None) when every future is done or after
    ``timeout`` seconds, whichever comes first."""
    out = loop.create_future()
    pending = [f for f in futs if not f.done()]
    if not pending:
        out.set_result(None)
        return out
    count = [len(pending)]

    def one(_f):
        count[0] -= 1
        if count[0] == 0 and not out.done():
            timer.cancel()
            out.set_result(None)
    timer = loop.call_later(timeout, lambda: out.done() or out.set_result(None))
    for f in pending:
        f.add_done_callback(one)
    return out


class Event:
    """Set once or more; ``wait()`` is a Future done when the event is set."""

    def __init__(self, loop):
        self.loop = loop
        self.flag = False
        self.waiters = []

    def is_set(self):
        return self.flag

    def set(self):
        self.flag = True
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)

    def clear(self):
        self.flag = False

    def wait(self):
        fut = self.loop.create_future()
        if self.flag:
            fut.set_result(True)
        else:
            self.waiters.append(fut)
        return fut


class Lock:
    """First come, first served; ``async with lock``."""

    def __init__(self, loop):
        self.loop = loop
        self.held = False
        self.waiters = []

    async def __aenter__(self):
        if not self.held:
            self.held = True
            return
        fut = self.loop.create_future()
        self.waiters.append(fut)
        try:
            await fut
        except CancelledError:
            if fut.done():
                self._release()  # it was handed to us as we were cancelled
            else:
                self.waiters.remove(fut)
            raise

    async def __aexit__(self, *exc):
        self._release()

    def try_acquire(self):
        """Take the lock if it is free, without waiting; whether it was taken."""
        if self.held:
            return False
        self.held = True
        return True

    def _release(self):
        if self.waiters:
            self.waiters.pop(0).set_result(None)  # the lock passes on, still held
        else:
            self.held = False


# --------------------------------------------------------------------------- processes
def _exit_code(status):
    """(exit code shell-style, signal number or None) from a waitpid status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


def descendants(pid):
    """Pids of every process below ``pid``, from /proc (children of children too)."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: parse after the last ')'
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid, sig, alive=True):
    """Send ``sig`` to ``pid``'s process group and, while ``pid`` itself is alive (not
    yet reaped), to it and every descendant (some may have left the group with setsid).
    Returns the descendants signalled; missing processes are ignored."""
    # the tree first: once the group is signalled its members die and their children
    # are reparented away from ``pid``, out of reach of a later scan
    targets = descendants(pid) if alive else []
    try:
        os.killpg(pid, sig)
    except OSError:
        pass
    if not alive:
        return []
    for target in [pid] + targets:
        try:
            os.kill(target, sig)
        except OSError:
            pass
    return targets


def which(name, env):
    """Resolve a command name on the PATH of ``env`` (None when not found)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for directory in env.get("PATH", DEFAULT_PATH).split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Characters that mean nothing special to a POSIX shell: a command made only of these
# (and spaces) is a plain argv, so it can be started without a shell in between. The
# words below are shell builtins or reserved words whose effect could differ from a
# binary of the same name, so they always go through the shell.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./,:@%+ ")
_SHELL_WORDS = frozenset(
    "alias bg break cd command continue echo eval exec exit export false fc fg getopts hash "
    "jobs kill let local printf pwd read readonly return set shift source test times trap "
    "type ulimit umask unalias unset wait . time function select if then else elif fi case "
    "esac for while until do done in".split())


def plain_argv(cmd):
    """The argv of a shell string that needs no shell (``true``, ``ls -la /tmp``), or
    None. Starting it directly saves the shell's own start (~0.1 ms of a ~0.6 ms spawn,
    measured here); a name that is not found still goes through the shell, which reports
    it with its usual message and exit code 127."""
    if not cmd or len(cmd) > 4096 or not _PLAIN.issuperset(cmd):
        return None
    argv = cmd.split()
    if not argv or argv[0] in _SHELL_WORDS:
        return None
    return argv


class Children:
    """Knows when each child we started exits. A pidfd per child (Linux 5.3+, Python
    3.9+) reports the exit in the same loop iteration; SIGCHLD with waitpid(-1) reaps
    everything else (orphans when we are PID 1) and is the fallback without pidfds.
    ``watch(pid, callback)``: the callback gets the wait status synchronously, before the
    future resolves, so a reply can be sent without another loop iteration."""

    def __init__(self, loop):
        self.loop = loop
        self.waiting = {}   # pid -> future of its wait status
        self.callbacks = {}
        self.pidfds = {}

    def watch(self, pid, callback=None):
        fut = self.loop.create_future()
        self.waiting[pid] = fut
        if callback is not None:
            self.callbacks[pid] = callback
        if _HAS_PIDFD:
            try:
                fd = os.pidfd_open(pid)  # novermin (only where _HAS_PIDFD)
            except OSError:
                return fut
            self.pidfds[pid] = fd
            self.loop.add_reader(fd, self._pidfd_ready, pid)
        return fut

    def _pidfd_ready(self, pid):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped by reap(); resolved there
        if got == pid:
            self._resolve(pid, status)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            self._resolve(pid, status)

    def _resolve(self, pid, status):
        fut = self.waiting.pop(pid, None)
        callback = self.callbacks.pop(pid, None)
        if callback is not None:
            callback(status)  # first: a reply waits on it; the bookkeeping below does not
        fd = self.pidfds.pop(pid, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        if fut is not None and not fut.done():
            fut.set_result(status)


_HAS_PIDFD = hasattr(os, "pidfd_open")


def spawn(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon):
    """Start ``argv`` in a new session (its own process group) with the given fds as
    0, 1, 2 and every other fd closed. The command name is looked up on the PATH of
    ``env``, as execvp does."""
    if _FORK_EXEC is not None:
        try:
            return _vfork_exec(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon)
        except _SignatureChanged:
            _disable_vfork()
    if cwd is None or cwd == daemon.workdir:
        actions = [(os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                   (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
                   (os.POSIX_SPAWN_DUP2, stderr_fd, 2)]
        if "/" in argv[0]:
            start, path = os.posix_spawn, argv[0]
        elif env.get("PATH") == daemon.path:
            # glibc searches the daemon's own PATH, which is the sandbox's: same answer
            # as which(), without a stat per directory in Python
            start, path = os.posix_spawnp, argv[0]
        else:
            start, path = os.posix_spawn, which(argv[0], env)
            if path is None:
                raise FileNotFoundError(errno.ENOENT, "command not found", argv[0])
        # Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals ignored, so
        # restore the defaults (``yes | head`` must end by SIGPIPE as it does elsewhere)
        return start(path, argv, env, file_actions=actions, setsid=True,
                     setsigdef=_RESTORED_SIGNALS)
    import subprocess
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin_fd, stdout=stdout_fd,
                            stderr=stderr_fd, start_new_session=True, close_fds=True)
    proc.returncode = 0  # Children reaps it; keep Popen from ever waiting on a reused pid
    return proc.pid


# CPython 3.11+ starts subprocesses with vfork through _posixsubprocess.fork_exec; its
# child resets only the signal handlers that are set, where glibc's posix_spawn makes
# two syscalls for every signal (~45 us of a ~0.8 ms spawn of ``true``, measured
# here). The call below is the one subprocess.py makes in 3.11 to 3.13; an
# interpreter whose signature differs falls back to posix_spawn for good.
try:
    from _posixsubprocess import fork_exec as _FORK_EXEC
except ImportError:  # pragma: no cover - every CPython on Linux has it
    _FORK_EXEC = None
if sys.version_info < (3, 11):
    _FORK_EXEC = None


class _SignatureChanged(Exception):
    pass


def _disable_vfork():
    global _FORK_EXEC
    _FORK_EXEC = None


_exec_candidates = {}  # PATH -> its directories, encoded


def encode_env(env):
    return [("%s=%s" % item).encode("utf-8", "surrogateescape") for item in env.items()]


def _vfork_exec(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon):
    name = argv[0].encode("utf-8", "surrogateescape")
    if b"/" in name:
        candidates = (name,)
    else:
        path = env.get("PATH", DEFAULT_PATH)
        dirs = _exec_candidates.get(path)
        if dirs is None:
            dirs = _exec_candidates[path] = tuple(
                (d or ".").encode("utf-8", "surrogateescape") + b"/" for d in path.split(":"))
        candidates = [d + name for d in dirs]
    args = [a.encode("utf-8", "surrogateescape") for a in argv]
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            env_list = daemon.env_list if env is daemon.env else encode_env(env)
            pid = _FORK_EXEC(args, candidates, True, (err_w,), cwd, env_list,
                             stdin_fd, -1, -1, stdout_fd, -1, stderr_fd, err_r, err_w,
                             True, True, -1, None, None, None, -1, None, True)
        except TypeError as exc:
            raise _SignatureChanged(str(exc))
        os.close(err_w)
        err_w = -1
        failure = os.read(err_r, 1024)  # empty once exec closed its end: it started
    finally:
        os.close(err_r)
        if err_w != -1:
            os.close(err_w)
    if not failure:
        return pid
    os.waitpid(pid, 0)  # it exits at once after reporting
    _kind, _, rest = failure.partition(b":")
    code, _, where = rest.partition(b":")
    try:
        number = int(code, 16)
    except ValueError:
        number = errno.EIO
    if where == b"noexec":  # before exec: the working directory
        raise OSError(number, os.strerror(number), cwd)
    raise OSError(number, os.strerror(number), argv[0])


_RESTORED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n))


def cloexec_pipe():
    return os.pipe2(os.O_CLOEXEC)


class Capture:
    """Bytes of one output stream, kept up to ``cap``; the rest is counted and dropped.
    With ``emit`` the kept bytes are handed on as they come instead of stored."""

    __slots__ = ("cap", "data", "total", "kept", "emit")

    def __init__(self, cap, emit=None):
        self.cap = cap
        self.data = bytearray()
        self.total = 0
        self.kept = 0
        self.emit = emit

    def add(self, chunk):
        self.total += len(chunk)
        room = self.cap - self.kept
        if room > 0:
            piece = chunk[:room]
            self.kept += len(piece)
            if self.emit is None:
                self.data += piece
            else:
                self.emit(piece)

    @property
    def truncated(self):
        return self.total > self.kept


class Ring:
    """The last ``cap`` bytes of a stream, addressed by absolute byte offsets."""

    __slots__ = ("cap", "data", "start", "eof")

    def __init__(self, cap):
        self.cap = cap
        self.data = bytearray()
        self.start = 0
        self.eof = False

    def add(self, chunk):
        self.data += chunk
        excess = len(self.data) - self.cap
        if excess > 0:
            del self.data[:excess]
            self.start += excess

    def read(self, cursor, max_bytes):
        dropped = max(0, self.start - cursor)
        cursor = max(cursor, self.start)
        offset = cursor - self.start
        chunk = bytes(self.data[offset:offset + max_bytes])
        return {"data": chunk, "cursor": cursor + len(chunk), "dropped": dropped,
                "eof": self.eof and offset + len(chunk) >= len(self.data)}


class PipeReader:
    """Reads a non-blocking pipe and hands each chunk to ``sink``."""

    __slots__ = ("loop", "fd", "sink", "closed")

    def __init__(self, loop, fd, sink):
        self.loop, self.fd, self.sink = loop, fd, sink
        self.closed = False
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._ready)

    def _ready(self):
        try:
            chunk = os.read(self.fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk:
            self.sink(chunk)
        else:
            self.close()

    def drain(self, max_reads=256):
        """Read what is already in the pipe (the writer has exited) without waiting."""
        for _ in range(max_reads):
            if self.closed:
                return
            try:
                chunk = os.read(self.fd, 65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return
            self.sink(chunk)

    def close(self):
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            os.close(self.fd)


async def write_pipe(loop, fd, data):
    """Write all of ``data`` to a non-blocking pipe, waiting for room without blocking
    the loop. OSError (EPIPE: the reader is gone) propagates."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(fd, _resolve_once, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)


async def write_and_close(loop, fd, data):
    """Feed a command's stdin, then close it; a command that exits without reading
    it all just ends the write."""
    os.set_blocking(fd, False)
    try:
        await write_pipe(loop, fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- daemon
# Where a container (a cgroup namespace of its own) sees its memory cgroup's counters.
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kills(path):
    """The OOM kill count in a cgroup's ``memory.events`` (v2) or ``memory.oom_control``
    (v1) at ``path``; None if it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            for line in fh.read(4096).splitlines():
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class Daemon:
    def __init__(self, token, workdir, default_cap, hello_timeout_s=HELLO_TIMEOUT_S):
        self.token = token
        self.hello_timeout_s = hello_timeout_s
        self.workdir = workdir
        self.default_cap = default_cap
        self.started = time.time()
        self.env = base_environment()
        self.env_list = encode_env(self.env)  # as a spawn takes it (self.env never changes)
        self.path = self.env["PATH"]
        os.environ["PATH"] = self.path  # what posix_spawnp searches
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # see _refuse_one
        self.loop = None
        self.children = None
        self.sessions = {}
        self.procs = {}
        self.uploads = 0  # open on all connections (each holds its own)
        self.next_upload = 1
        self.server = None
        self.socket_path = None
        self.stopping = None
        self.connections = set()
        self.unauthenticated = 0  # of those, the ones that have not said hello
        self.applied_limits = {}
        self.user = None  # (uid, gid) to drop to once listening
        self.socket_mode = 0o600
        self.oom_counter = None  # a file with the sandbox's OOM kill count, if any
        self.recv_buffer = bytearray(262144)
        self.recv_view = memoryview(self.recv_buffer)

    # ---- lifecycle
    def run(self, listen, ready_fd):
        """Serve until shutdown, SIGTERM or SIGINT; then stop every process."""
        self.loop = Loop()
        self.stopping = self.loop.create_future()
        self.children = Children(self.loop)
        if os.getpid() == 1 or not _HAS_PIDFD:
            # As PID 1 we must reap orphans; without pidfds SIGCHLD is how we learn of
            # exits. Otherwise each child's pidfd suffices, and skipping SIGCHLD saves
            # two loop wake-ups per command.
            self.loop.add_signal_handler(signal.SIGCHLD, self.children.reap)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_stop, 0.5)
        self.children.reap()  # anything that exited before the handler was installed
        address = self._listen(listen)
        if self.user is not None:
            self._drop_privileges()
        if ready_fd is not None:
            os.write(ready_fd, (address + "\n").encode())
            os.close(ready_fd)
        self.loop.run_until(self.stopping)
        self.loop.run_until(self.loop.create_task(self._stop_everything()))

    def _listen(self, listen):
        kind, _, where = listen.partition(":")
        if kind == "fd":
            # a socket its launcher bound and listens on: outside the sandbox's reach,
            # it cannot be moved aside or replaced from inside
            sock = _socket.socket(-1, -1, -1, int(where))
            name = sock.getsockname()
            address = "unix:" + name if isinstance(name, str) else "tcp:%s:%d" % name[:2]
            kind = "unix" if isinstance(name, str) else "tcp"
        elif kind == "unix":
            # Bound and listening under a temporary name, then renamed: whoever sees
            # the socket's path can connect (a launcher outside the sandbox may wait for
            # the path to appear).
            building = where + ".new"
            try:
                os.unlink(building)
            except FileNotFoundError:
                pass
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            old = os.umask(0o077)  # the socket is born 0600: only its owner may connect
            try:
                sock.bind(building)
            finally:
                os.umask(old)
            os.chmod(building, self.socket_mode)
            if self.user is not None:
                os.chown(building, self.user[0], self.user[1])
            sock.listen(1024)
            os.rename(building, where)
            self.socket_path = where
            address = "unix:" + where
        elif kind == "tcp":
            host, _, port = where.rpartition(":")
            sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind((host or "127.0.0.1", int(port)))
            bound = sock.getsockname()
            address = "tcp:%s:%d" % (bound[0], bound[1])
        else:
            raise SystemExit("sandmand: --listen must be unix:PATH, tcp:HOST:PORT or fd:N, "
                             "got %r" % listen)
        sock.listen(1024)
        sock.setblocking(False)
        self.server = sock
        self.tcp = kind == "tcp"
        self.loop.add_reader(sock.fileno(), self._accept)
        return address

    def _accept(self):
        while True:
            try:
                fd, _ = self.server._accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_one():
                    continue
                return  # the client already left, or no one is waiting
            sock = _socket.socket(self.server.family, _socket.SOCK_STREAM, 0, fd)
            if self.unauthenticated >= MAX_UNAUTHENTICATED:
                _refuse(sock, "LimitExceeded", "%d connections are waiting to say hello"
                        % self.unauthenticated)
                continue
            if self.tcp:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            Connection(self, sock)

    def _refuse_one(self):
        """Out of fds: accept one waiting connection on the fd kept spare for this, tell
        it why and close it; whether there was one (accept fails with EMFILE whether or
        not a connection waits). The client learns at once instead of at its hello
        timeout, and the listening socket, left readable, would wake the loop without
        end."""
        if self.spare_fd is None:
            return False
        os.close(self.spare_fd)
        self.spare_fd = None
        try:
            fd, _ = self.server._accept()
        except OSError:
            fd = None
        if fd is not None:
            _refuse(_socket.socket(self.server.family, _socket.SOCK_STREAM, 0, fd),
                    "LimitExceeded", "the daemon is out of file descriptors (%d "
                    "connections open)" % len(self.connections))
        self.spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return fd is not None

    def _drop_privileges(self):
        uid, gid = self.user
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    def request_stop(self, grace_s):
        if not self.stopping.done():
            self.stopping.set_result(grace_s)

    async def _stop_everything(self):
        grace = self.stopping.result()
        self.loop.remove_reader(self.server.fileno())
        self.server.close()
        for conn in list(self.connections):
            conn.close()
        pids = [s.pid for s in self.sessions.values() if s.alive]
        pids += [p.pid for p in self.procs.values() if p.running]
        pids += list(self.children.waiting)
        pid1 = os.getpid() == 1
        if pid1:  # forward TERM to everything else that lives in the sandbox
            _kill_all(signal.SIGTERM)
        await self.terminate(pids, grace)
        if pid1:
            _kill_all(signal.SIGKILL)
        if self.socket_path is not None:
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass

    async def terminate(self, pids, grace_s):
        """TERM the process groups and descendants of ``pids``; KILL what is left after
        the grace. A pid already reaped is only addressed as a process group (which
        keeps its id reserved while any member lives), never as a single pid."""
        waiting = self.children.waiting
        trees = {pid: signal_tree(pid, signal.SIGTERM, alive=pid in waiting) for pid in pids}
        pending = [waiting[p] for p in pids if p in waiting]
        if pending:
            await wait_all(self.loop, pending, grace_s)
        for pid, tree in trees.items():
            for target in tree:
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
            signal_tree(pid, signal.SIGKILL, alive=pid in waiting)
        # Killed processes that are not our children exit a moment later, and nothing
        # tells us when: look in /proc until they are gone (bounded), so that a caller
        # told "timed out" finds nothing of the command left.
        remaining = [t for tree in trees.values() for t in tree]
        deadline = time.monotonic() + KILL_SETTLE_S
        while remaining and time.monotonic() < deadline:
            remaining = [t for t in remaining if _running(t)]
            if remaining:
                await self._tick()
        if os.getpid() == 1:
            # As the sandbox's reaper, also wait for every member of the commands'
            # process groups (each command leads its own), including those forked after
            # the tree was read (a fork bomb), and reap them: until then they hold slots
            # of the sandbox's pids limit, and the next command could not start.
            groups = list(pids)
            deadline = time.monotonic() + KILL_SETTLE_S
            while groups and time.monotonic() < deadline:
                self.children.reap()
                groups = [g for g in groups if _group_exists(g)]
                for group in groups:
                    try:
                        os.killpg(group, signal.SIGKILL)
                    except OSError:
                        pass
                if groups:
                    await self._tick()

    async def _tick(self):
        tick = self.loop.create_future()
        self.loop.call_later(0.005, _resolve_once, tick)
        await tick

    # ---- ops that answer at once
    def op_ping(self, req):
        return None

    def op_info(self, req):
        return {
            "pid": os.getpid(), "pid1": os.getpid() == 1,
            "uptime_s": time.time() - self.started,
            "python": sys.version.split()[0],
            "os_release": read_os_release(),
            "hostname": _socket.gethostname(),
            "uid": os.getuid(), "gid": os.getgid(),
            "workdir": self.workdir,
            "cpu_count": os.cpu_count(),
            "limits": dict(read_limits(), applied=self.applied_limits),
            "sessions": sorted(self.sessions),
            "processes": sum(1 for p in self.procs.values() if p.running),
            "protocol": PROTOCOL_VERSION,
        }

    # ---- exec
    def op_exec(self, req, reply):
        """Callback-driven (no task): the reply is sent from the exit notification, so a
        short command costs two loop iterations beyond its own run time."""
        cmd = field(req, "cmd", (str, list))
        if len(req) == 3:  # op, id, cmd: every option at its default (the common case)
            timeout = cwd = None
            env, stdin, cap, grace, stream = self.env, b"", self.default_cap, DEFAULT_KILL_GRACE_S, False
        else:
            timeout = number_field(req, "timeout", None)
            cwd = field(req, "cwd", (str,), None)
            env = env_field(req, self.env)
            stdin = field(req, "stdin", (bytes, str), b"")
            cap = int(number_field(req, "max_output", self.default_cap, 0, MAX_STREAM_CAP))
            grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
            stream = field(req, "stream", (bool,), False)
        if stream:
            out = Capture(cap, lambda chunk: reply.event("stdout", chunk))
            err = Capture(cap, lambda chunk: reply.event("stderr", chunk))
        else:
            out, err = Capture(cap), Capture(cap)
        run = ExecRun(self, reply, out, err, grace)
        run.pid, run.readers, stdin_w = self._start_command(cmd, env, cwd, bool(stdin),
                                                            out.add, err.add, run.exited)
        if stdin:
            self.loop.create_task(write_and_close(self.loop, stdin_w, _as_bytes(stdin)))
        if timeout is not None:
            run.timer = self.loop.call_later(timeout, run.time_out)
        reply.on_cancel = run.cancel

    def _start_command(self, cmd, env, cwd, with_stdin, out_sink, err_sink, on_exit=None):
        """Start a command given as a shell string or an argv list: a plain string runs
        without a shell when its program exists."""
        if isinstance(cmd, str):
            argv = plain_argv(cmd)
            if argv is not None:
                try:
                    return self._start(argv, env, cwd, with_stdin, out_sink, err_sink, on_exit)
                except FileNotFoundError:
                    pass
            return self._start(["/bin/sh", "-c", cmd], env, cwd, with_stdin, out_sink,
                               err_sink, on_exit)
        if not cmd or not all(isinstance(a, str) and a and "\0" not in a for a in cmd):
            raise bad_request("field 'cmd' as a list must be non-empty strings without NUL")
        try:
            return self._start(list(cmd), env, cwd, with_stdin, out_sink, err_sink, on_exit)
        except FileNotFoundError as exc:
            if cwd is not None and not os.path.isdir(cwd):
                raise
            raise RequestError("FileNotFoundError", "command not found: %r (%s)" % (cmd[0], exc))

    def _start(self, argv, env, cwd, with_stdin, out_sink, err_sink, on_exit=None):
        """Spawn with pipes for stdout/stderr (and stdin when asked). Returns the pid,
        the pipe readers and the stdin write end (or None); ``on_exit(status)`` is called
        when it exits (``self.children.waiting[pid]`` resolves then too)."""
        out_r, out_w = cloexec_pipe()
        err_r, err_w = cloexec_pipe()
        in_r, in_w = cloexec_pipe() if with_stdin else (self.devnull, None)
        try:
            pid = spawn(argv, env, cwd, in_r, out_w, err_w, self)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                if fd != self.devnull:
                    os.close(fd)
        self.children.watch(pid, on_exit)
        readers = [PipeReader(self.loop, out_r, out_sink), PipeReader(self.loop, err_r, err_sink)]
        return pid, readers, in_w

    # ---- sessions
    async def op_session_open(self, req):
        name = field(req, "session", (str,), "default")
        if name in self.sessions and self.sessions[name].alive:
            raise RequestError("SessionExists", "session %r is already open" % name)
        env = env_field(req, self.env)
        shell = field(req, "shell", (str,), None) or which("bash", env) or "/bin/sh"
        cwd = field(req, "cwd", (str,), None)
        session = Session(self, name, shell, env, cwd)
        self.sessions[name] = session
        return {"session": name, "shell": shell, "pid": session.pid}

    def op_session_run(self, req, reply):
        """Callback-driven when the shell is free (the common case): the reply is sent
        from the sentinel's arrival, without a task, as ``exec`` does. A command sent
        while another runs queues behind it in a task."""
        name = field(req, "session", (str,), "default")
        cmd = field(req, "cmd", (str,))
        if len(req) == 4 and "session" in req:  # op, id, session, cmd: the common case
            timeout, cap, grace = None, self.default_cap, DEFAULT_KILL_GRACE_S
        else:
            timeout = number_field(req, "timeout", None)
            cap = int(number_field(req, "max_output", self.default_cap, 0, MAX_STREAM_CAP))
            grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
        session = self.sessions.get(name)
        if session is None:
            if name != "default":
                raise RequestError("SessionNotFound", "no session named %r" % name)
            session = self.sessions[name] = Session(self, name, which("bash", self.env)
                                                    or "/bin/sh", self.env, None)
        if session.lock.try_acquire():
            session.start(cmd, timeout, cap, grace, reply)
        else:
            task = self.loop.create_task(session.start_when_free(cmd, timeout, cap, grace,
                                                                 reply))
            reply.on_cancel = task.cancel

    async def op_session_close(self, req):
        name = field(req, "session", (str,), "default")
        session = self.sessions.pop(name, None)
        if session is None:
            raise RequestError("SessionNotFound", "no session named %r" % name)
        await session.close(number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60))
        return {"session": name, "exit_code": session.exit_code}

    def op_session_list(self, req):
        return [{"session": s.name, "pid": s.pid, "shell": s.shell, "alive": s.alive}
                for s in self.sessions.values()]

    # ---- background processes
    def op_spawn(self, req):
        cmd = field(req, "cmd", (str, list))
        env = env_field(req, self.env)
        cwd = field(req, "cwd", (str,), None)
        stdin = field(req, "stdin", (bytes, str), b"")
        ring = int(number_field(req, "buffer_bytes", PROC_RING_BYTES, 1, MAX_STREAM_CAP))
        if sum(1 for p in self.procs.values() if p.running) >= 4096:
            raise RequestError("LimitExceeded", "4096 background processes are running")
        proc = Process(cmd, ring, self.loop)
        proc.pid, readers, stdin_w = self._start_command(cmd, env, cwd, bool(stdin),
                                                         proc.out.add, proc.err.add)
        if stdin:
            self.loop.create_task(write_and_close(self.loop, stdin_w, _as_bytes(stdin)))
        self.procs[proc.pid] = proc
        self.loop.create_task(self._follow(proc, self.children.waiting[proc.pid], readers))
        return {"pid": proc.pid}

    async def _follow(self, proc, exited, readers):
        status = await exited
        for reader in readers:
            reader.drain()
            reader.close()
        proc.exit_code, proc.signal = _exit_code(status)
        proc.ended = time.time()
        proc.out.eof = proc.err.eof = True
        proc.done.set()
        finished = [p for p in self.procs.values() if not p.running]
        for old in sorted(finished, key=lambda p: p.ended)[:-MAX_FINISHED_PROCS]:
            del self.procs[old.pid]

    def _proc(self, req):
        pid = field(req, "pid", (int,))
        proc = self.procs.get(pid)
        if proc is None:
            raise RequestError("ProcessNotFound", "no background process with pid %d" % pid)
        return proc

    def op_proc_status(self, req):
        return self._proc(req).status()

    def op_proc_list(self, req):
        return [p.status() for p in self.procs.values()]

    def op_proc_output(self, req):
        proc = self._proc(req)
        name = field(req, "stream", (str,), "stdout")
        if name not in ("stdout", "stderr"):
            raise bad_request("field 'stream' must be 'stdout' or 'stderr'")
        cursor = field(req, "cursor", (int,), 0)
        max_bytes = int(number_field(req, "max_bytes", MAX_STREAM_CAP, 0, MAX_STREAM_CAP))
        return (proc.out if name == "stdout" else proc.err).read(max(0, cursor), max_bytes)

    async def op_proc_wait(self, req):
        proc = self._proc(req)
        timeout = number_field(req, "timeout", None)
        try:
            await wait_for(self.loop, proc.done.wait(), timeout)
        except Timeout:
            pass
        status = proc.status()
        status["timed_out"] = proc.running
        return status

    def op_proc_signal(self, req):
        proc = self._proc(req)
        sig = signal_number(req.get("signal", "TERM"))
        if proc.running:
            if field(req, "group", (bool,), True):
                signal_tree(proc.pid, sig, alive=True)
            else:
                os.kill(proc.pid, sig)
        return proc.status()

    # ---- files
    def op_file_read(self, req):
        path = path_field(req)
        offset = field(req, "offset", (int,), 0)
        length = field(req, "length", (int,), MAX_READ)
        if offset < 0 or length < 0:
            raise bad_request("offset and length must not be negative")
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(offset)
            data = fh.read(min(length, MAX_READ))
        return {"data": data, "size": size, "eof": offset + len(data) >= size}

    def op_file_write(self, req):
        path = path_field(req)
        data = _as_bytes(field(req, "data", (bytes, str)))
        mode = field(req, "mode", (int,), 0o644) & 0o7777
        append = field(req, "append", (bool,), False)
        parent = os.path.dirname(os.path.abspath(path))
        if field(req, "parents", (bool,), True):
            os.makedirs(parent, exist_ok=True)
        if append:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, mode)
            try:
                _write_fd(fd, data)
            finally:
                os.close(fd)
            return {"size": os.stat(path).st_size}
        # atomic replace: readers see the old file or the new one, never half of it
        tmp = os.path.join(parent, ".%s.sandman-%s" % (os.path.basename(path), os.urandom(6).hex()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            _write_fd(fd, data)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return {"size": len(data)}

    def op_file_stat(self, req):
        return stat_result(path_field(req), field(req, "follow_symlinks", (bool,), False))

    def op_file_list(self, req):
        """Up to ``limit`` entries, and no more than fit half a frame: past either the
        listing stops, with ``truncated`` set."""
        path = path_field(req)
        limit = field(req, "limit", (int,), 100000)
        entries, budget, truncated = [], MAX_LIST_BYTES, False
        with os.scandir(path) as it:
            for entry in it:
                if len(entries) >= limit or budget <= 0:
                    truncated = True
                    break
                try:
                    item = _entry(entry.name, entry.stat(follow_symlinks=False), entry.path)
                except OSError:
                    continue
                budget -= 96 + len(item["name"]) + len(item.get("target") or b"")
                entries.append(item)
        entries.sort(key=lambda e: os.fsencode(e["name"]))
        return {"entries": entries, "truncated": truncated}

    def op_file_mkdir(self, req):
        path = path_field(req)
        mode = field(req, "mode", (int,), 0o755) & 0o7777
        if field(req, "parents", (bool,), True):
            os.makedirs(path, mode, exist_ok=True)
        else:
            os.mkdir(path, mode)
        return None

    async def op_file_remove(self, req):
        path = path_field(req)
        recursive = field(req, "recursive", (bool,), False)
        missing_ok = field(req, "missing_ok", (bool,), False)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                import shutil
                await self.loop.run_in_executor(None, shutil.rmtree, path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
        return None

    async def op_file_move(self, req):
        src, dst = path_field(req, "src"), path_field(req, "dst")
        if not field(req, "overwrite", (bool,), True) and os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "destination exists", dst)
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            import shutil
            await self.loop.run_in_executor(None, shutil.move, src, dst)
        return None

    async def op_tar_get(self, req, reply):
        path = path_field(req)
        if not os.path.lexists(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        writer = _EventWriter(self.loop, reply)
        size = await self.loop.run_in_executor(None, _tar_directory, path, writer)
        return {"size": size}

    # An upload belongs to the connection that began it: no other connection can add
    # to it, and it is dropped (its spool file with it) when that connection closes.
    def op_tar_put_begin(self, req, conn):
        path = path_field(req)
        if len(conn.uploads) >= MAX_UPLOADS_PER_CONNECTION:
            raise RequestError("LimitExceeded", "%d uploads are already open on this "
                               "connection" % MAX_UPLOADS_PER_CONNECTION)
        if self.uploads >= MAX_UPLOADS:
            raise RequestError("LimitExceeded", "%d uploads are already open" % MAX_UPLOADS)
        upload_id = self.next_upload
        self.next_upload += 1
        conn.uploads[upload_id] = (path, _spool_file())
        self.uploads += 1
        return {"upload": upload_id}

    def op_tar_put_data(self, req, conn):
        path, spool = conn.upload(req)
        spool.write(_as_bytes(field(req, "data", (bytes,))))
        return None

    async def op_tar_put_end(self, req, reply):
        path, spool = reply.conn.upload(req)
        reply.conn.drop_upload(req["upload"])
        try:
            spool.seek(0)
            count = await self.loop.run_in_executor(None, _untar, spool, path)
        finally:
            spool.close()
        return {"files": count}

    async def op_shutdown(self, req):
        grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
        self.loop.call_soon(self.request_stop, grace)
        return None


def oom_killed_since(daemon, before):
    """Whether the kernel's OOM killer killed a process of the sandbox since the count
    was ``before``: the command, one of its children, or any other process of the
    sandbox killed meanwhile (the counter is the sandbox's, not the command's)."""
    if before is None:
        return False
    after = oom_kills(daemon.oom_counter)
    return after is not None and after > before


class ExecRun:
    """One ``exec`` in flight: answers its request when the command exits."""

    def __init__(self, daemon, reply, out, err, grace):
        self.daemon, self.reply, self.out, self.err, self.grace = daemon, reply, out, err, grace
        self.start = time.monotonic()
        self.ooms = oom_kills(daemon.oom_counter)
        self.pid = None
        self.readers = ()
        self.timer = None
        self.timed_out = False
        self.killing = None  # the terminate task after a timeout

    def exited(self, status):
        if self.killing is not None and not self.killing.done():
            # timed out: answer once the whole tree is gone, not when its leader is
            self.killing.add_done_callback(lambda _task: self.exited(status))
            return
        if self.timer is not None:
            self.timer.cancel()
        for reader in self.readers:
            reader.drain()
        code, sig = _exit_code(status)
        out, err = self.out, self.err
        self.reply.ok({"exit_code": code, "signal": sig, "timed_out": self.timed_out,
                       "duration_s": time.monotonic() - self.start,
                       "oom_killed": oom_killed_since(self.daemon, self.ooms),
                       "stdout": bytes(out.data), "stderr": bytes(err.data),
                       "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
                       "truncated": out.truncated or err.truncated})
        for reader in self.readers:  # after the reply: closing is not on its path
            reader.close()

    def time_out(self):
        self.timed_out = True
        self.killing = self.daemon.loop.create_task(self.daemon.terminate([self.pid], self.grace))

    def cancel(self):
        """The client went away: stop the command at once."""
        if self.pid in self.daemon.children.waiting:
            self.daemon.loop.create_task(self.daemon.terminate([self.pid], 0))


class Session:
    """A long-lived shell. Each command is followed by a ``printf`` of a random
    sentinel and the exit code to stdout, so the shell itself says when the command
    ended: no prompt scraping, no polling. By then everything the command wrote to
    stderr is in the stderr pipe, which is read to its end without waiting. The
    command runs in the shell's own context (``command eval``), so cwd, variables and
    functions persist; its stdin is /dev/null.

    bash reads its commands from the pipe one byte at a time, and opening /dev/null
    for each command costs as much again: what the shell reads per command is kept
    short, and bash keeps /dev/null open on fd 253 (``STDIN_FD``) to lend to each
    command. Other shells (sh, ash) accept only one-digit fds, and open /dev/null, as
    bash does under an open-file limit of 253 or less."""

    def __init__(self, daemon, name, shell, env, cwd):
        self.daemon, self.name, self.shell = daemon, name, shell
        self.lock = Lock(daemon.loop)
        self.exit_code = None
        self.current = None
        in_r, self.stdin = cloexec_pipe()
        os.set_blocking(self.stdin, False)
        out_r, out_w = cloexec_pipe()
        err_r, err_w = cloexec_pipe()
        bash = shell.endswith("bash")
        argv = [shell, "--noprofile", "--norc"] if bash else [shell]
        # an fd at or over the open-file limit cannot be opened (SC_OPEN_MAX: the limit)
        keep = bash and os.sysconf("SC_OPEN_MAX") > STDIN_FD
        self.stdin_redirect = "<&%d" % STDIN_FD if keep else "</dev/null"
        try:
            if keep:  # in the pipe before any command, so first when the shell reads
                os.write(self.stdin, b"exec %d</dev/null\n" % STDIN_FD)
            self.pid = spawn(argv, env, cwd, in_r, out_w, err_w, daemon)
        except BaseException:
            for fd in (self.stdin, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.exited = daemon.children.watch(self.pid)
        self.exited.add_done_callback(self._on_exit)
        self.readers = [PipeReader(daemon.loop, out_r, lambda c: self._feed(0, c)),
                        PipeReader(daemon.loop, err_r, lambda c: self._feed(1, c))]

    @property
    def alive(self):
        return not self.exited.done()

    def _on_exit(self, fut):
        self.exit_code = _exit_code(fut.result())[0]
        for reader in self.readers:
            reader.drain()
            reader.close()
        os.close(self.stdin)
        if self.current is not None and not self.current.finished.done():
            self.current.flush()
            self.current.done(False)

    def _feed(self, index, chunk):
        run = self.current
        if run is None or run.finished.done():
            return  # output of background jobs, not of a command
        if index == 1:
            run.err.add(chunk)
        elif run.feed(chunk):
            # the command is over, so all its stderr is in the pipe: read it now (a
            # pipe holds at most 1 MiB unless CAP_SYS_RESOURCE, dropped in sandboxes)
            self.readers[1].drain(max_reads=32)
            run.done(True)

    def start(self, cmd, timeout, cap, grace, reply):
        """Run ``cmd`` (the lock is held, and passed to the SessionRun that answers)."""
        try:
            if not self.alive:
                raise RequestError("SessionClosed", "session %r has exited (code %s)"
                                   % (self.name, self.exit_code))
            run = self.begin(cmd, cap)
        except BaseException:
            self.lock._release()
            raise
        SessionRun(self, run, reply, timeout, grace)

    async def start_when_free(self, cmd, timeout, cap, grace, reply):
        """A command sent while another runs: waits for the shell, then as ``start``."""
        try:
            await self.lock.__aenter__()
        except CancelledError:  # the client went away while it waited
            reply.abandon()
            return
        try:
            self.start(cmd, timeout, cap, grace, reply)
        except Exception as exc:
            reply.fail(exc)

    def begin(self, cmd, cap):
        """Hand ``cmd`` to the shell; returns its _SessionCommand."""
        run = self.current = _SessionCommand(self.daemon.loop, cap)
        run.ooms = oom_kills(self.daemon.oom_counter)
        # $? on the second line is the status of the eval
        script = ("command eval %s %s\ncommand printf '%s%%d\\n' $?\n"
                  % (shell_quote(cmd), self.stdin_redirect, run.sentinel_text)).encode()
        try:
            written = os.write(self.stdin, script)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self.current = None
            raise RequestError("SessionClosed", "the shell of session %r is gone: %s"
                               % (self.name, exc))
        if written < len(script):  # the pipe is full: the rest goes as the shell reads
            self.daemon.loop.create_task(self._write_rest(script[written:]))
        return run

    async def _write_rest(self, data):
        try:
            await write_pipe(self.daemon.loop, self.stdin, data)
        except OSError:
            pass  # the shell is gone: its exit ends the command

    def result(self, run, finished, timed_out):
        return {"exit_code": run.exit_code if finished else None,
                "oom_killed": oom_killed_since(self.daemon, run.ooms),
                "stdout": bytes(run.out.data), "stderr": bytes(run.err.data),
                "stdout_truncated": run.out.truncated,
                "stderr_truncated": run.err.truncated,
                "truncated": run.out.truncated or run.err.truncated,
                "timed_out": timed_out, "duration_s": time.monotonic() - run.start,
                "session_alive": self.alive}

    async def _interrupt(self, run, grace):
        """Stop the running command but keep the shell: TERM, then KILL, the shell's
        descendants; if the shell itself is busy (a builtin loop), kill the session."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in descendants(self.pid):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            await wait_all(self.daemon.loop, [run.finished], grace)
            if run.finished.done():
                return run.finished.result()
        await self.daemon.terminate([self.pid], 0)
        await self.exited
        return False

    async def close(self, grace):
        if self.alive:
            await self.daemon.terminate([self.pid], grace)
            await self.exited


class SessionRun:
    """A session command started without a task: answers when the shell writes its
    sentinels, or interrupts it on timeout. The session's lock is held until the
    command is over, even when the client went away, so the next command never reads
    this one's output."""

    def __init__(self, session, run, reply, timeout, grace):
        self.session, self.run, self.reply, self.grace = session, run, reply, grace
        self.timer = None
        self.interrupting = False
        run.on_done = self.finished
        if timeout is not None:
            self.timer = session.daemon.loop.call_later(timeout, self.time_out)

    def finished(self, finished):
        if self.interrupting:
            return  # the interrupt answers once the shell is settled
        if self.timer is not None:
            self.timer.cancel()
        self.answer(finished, False)

    def time_out(self):
        self.interrupting = True
        task = self.session.daemon.loop.create_task(self.session._interrupt(self.run, self.grace))
        task.add_done_callback(self._interrupted)

    def _interrupted(self, task):
        if task.exception() is not None:
            self._free()
            self.reply.fail(task.exception())
        else:
            self.answer(task.result(), True)

    def answer(self, finished, timed_out):
        self._free()
        self.reply.ok(self.session.result(self.run, finished, timed_out))

    def _free(self):
        """The shell is free for the next command."""
        self.session.current = None
        self.session.lock._release()


async def _answer(reply, coro):
    """Run ``coro`` and send its result, or its error, as the reply."""
    try:
        result = await coro
    except CancelledError:  # the client went away
        reply.abandon()
    except Exception as exc:
        reply.fail(exc)
    else:
        reply.ok(result)


class _SessionCommand:
    """Output of one session command; stdout ends at the sentinel written by the shell."""

    def __init__(self, loop, cap):
        # 64 random bits per command: output cannot end a command by accident, not
        # even by printing the sentinels of earlier commands
        self.sentinel_text = _random_hex16()
        self.sentinel = self.sentinel_text.encode()
        self.out, self.err = Capture(cap), Capture(cap)
        self.pending = bytearray()  # stdout held back while it may hold the sentinel
        self.exit_code = None
        self.start = time.monotonic()
        self.ooms = None  # the sandbox's OOM kill count when it started
        self.finished = loop.create_future()
        self.on_done = None  # called with the outcome before ``finished`` is set

    def done(self, finished):
        if not self.finished.done():
            if self.on_done is not None:
                self.on_done(finished)
            self.finished.set_result(finished)

    def feed(self, chunk):
        """Take a chunk of stdout; True once the sentinel and exit code are in."""
        buf = self.pending
        buf += chunk
        at = buf.find(self.sentinel)
        if at < 0:
            keep = len(self.sentinel) - 1
            if len(buf) > keep:
                self.out.add(bytes(buf[:len(buf) - keep]))
                del buf[:len(buf) - keep]
            return False
        end = buf.find(b"\n", at)
        if end < 0:
            return False  # the exit code has not fully arrived yet
        self.exit_code = int(buf[at + len(self.sentinel):end] or b"0")
        self.out.add(bytes(buf[:at]))
        del buf[:]
        return True

    def flush(self):
        """The shell is gone: what was held back while looking for the sentinel is output."""
        self.out.add(bytes(self.pending))
        del self.pending[:]


class Process:
    """A background process started by ``spawn``; output kept in ring buffers."""

    def __init__(self, cmd, ring_bytes, loop):
        self.cmd = cmd
        self.pid = None
        self.out, self.err = Ring(ring_bytes), Ring(ring_bytes)
        self.started = time.time()
        self.ended = None
        self.exit_code = None
        self.signal = None
        self.done = Event(loop)

    @property
    def running(self):
        return not self.done.is_set()

    def status(self):
        return {"pid": self.pid, "cmd": self.cmd, "running": self.running,
                "exit_code": self.exit_code, "signal": self.signal,
                "started_at": self.started, "ended_at": self.ended,
                "stdout_bytes": self.out.start + len(self.out.data),
                "stderr_bytes": self.err.start + len(self.err.data)}


_random_pool = []


def _random_hex16():
    """64 random bits as 16 hex digits; drawn from the OS 256 at a time."""
    if not _random_pool:
        block = os.urandom(2048).hex()
        _random_pool.extend(block[i:i + 16] for i in range(0, 4096, 16))
    return _random_pool.pop()


STDIN_FD = 253  # bash sessions: /dev/null, lent to each command as its stdin


def shell_quote(text):
    return "'" + text.replace("'", "'\\''") + "'"


def signal_number(value):
    if isinstance(value, int) and not isinstance(value, bool):
        sig = value
    elif isinstance(value, str):
        name = value.upper()
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(sig, int):
            raise bad_request("unknown signal %r" % value)
    else:
        raise bad_request("field 'signal' must be a name or a number")
    if not 1 <= int(sig) < 65:
        raise bad_request("signal %r out of range" % value)
    return int(sig)


def _as_bytes(data):
    return data.encode("utf-8") if isinstance(data, str) else data


def _write_fd(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"),
          (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "char"),
          (stat.S_ISBLK, "block"))


def _entry(name, st, path):
    kind = next((k for test, k in _KINDS if test(st.st_mode)), "other")
    entry = {"name": wire_name(name), "type": kind, "size": st.st_size,
             "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime, "uid": st.st_uid,
             "gid": st.st_gid}
    if kind == "symlink":
        try:
            entry["target"] = wire_name(os.readlink(path))
        except OSError:
            entry["target"] = None
    return entry


def wire_name(name):
    """A file name as the wire carries it: a str when it is UTF-8, else its bytes (a
    name the file system holds need not be text)."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return os.fsencode(name)


def stat_result(path, follow):
    st = os.stat(path) if follow else os.lstat(path)
    entry = _entry(os.path.basename(path.rstrip("/")) or path, st, path)
    entry["path"] = wire_name(path)
    return entry


class _EventWriter:
    """A file-like object for tarfile in a worker thread: every CHUNK bytes it hands one
    ``data`` event to the event loop and waits for it to be queued (backpressure)."""

    def __init__(self, loop, reply):
        self.loop, self.reply = loop, reply
        self.buf = bytearray()
        self.total = 0

    def write(self, data):
        self.buf += data
        self.total += len(data)
        while len(self.buf) >= CHUNK:
            self._emit(bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]
        return len(data)

    def flush(self):
        if self.buf:
            self._emit(bytes(self.buf))
            del self.buf[:]

    def _emit(self, chunk):
        import threading
        queued = threading.Event()
        self.loop.call_soon_threadsafe(self._send, chunk, queued)
        queued.wait()

    def _send(self, chunk, queued):
        """On the loop: send one chunk; let the thread go on once the client keeps up."""
        self.reply.event("data", chunk)
        self.reply.conn.writable.wait().add_done_callback(lambda _f: queued.set())


def _tar_directory(path, writer):
    import tarfile
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        # a directory's contents sit under "."; a single file keeps its name
        tar.add(path, arcname="." if os.path.isdir(path) else os.path.basename(path))
    writer.flush()
    return writer.total


def _spool_file():
    """An anonymous temporary file for an upload (memory when /tmp is not writable)."""
    try:
        fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "w+b")
    except (OSError, AttributeError):
        import io
        return io.BytesIO()


def _untar(fileobj, dest):
    """Extract a tar stream under ``dest``; members may not escape it (absolute paths,
    ``..``, links pointing outside, device files are refused)."""
    import tarfile
    os.makedirs(dest, exist_ok=True)
    count = 0
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            _check_member(member, dest)
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, dest, filter="data")
            else:  # pragma: no cover - Python builds without the extraction filters
                tar.extract(member, dest)
            count += 1
    return count


def _check_member(member, dest):
    root = os.path.realpath(dest)
    target = os.path.realpath(os.path.join(root, member.name))
    if os.path.isabs(member.name) or not (target == root or target.startswith(root + os.sep)):
        raise RequestError("UnsafeArchive", "member %r would land outside %s" % (member.name, dest))
    if member.isdev():
        raise RequestError("UnsafeArchive", "member %r is a device file" % member.name)
    if member.issym() or member.islnk():
        base = os.path.dirname(target) if member.issym() else root
        link = os.path.realpath(os.path.join(base, member.linkname))
        if os.path.isabs(member.linkname) or not (link == root or link.startswith(root + os.sep)):
            raise RequestError("UnsafeArchive", "link %r points outside %s" % (member.name, dest))


def _group_exists(pgid):
    """True while any process, a zombie included, is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _running(pid):
    """True while ``pid`` exists. A zombie counts as gone unless we are PID 1: then we
    are its reaper (the loop reaps it between two looks) and, until we do, it still
    holds a slot of the sandbox's pids limit."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            raw = fh.read()
    except OSError:
        return False
    zombie = raw[raw.rfind(b")") + 2:raw.rfind(b")") + 3] == b"Z"
    return not zombie or os.getpid() == 1


def _kill_all(sig):
    try:
        os.kill(-1, sig)  # every process we may signal but ourselves
    except OSError:
        pass


def read_os_release():
    info = {}
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    key, sep, value = line.strip().partition("=")
                    if sep and not key.startswith("#"):
                        info[key] = value.strip().strip("'\"")
            break
        except OSError:
            continue
    return info


def read_limits():
    """What this sandbox is limited by, as seen from inside: rlimits and cgroup files."""
    import resource
    rlimits = {}
    for name in ("AS", "CPU", "NOFILE", "NPROC", "FSIZE", "DATA", "STACK"):
        soft, hard = resource.getrlimit(getattr(resource, "RLIMIT_" + name))
        rlimits[name.lower()] = [None if soft == resource.RLIM_INFINITY else soft,
                                 None if hard == resource.RLIM_INFINITY else hard]
    cgroup = {}
    for key, path in (("memory_max", "/sys/fs/cgroup/memory.max"),
                      ("memory_max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                      ("pids_max", "/sys/fs/cgroup/pids.max"),
                      ("pids_max", "/sys/fs/cgroup/pids/pids.max"),
                      ("cpu_max", "/sys/fs/cgroup/cpu.max"),
                      ("cpu_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")):
        try:
            with open(path) as fh:
                cgroup.setdefault(key, fh.read().strip())
        except OSError:
            continue
    return {"rlimits": rlimits, "cgroup": cgroup}


def base_environment():
    """The environment the daemon was started with, read from /proc/self/environ: the
    interpreter may have added variables (locale coercion sets LC_CTYPE) that commands
    in the sandbox must not inherit. SANDMAN_* variables (the token) are removed."""
    try:
        with open("/proc/self/environ", "rb") as fh:
            raw = fh.read()
        env = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                env[os.fsdecode(key)] = os.fsdecode(value)
    except OSError:
        env = dict(os.environ)
    for key in [k for k in env if k.startswith("SANDMAN_")]:
        del env[key]
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return env


# --------------------------------------------------------------------------- connection
WRITE_HIGH_WATER = 4 * 1024 * 1024  # queued reply bytes past which we stop reading


def _refuse(sock, kind, message):
    """Tell a connection we will not serve why, and close it."""
    try:
        sock.setblocking(False)
        sock.send(encode_frame({"id": None, "ok": False, "error": {"type": kind,
                                                                   "message": message}}))
    except OSError:
        pass
    sock.close()


class Connection:
    """One client connection: frames in, replies and events out, many in flight. A
    client that does not read its replies is not read from either (backpressure)."""

    def __init__(self, daemon, sock):
        self.daemon, self.loop, self.sock = daemon, daemon.loop, sock
        self.fd = sock.fileno()
        self.reader = FrameReader(HELLO_MAX_FRAME)  # a client proves itself first
        self.out = bytearray()
        self.authed = False
        self.uploads = {}  # upload id -> (target path, spool file)
        self.closing = False
        self.closed = False
        self.inflight = {}  # request id -> Reply
        self.writable = Event(self.loop)
        self.writable.set()
        sock.setblocking(False)
        daemon.connections.add(self)
        daemon.unauthenticated += 1
        self.loop.add_reader(self.fd, self._readable)
        self.hello_timer = self.loop.call_later(daemon.hello_timeout_s, self._no_hello)

    # ---- bytes
    def _readable(self):
        try:
            n = self.sock.recv_into(self.daemon.recv_buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n:
            # a view of the daemon's one receive buffer (a fresh 256 KiB bytes object per
            # recv costs an allocation and page faults on every request); the frames are
            # decoded before the next recv
            self.data_received(self.daemon.recv_view[:n])
        else:
            self.close()

    def write(self, data):
        if self.closed:
            return
        if not self.out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
            self.loop.add_writer(self.fd, self._flush)
        self.out += data
        if len(self.out) > WRITE_HIGH_WATER and self.writable.is_set():
            self.writable.clear()
            self.loop.remove_reader(self.fd)

    def _flush(self):
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.fd)
            if self.closing:
                self.close()
                return
        if len(self.out) <= WRITE_HIGH_WATER // 2 and not self.writable.is_set():
            self.writable.set()
            if not self.closing:
                self.loop.add_reader(self.fd, self._readable)

    def close(self):
        """Close now (queued replies are dropped); see ``close_after_flush``."""
        if self.closed:
            return
        self.closed = self.closing = True
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()
        self.daemon.connections.discard(self)
        if not self.authed:
            self.daemon.unauthenticated -= 1
        for upload_id in list(self.uploads):
            self.drop_upload(upload_id)[1].close()
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        for reply in list(self.inflight.values()):
            reply.cancel()
        self.writable.set()

    def upload(self, req):
        upload = self.uploads.get(field(req, "upload", (int,)))
        if upload is None:
            raise RequestError("UploadNotFound", "no open upload %r on this connection"
                               % (req.get("upload"),))
        return upload

    def drop_upload(self, upload_id):
        self.daemon.uploads -= 1
        return self.uploads.pop(upload_id)

    def close_after_flush(self):
        self.closing = True
        self.loop.remove_reader(self.fd)
        if not self.out:
            self.close()

    # ---- frames
    def _no_hello(self):
        self._fail("ProtocolError", "no hello within %.1f s" % self.daemon.hello_timeout_s)

    def _fail(self, kind, message):
        """Answer a protocol violation and close: the stream can no longer be trusted."""
        if not self.closing:
            self.send({"id": None, "ok": False, "error": {"type": kind, "message": message}})
            self.close_after_flush()

    def send(self, msg):
        if self.closing:
            return
        try:
            frame = encode_frame(msg)
        except CodecError as exc:
            frame = encode_frame({"id": msg.get("id"), "ok": False, "error": {
                "type": "InternalError", "message": "reply not encodable: %s" % exc}})
        if len(frame) > MAX_FRAME + 4:  # no client could take it: say so instead
            frame = encode_frame({"id": msg.get("id"), "ok": False, "error": {
                "type": "ReplyTooLarge", "message": "the reply of %d bytes exceeds the frame "
                "limit of %d; ask for less" % (len(frame) - 4, MAX_FRAME)}})
        self.write(frame)

    def data_received(self, data):
        try:
            # before the hello, one frame at a time: what follows it may be larger
            frames = self.reader.feed(data, one=not self.authed)
        except CodecError as exc:
            self._fail("ProtocolError", str(exc))
            return
        for body in frames:
            if self.closing:
                return
            try:
                req = unpack(body)
            except CodecError as exc:
                self._fail("ProtocolError", "undecodable frame: %s" % exc)
                return
            if not isinstance(req, dict):
                self._fail("ProtocolError", "a frame must hold a map, got %s" % type(req).__name__)
                return
            if not self.authed:
                self._hello(req)
                if self.authed and self.reader.buf:
                    self.data_received(b"")  # what came with the hello
            else:
                self._dispatch(req)

    def _hello(self, req):
        token = req.get("token")
        if req.get("op") != "hello":
            self._fail("AuthError", "the first frame must be a hello")
            return
        if not isinstance(token, str) or not _tokens_equal(token.encode(), self.daemon.token.encode()):
            self._fail("AuthError", "wrong token")
            return
        if req.get("version") != PROTOCOL_VERSION:
            self._fail("ProtocolError", "unsupported protocol version %r (this daemon speaks %d)"
                       % (req.get("version"), PROTOCOL_VERSION))
            return
        self.authed = True
        self.daemon.unauthenticated -= 1
        self.reader.max_frame = MAX_FRAME
        self.hello_timer.cancel()
        self.hello_timer = None
        self.send({"id": req.get("id"), "ok": True,
                   "result": {"version": PROTOCOL_VERSION, "pid": os.getpid(),
                              "python": sys.version.split()[0]}})

    def _dispatch(self, req):
        rid = req.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            self.send({"id": None, "ok": False, "error": {
                "type": "BadRequest", "message": "field 'id' must be an int"}})
            return
        op = req.get("op")
        handler = OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            self.send({"id": rid, "ok": False, "error": {
                "type": "UnknownOp", "message": "unknown op %r" % (op,)}})
            return
        method, kind = handler
        if kind in ("sync", "conn"):
            try:
                result = method(self.daemon, req) if kind == "sync" else \
                    method(self.daemon, req, self)
            except Exception as exc:
                self.send({"id": rid, "ok": False, "error": _error_body(exc)})
            else:
                self.send({"id": rid, "ok": True, "result": result})
            return
        if rid in self.inflight:
            self.send({"id": rid, "ok": False, "error": {
                "type": "BadRequest", "message": "request id %d is already in flight" % rid}})
            return
        if len(self.inflight) >= MAX_IN_FLIGHT:
            self.send({"id": rid, "ok": False, "error": {
                "type": "LimitExceeded", "message": "%d requests in flight" % MAX_IN_FLIGHT}})
            return
        reply = self.inflight[rid] = Reply(self, rid)
        if kind == "callback":
            try:
                method(self.daemon, req, reply)
            except Exception as exc:
                reply.fail(exc)
            return
        args = (self.daemon, req, reply) if kind == "stream" else (self.daemon, req)
        task = self.loop.create_task(_answer(reply, method(*args)))
        reply.on_cancel = task.cancel


class Reply:
    """The answer to one request in flight: events, then exactly one ok or error."""

    __slots__ = ("conn", "rid", "on_cancel", "done")

    def __init__(self, conn, rid):
        self.conn, self.rid = conn, rid
        self.on_cancel = None
        self.done = False

    def event(self, name, data):
        self.conn.send({"id": self.rid, "event": name, "data": data})

    def ok(self, result):
        self._finish({"id": self.rid, "ok": True, "result": result})

    def fail(self, exc):
        self._finish({"id": self.rid, "ok": False, "error": _error_body(exc)})

    def _finish(self, msg):
        if not self.done:
            self.done = True
            self.conn.inflight.pop(self.rid, None)
            self.conn.send(msg)

    def cancel(self):
        if not self.done and self.on_cancel is not None:
            self.on_cancel()

    def abandon(self):
        """No answer will be sent: the client went away."""
        self.done = True
        self.conn.inflight.pop(self.rid, None)


OPS = {}
for _name, _kind in (
        ("ping", "sync"), ("info", "sync"), ("exec", "callback"),
        ("session_open", "async"), ("session_run", "callback"), ("session_close", "async"),
        ("session_list", "sync"),
        ("spawn", "sync"), ("proc_status", "sync"), ("proc_output", "sync"),
        ("proc_wait", "async"), ("proc_signal", "sync"), ("proc_list", "sync"),
        ("file_read", "sync"), ("file_write", "sync"), ("file_stat", "sync"),
        ("file_list", "sync"), ("file_mkdir", "sync"), ("file_remove", "async"),
        ("file_move", "async"), ("tar_get", "stream"), ("tar_put_begin", "conn"),
        ("tar_put_data", "conn"), ("tar_put_end", "stream"), ("shutdown", "async")):
    OPS[_name] = (getattr(Daemon, "op_" + _name), _kind)


# --------------------------------------------------------------------------- main
def parse_args(argv):
    opts = {"listen": None, "token_file": None, "token_fd": None, "workdir": None,
            "ready_fd": None,
            "max_output": DEFAULT_OUTPUT_CAP, "hello_timeout": HELLO_TIMEOUT_S,
            "user": None, "limits": "", "socket_mode": "0600", "oom_counter": None}
    it = iter(argv)
    for arg in it:
        key, sep, value = arg.partition("=")
        name = key.lstrip("-").replace("-", "_")
        if not key.startswith("--") or name not in opts:
            raise SystemExit("sandmand: unknown argument %r\n%s" % (arg, __doc__))
        if not sep:
            value = next(it, None)
            if value is None:
                raise SystemExit("sandmand: %s needs a value" % key)
        opts[name] = value
    if opts["listen"] is None:
        raise SystemExit("sandmand: --listen is required\n%s" % __doc__)
    return opts


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if opts["token_file"]:  # read once, then removed: nothing started later finds it
        with open(opts["token_file"], "r") as fh:
            token = fh.read(4096).strip()
        try:
            os.unlink(opts["token_file"])
        except OSError:
            pass  # a read-only mount (a secret volume): the launcher keeps it from others
    elif opts["token_fd"] is not None:  # a pipe: the token is in no file and no environment
        with os.fdopen(int(opts["token_fd"]), "rb") as fh:
            token = fh.read(4096).decode("ascii", "replace").strip()
    else:
        token = os.environ.get("SANDMAN_TOKEN", "")
    for key in [k for k in os.environ if k.startswith("SANDMAN_")]:
        del os.environ[key]
    if not token:
        raise SystemExit("sandmand: no token (give --token-file or SANDMAN_TOKEN)")
    ready_fd = int(opts["ready_fd"]) if opts["ready_fd"] is not None else None
    listen_fd = int(opts["listen"][3:]) if opts["listen"].startswith("fd:") else None
    _close_inherited(keep=(ready_fd, listen_fd))
    workdir = opts["workdir"] or os.getcwd()
    os.chdir(workdir)
    daemon = Daemon(token, os.getcwd(), int(opts["max_output"]), float(opts["hello_timeout"]))
    daemon.applied_limits = dict(item.partition("=")[::2] for item in opts["limits"].split(",")
                                 if item)
    try:
        daemon.socket_mode = int(opts["socket_mode"], 8) & 0o777
    except ValueError:
        raise SystemExit("sandmand: --socket-mode must be octal, got %r" % opts["socket_mode"])
    if opts["user"]:
        uid, _, gid = opts["user"].partition(":")
        daemon.user = (int(uid), int(gid or uid))
    counters = [opts["oom_counter"]] if opts["oom_counter"] else OOM_COUNTERS
    daemon.oom_counter = next((c for c in counters if oom_kills(c) is not None), None)
    daemon.run(opts["listen"], ready_fd)


def _close_inherited(keep):
    """Close every descriptor the launcher left open (beyond stdio and those in
    ``keep``): the daemon holds nothing it did not open itself."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed meanwhile


if __name__ == "__main__":
    main()
