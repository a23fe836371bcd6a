"""``DaemonClient``: the daemon's operations over a blocking socket (scripts, tests,
the handle hosts' threads)."""

import itertools
import socket
import threading
import time
from typing import List, Optional

from sandman_ray.daemon.sandmand.wire import (
    MAX_FRAME, CodecError, FrameReader, encode_frame, unpack)
from sandman_ray.errors import CallTimeout, ConnectionLost, ProtocolError, SandmanError
from sandman_ray.client.operations import (
    Plan, CANCEL_WAIT_S, STOP_POLL_S, ExecStream, _Operations)
from sandman_ray.client.connection import (
    _parse_address, _SocketPath, _reply_value, REFUSAL_WAIT_S, _connection_error,
    _hello_fields)


class DaemonClient(_Operations):
    """Blocking client over one connection; calls from several threads are serialised.

    ``default_timeout`` bounds the wait for each reply (commands with their own timeout
    get that plus ``REPLY_SLACK_S``); None waits as long as it takes.
    """

    def __init__(self, address: str, token: Optional[str], *, connect_timeout: float = 10.0,
                 default_timeout: Optional[float] = None, hello_first: bool = True,
                 sock: Optional[socket.socket] = None):
        """``hello_first`` False: send the hello and return without its answer, which
        comes with the first call's (a wrong token then fails that call with
        AuthError; the daemon runs nothing a connection sends before its hello is
        accepted): a first call costs one round trip, not two. ``sock``: a connection
        whose hello was said already (the service's gateway said it, with a token the
        client never sees: ``sandman_ray.remote``); ``address`` then only names it."""
        self.address = address
        self.default_timeout = default_timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._reader = FrameReader(MAX_FRAME)
        self._frames: List[bytes] = []
        self._timeout: Optional[float] = connect_timeout
        if sock is not None:
            self._sock = sock
            return
        family, where = _parse_address(address)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout)
            if family == socket.AF_UNIX:
                with _SocketPath(where) as path:
                    self._sock.connect(path)
            else:
                self._sock.connect(where)
            if family == socket.AF_INET:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hello_first:
                self._request("hello", _hello_fields(token), connect_timeout, None, hello=True)
            else:  # its answer is skipped by the first call, or ends it (id null)
                hello = _hello_fields(token)
                hello["id"] = next(self._ids)
                self._sock.sendall(encode_frame(hello))
        except OSError as exc:
            self._sock.close()
            raise ConnectionLost("cannot connect to daemon at %s: %s" % (address, exc)) from exc
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    broken = False  # a stream given up could not be read to its end: do not reuse

    def abort(self) -> None:
        """Cut the connection from another thread: a call waiting on it raises
        ConnectionLost at once, and the daemon stops what the call started."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, op, fields, convert=None, timeout=None, on_event=None):
        result = self._request(op, fields, timeout, on_event)
        return convert(result) if convert is not None else result

    def _run(self, plan: Plan):
        try:
            req = next(plan)
            while True:
                req = plan.send(self._request(req.op, req.fields, req.timeout, req.on_event))
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    def _stream(self, op, fields, convert, timeout, stop=None):
        return ExecStream(self._stream_frames(op, fields, convert, timeout, stop))

    def _stream_frames(self, op, fields, convert, timeout, stop):
        """The generator behind ``exec_stream``: the connection is this stream's until
        it ends. Closed early, it cancels the request and reads to its end, so the
        connection can serve the next call."""
        with self._lock:
            rid = next(self._ids)
            fields["op"], fields["id"] = op, rid
            deadline = None if timeout is None else time.monotonic() + timeout
            finished = False
            try:
                self._set_timeout(None)
                self._sock.sendall(encode_frame(fields))
                while True:
                    reply = self._next_stream_frame(deadline, op, rid, stop)
                    if reply is None:  # ``stop`` said so
                        return
                    got = reply.get("id")
                    if got == rid:
                        if "event" in reply:
                            yield (reply["event"], reply["data"])
                            continue
                        finished = True
                        result = _reply_value(reply, op)
                        yield convert(result) if convert is not None else result
                        return
                    if got is None:
                        raise _connection_error(reply)
            except CallTimeout:
                raise
            except OSError as exc:
                raise ConnectionLost("connection to %s lost during %s: %s"
                                     % (self.address, op, exc)) from exc
            finally:
                if not finished:
                    self._cancel_stream(rid)

    def _next_stream_frame(self, deadline, op, rid, stop):
        """The next frame, asking ``stop`` every STOP_POLL_S while none comes; None once
        it says to stop."""
        if stop is None:
            return self._next_frame(deadline, op, rid)
        while True:
            poll = time.monotonic() + STOP_POLL_S
            try:
                return self._next_frame(poll if deadline is None else min(poll, deadline), op, rid)
            except CallTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if stop():
                return None

    def _cancel_stream(self, rid: int) -> None:
        """Cancel stream ``rid`` (the daemon kills its command) and skip what it still
        sends, up to its final reply; a connection that cannot be brought back to a
        clean state is cut."""
        try:
            self._set_timeout(None)
            self._sock.sendall(encode_frame({"op": "cancel", "id": next(self._ids),
                                             "target": rid}))
            deadline = time.monotonic() + CANCEL_WAIT_S
            while True:
                reply = self._next_frame(deadline, "cancel", rid)
                if reply.get("id") == rid and "event" not in reply:
                    return
                if reply.get("id") is None:
                    raise ConnectionLost("the daemon closed the connection")
        except Exception:  # noqa: BLE001 - a connection in an unknown state: cut it
            self.abort()
            self.broken = True

    def _request(self, op, fields, timeout, on_event, hello=False):
        with self._lock:
            rid = next(self._ids)
            if not hello:
                fields["op"] = op
            fields["id"] = rid
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                self._set_timeout(None)  # a call that timed out left its short timeout
                self._sock.sendall(encode_frame(fields))
                while True:
                    reply = self._next_frame(deadline, op, rid)
                    got = reply.get("id")
                    if got == rid:
                        if "event" in reply:
                            if on_event is not None:
                                on_event(reply["event"], reply["data"])
                            continue
                        return _reply_value(reply, op)
                    if got is None:
                        raise _connection_error(reply)
                    # else: the late reply of a call that timed out; skip it
            except CallTimeout:  # a TimeoutError, so an OSError: not a lost connection
                raise
            except OSError as exc:
                refusal = self._refusal()
                if refusal is not None:
                    raise refusal from exc
                raise ConnectionLost("connection to %s lost during %s: %s"
                                     % (self.address, op, exc)) from exc

    def _refusal(self) -> Optional[Exception]:
        """After a send failed: why the daemon closed, when its word is already here (a
        hello sent with the first call, refused: the daemon answers and closes before
        that call's frame is written, which then fails with EPIPE)."""
        try:
            reply = self._next_frame(time.monotonic() + REFUSAL_WAIT_S, "hello", None)
        except (SandmanError, OSError):
            return None
        return _connection_error(reply) if reply.get("id") is None else None

    def _set_timeout(self, timeout: Optional[float]) -> None:
        # settimeout costs two fcntl calls; the common case (no deadline) needs none
        if timeout is not None or self._timeout is not None:
            self._sock.settimeout(timeout)
            self._timeout = timeout

    def _next_frame(self, deadline, op, rid):
        while not self._frames:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CallTimeout("no reply to %s from %s in time" % (op, self.address))
                self._set_timeout(left)
            else:
                self._set_timeout(None)
            try:
                buf, view = _receive_buffer()
                n = self._sock.recv_into(buf)
            except socket.timeout:
                continue
            if not n:
                raise ConnectionLost("daemon at %s closed the connection during %s"
                                     % (self.address, op))
            try:
                # a frame may be a view of the receive buffer (a whole one in one recv):
                # decoded below, before this thread receives again
                self._frames.extend(self._reader.feed(view[:n]))
            except CodecError as exc:
                raise ProtocolError(str(exc)) from exc
        try:
            reply = unpack(self._frames.pop(0))
        except CodecError as exc:
            raise ProtocolError("undecodable reply: %s" % exc) from exc
        if not isinstance(reply, dict):
            raise ProtocolError("reply is not a map: %r" % (reply,))
        return reply


_buffers = threading.local()


def _receive_buffer() -> tuple:
    """This thread's receive buffer and a view of it: a fresh bytes object per recv
    costs an allocation (and page faults) on every reply, and one buffer per
    connection costs its size for every connection a handle host keeps open (one per
    lease it holds). 64 KiB: larger replies arrive over several recvs."""
    try:
        return _buffers.buf, _buffers.view
    except AttributeError:
        _buffers.buf = bytearray(1 << 16)
        _buffers.view = memoryview(_buffers.buf)
        return _buffers.buf, _buffers.view
