"""A client connection: frames in, replies and events out, many requests in flight;
the hello, and the dispatch of every later request to the op that answers it."""

import os
import struct
import sys

try:
    from _operator import _compare_digest as _tokens_equal
except ImportError:  # pragma: no cover - every CPython has it
    from hmac import compare_digest as _tokens_equal

from .fields import RequestError, check_fields, error_body
from .loop import CancelledError, Event
from .wire import (
    ADMIN_OPS, HELLO_MAX_FRAME, MAX_FRAME, MAX_IN_FLIGHT, PROTOCOL_VERSION, CodecError, FrameReader,
    encode_frame, pack, unpack)

WRITE_HIGH_WATER = 4 * 1024 * 1024  # queued reply bytes past which we stop reading
FLUSH_BUFFERS = 64  # queued buffers handed to one sendmsg
INLINE_EVENT_BYTES = 64 * 1024  # events with less data are encoded whole
_BIN32 = struct.Struct(">I")  # a frame's length, and a bin32's


def refuse(sock, kind, message):
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
        self.out = []  # buffers queued to send, oldest first (bytes or memoryviews)
        self.queued = 0  # the bytes they hold
        self.authed = False
        self.admin = False  # said hello with the launcher's admin token
        self.uploads = {}  # upload id -> (target path, spool file)
        self.closing = False
        self.closed = False
        self.inflight = {}  # request id -> Reply
        self.writable = Event(self.loop)
        self.writable.set()
        self.held = []  # frames received, not yet served: the client does not read
        sock.setblocking(False)
        self.loop.add_reader(self.fd, self._readable)
        self.hello_timer = self.loop.call_later(daemon.hello_timeout_s, self._no_hello)
        daemon.connections.add(self)
        daemon.unauthenticated += 1

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

    def write(self, *parts):
        """Send the buffers of one frame, queueing what the socket does not take now
        (no copy: a queued buffer is referenced, and must not change)."""
        if self.closed:
            return
        if not self.out:
            try:
                sent = self.sock.send(parts[0]) if len(parts) == 1 else self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            if sent == sum(len(part) for part in parts):
                return
            self.loop.add_writer(self.fd, self._flush)
        else:
            sent = 0
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            self.out.append(memoryview(part)[sent:] if sent else part)
            self.queued += len(part) - sent
            sent = 0
        if self.queued > WRITE_HIGH_WATER and self.writable.is_set():
            self.writable.clear()
            self.loop.remove_reader(self.fd)

    def _flush(self):
        try:
            sent = self.sock.sendmsg(self.out[:FLUSH_BUFFERS])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self.queued -= sent
        done = 0
        for part in self.out:
            if sent < len(part):
                if sent:
                    self.out[done] = memoryview(part)[sent:]
                break
            sent -= len(part)
            done += 1
        del self.out[:done]
        if not self.out:
            self.loop.remove_writer(self.fd)
            if self.closing:
                self.close()
                return
        if self.queued <= WRITE_HIGH_WATER // 2 and not self.writable.is_set():
            self.writable.set()
            if not self.closing:
                self.loop.add_reader(self.fd, self._readable)
                if self.held:
                    self._serve([])

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
            reply.disconnected()
        self.writable.set()

    def upload(self, req):
        upload = self.uploads.get(req["upload"])
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

    def send_encoded(self, rid, body):
        """A final reply whose map, without its id, is encoded in ``body`` (a fixmap of
        fewer than 15 entries): the id goes in front, ``body``'s entries are sent as they
        are."""
        if self.closing:
            return
        count = body[0] & 0x0F
        if body[0] & 0xF0 != 0x80 or count >= 15:
            self.send(dict(unpack(body), id=rid))
            return
        head = bytes([0x80 | (count + 1)]) + pack("id") + pack(rid)
        rest = memoryview(body)[1:]
        self.write(_BIN32.pack(len(head) + len(rest)) + head, rest)

    def send_event(self, rid, name, data):
        """``{"id": rid, "event": name, "data": data}``; large data is sent as it is,
        after the frame's header and the map's other fields (not copied into a frame)."""
        if len(data) < INLINE_EVENT_BYTES:
            self.send({"id": rid, "event": name, "data": data})
            return
        if self.closing:
            return
        head = pack({"id": rid, "event": name, "data": b""})[:-2]  # without bin8 of 0
        head += b"\xc6" + _BIN32.pack(len(data))
        self.write(_BIN32.pack(len(head) + len(data)) + head, data)

    def data_received(self, data):
        try:
            # before the hello, one frame at a time: what follows it may be larger
            frames = self.reader.feed(data, one=not self.authed)
        except CodecError as exc:
            self._fail("ProtocolError", str(exc))
            return
        self._serve(frames)

    def _serve(self, frames):
        """Serve the frames held back and then ``frames``, until the replies queued pass
        the high-water mark: the rest wait until the client reads (a batch of requests
        cannot queue a reply each beyond it)."""
        if self.held:
            frames, self.held = self.held + frames, []
        for index, body in enumerate(frames):
            if self.closing:
                return
            if self.authed and not self.writable.is_set():
                self.held = [bytes(f) for f in frames[index:]]  # views of the recv buffer
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
        admin = self.daemon.admin_token
        given = token.encode() if isinstance(token, str) else None
        # both compared, in constant time; no lease token is valid while a renew runs
        lease_ok = given is not None and self.daemon.token is not None and \
            _tokens_equal(given, self.daemon.token.encode())
        admin_ok = given is not None and admin is not None and \
            _tokens_equal(given, admin.encode())
        if not (lease_ok or admin_ok):
            self._fail("AuthError", "wrong token")
            return
        self.admin = admin_ok
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
        handler = self.daemon.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            self.send({"id": rid, "ok": False, "error": {
                "type": "UnknownOp", "message": "unknown op %r" % (op,)}})
            return
        method, kind, schema = handler
        if op in ADMIN_OPS and not self.admin:
            self.send({"id": rid, "ok": False, "error": {
                "type": "AuthError", "message": "%s is the launcher's op" % op}})
            return
        try:
            check_fields(req, schema)
        except RequestError as exc:
            self.send({"id": rid, "ok": False, "error": error_body(exc)})
            return
        record = None
        if req.get("command_id") is not None:  # exactly once (commands.py)
            if not self._admit(rid):
                return
            reply = Reply(self, rid)
            try:
                record = self.daemon.commands.claim(req, reply)
            except Exception as exc:
                self.send({"id": rid, "ok": False, "error": error_body(exc)})
                return
            if record is None:  # ran before, or runs now: the reply gets its answer
                if not reply.done:
                    self.inflight[rid] = reply
                return
        if kind in ("sync", "conn"):
            try:
                result = method(self.daemon, req) if kind == "sync" else \
                    method(self.daemon, req, self)
            except Exception as exc:
                msg = {"id": rid, "ok": False, "error": error_body(exc)}
            else:
                msg = {"id": rid, "ok": True, "result": result}
            if record is not None:
                record.finish(msg)
            self.send(msg)
            return
        if record is None and not self._admit(rid):
            return
        reply = self.inflight[rid] = Reply(self, rid, record)
        if kind == "callback":
            try:
                method(self.daemon, req, reply)
            except Exception as exc:
                reply.fail(exc)
            return
        args = (self.daemon, req, reply) if kind == "stream" else (self.daemon, req)
        task = self.loop.create_task(_answer(reply, method(*args)))
        reply.on_cancel = task.cancel

    def _admit(self, rid):
        """Whether a request may be in flight now; if not, it is answered why."""
        if rid in self.inflight:
            self.send({"id": rid, "ok": False, "error": {
                "type": "BadRequest", "message": "request id %d is already in flight" % rid}})
            return False
        if len(self.inflight) >= MAX_IN_FLIGHT:
            self.send({"id": rid, "ok": False, "error": {
                "type": "LimitExceeded", "message": "%d requests in flight" % MAX_IN_FLIGHT}})
            return False
        return True

    def cancel(self, rid):
        """Give up request ``rid`` in flight on this connection (the ``cancel`` op): a
        command is killed, a retry stops waiting; whether it was in flight."""
        reply = self.inflight.get(rid)
        if reply is None or reply.on_cancel is None:
            return False  # answered, or not to be given up (a session run under way)
        reply.cancel()
        return True


class Reply:
    """The answer to one request in flight: events, then exactly one ok or error;
    ``record``: the command id it answers for (commands.py), which keeps the answer."""

    __slots__ = ("conn", "rid", "on_cancel", "done", "record")

    def __init__(self, conn, rid, record=None):
        self.conn, self.rid, self.record = conn, rid, record
        self.on_cancel = None
        self.done = False

    def event(self, name, data):
        if not self.done:
            self.conn.send_event(self.rid, name, data)

    def ok(self, result):
        self._finish({"id": self.rid, "ok": True, "result": result})

    def fail(self, exc):
        self._finish({"id": self.rid, "ok": False, "error": error_body(exc)})

    def send_kept(self, answer):
        """Answer with ``answer``: a final message without its id, encoded (a command's
        kept answer, commands.py), sent after this reply's id without a copy."""
        if self.done:
            return
        self.done = True
        self.conn.inflight.pop(self.rid, None)
        self.conn.send_encoded(self.rid, answer)

    def _finish(self, msg):
        record, self.record = self.record, None
        if record is not None:
            record.finish(msg)
        if not self.done:
            self.done = True
            self.conn.inflight.pop(self.rid, None)
            self.conn.send(msg)

    def cancel(self):
        if not self.done and self.on_cancel is not None:
            self.on_cancel()

    def disconnected(self):
        """The client went away. A command with an id goes on (a retry finds its
        answer); any other request is given up."""
        if self.record is not None:
            self.done = True
            self.conn.inflight.pop(self.rid, None)
        else:
            self.cancel()

    def abandon(self):
        """No answer will be sent: the client went away, or gave the request up."""
        record, self.record = self.record, None
        if record is not None:  # a retry is told, not left waiting
            record.finish({"ok": False, "error": {"type": "Cancelled",
                                                  "message": "the request was cancelled"}})
        self.done = True
        self.conn.inflight.pop(self.rid, None)


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
