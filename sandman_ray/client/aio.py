"""``AsyncDaemonClient``: the daemon's operations over asyncio, many requests in
flight on one connection (asyncio callers, the providers' probes)."""

import asyncio
import collections
import itertools
import socket
from typing import Any, Dict, List, Optional

from sandman_ray.daemon.sandmand.wire import (
    MAX_FRAME, CodecError, FrameReader, encode_frame, unpack)
from sandman_ray.errors import CallTimeout, ConnectionLost, ProtocolError
from sandman_ray.client.operations import OnOutput, Plan, STREAM_BUFFER, _Operations
from sandman_ray.client.connection import (
    _parse_address, _SocketPath, _reply_value, _connection_error, _hello_fields)


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, client: "AsyncDaemonClient"):
        self.client = client
        self.reader = FrameReader(MAX_FRAME)

    def data_received(self, data: bytes) -> None:
        try:
            self.client._frames_in(self.reader.feed(data))
        except CodecError as exc:
            self.client._fail(ProtocolError(str(exc)))
        except ProtocolError as exc:
            self.client._fail(exc)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.client._fail(ConnectionLost("connection to %s closed%s"
                                         % (self.client.address, ": %s" % exc if exc else "")))


class AsyncDaemonClient(_Operations):
    """asyncio client: many requests in flight on one connection. Create with
    ``await AsyncDaemonClient.connect(address, token)``."""

    def __init__(self, address: str, default_timeout: Optional[float] = None):
        self.address = address
        self.default_timeout = default_timeout
        self._ids = itertools.count(1)
        self._pending: Dict[int, "asyncio.Future[Any]"] = {}
        self._events: Dict[int, OnOutput] = {}
        self._transport: Optional[asyncio.Transport] = None
        self._error: Optional[Exception] = None

    @classmethod
    async def connect(cls, address: str, token: str, *, connect_timeout: float = 10.0,
                      default_timeout: Optional[float] = None,
                      hello_first: bool = True) -> "AsyncDaemonClient":
        """``hello_first`` False: send the hello and return without its answer, which
        comes before the first call's (a wrong token then fails that call with
        AuthError; the daemon runs nothing a connection sends before its hello is
        accepted): a first call costs one round trip, not two."""
        client = cls(address, default_timeout)
        loop = asyncio.get_running_loop()
        family, where = _parse_address(address)
        try:
            if family == socket.AF_UNIX:
                with _SocketPath(where) as path:
                    client._transport, _ = await asyncio.wait_for(loop.create_unix_connection(
                        lambda: _ClientProtocol(client), path), connect_timeout)
            else:
                client._transport, _ = await asyncio.wait_for(loop.create_connection(
                    lambda: _ClientProtocol(client), *where), connect_timeout)
            if hello_first:
                await client._request("hello", _hello_fields(token), connect_timeout, None,
                                      hello=True)
            else:  # its answer finds no request waiting; a refusal fails them all
                hello = _hello_fields(token)
                hello["id"] = next(client._ids)
                client._transport.write(encode_frame(hello))
        except (OSError, asyncio.TimeoutError) as exc:
            client.close()
            raise ConnectionLost("cannot connect to daemon at %s: %s" % (address, exc)) from exc
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def over(cls, transport: asyncio.Transport, address: str,
             default_timeout: Optional[float] = None) -> "AsyncDaemonClient":
        """A client of a connection whose hello was said already (the service's
        gateway said it: ``sandman_ray.remote``); ``address`` then only names it."""
        client = cls(address, default_timeout)
        client._transport = transport
        transport.set_protocol(_ClientProtocol(client))
        return client

    @property
    def closed(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._fail(ConnectionLost("client closed"))

    def abort(self) -> None:
        """Cut the connection from any thread, also once its loop has closed: the
        socket is shut down, so the daemon ends the connection (and stops what its
        calls started) and a request sent afterwards fails. ``close`` it on its loop
        to let its calls there end at once."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        if sock is None:
            return
        try:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    async def __aenter__(self) -> "AsyncDaemonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def _call(self, op, fields, convert=None, timeout=None, on_event=None):
        result = await self._request(op, fields, timeout, on_event)
        return convert(result) if convert is not None else result

    async def _run(self, plan: Plan):
        try:
            req = next(plan)
            while True:
                req = plan.send(await self._request(req.op, req.fields, req.timeout, req.on_event))
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    def _stream(self, op, fields, convert, timeout, stop=None):
        return self._stream_events(op, fields, convert, timeout)

    async def _stream_events(self, op, fields, convert, timeout):
        """The async generator behind ``exec_stream``. While its reader lags by more
        than STREAM_BUFFER bytes, this connection's reading pauses (the daemon then
        pauses the command): give a stream a connection of its own when other calls
        must not wait for its reader. Closed early, it cancels the request."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        fields["op"], fields["id"] = op, rid
        queue: "collections.deque" = collections.deque()
        arrived = asyncio.Event()
        state = {"bytes": 0, "paused": False}
        fut = loop.create_future()

        def on_event(name, data):
            queue.append((name, data))
            state["bytes"] += len(data)
            arrived.set()
            if state["bytes"] > STREAM_BUFFER and not state["paused"] and self._transport:
                state["paused"] = True
                self._transport.pause_reading()

        def resume():
            if state["paused"] and state["bytes"] <= STREAM_BUFFER // 2:
                state["paused"] = False
                if self._transport is not None and not self._transport.is_closing():
                    self._transport.resume_reading()

        self._pending[rid] = fut
        self._events[rid] = on_event
        fut.add_done_callback(lambda _f: arrived.set())
        finished = False
        deadline = None if timeout is None else loop.time() + timeout
        try:
            self._transport.write(encode_frame(fields))
            while True:
                while queue:
                    name, data = queue.popleft()
                    state["bytes"] -= len(data)
                    resume()
                    yield (name, data)
                if fut.done():
                    finished = True
                    result = _reply_value(fut.result(), op)
                    yield convert(result) if convert is not None else result
                    return
                arrived.clear()
                if queue or fut.done():
                    continue
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise CallTimeout("no reply to %s from %s in time" % (op, self.address))
                try:
                    await asyncio.wait_for(arrived.wait(), left)
                except asyncio.TimeoutError:
                    continue
        finally:
            self._pending.pop(rid, None)
            self._events.pop(rid, None)
            state["bytes"] = 0
            resume()
            if not finished and self._error is None and self._transport is not None:
                self._transport.write(encode_frame({"op": "cancel", "id": next(self._ids),
                                                    "target": rid}))

    async def _request(self, op, fields, timeout, on_event, hello=False):
        if self._error is not None:
            raise self._error
        rid = next(self._ids)
        if not hello:
            fields["op"] = op
        fields["id"] = rid
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if on_event is not None:
            self._events[rid] = on_event
        try:
            self._transport.write(encode_frame(fields))
            reply = await asyncio.wait_for(fut, timeout) if timeout else await fut
        except asyncio.TimeoutError:
            raise CallTimeout("no reply to %s from %s in time" % (op, self.address)) from None
        finally:
            self._pending.pop(rid, None)
            self._events.pop(rid, None)
        return _reply_value(reply, op)

    def _frames_in(self, frames: List[bytes]) -> None:
        for body in frames:
            try:
                reply = unpack(body)
            except CodecError as exc:
                raise ProtocolError("undecodable reply: %s" % exc) from exc
            if not isinstance(reply, dict):
                raise ProtocolError("reply is not a map: %r" % (reply,))
            rid = reply.get("id")
            if rid is None:
                raise _connection_error(reply)
            if "event" in reply:
                callback = self._events.get(rid)
                if callback is not None:
                    callback(reply["event"], reply["data"])
                continue
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._error)
        self._pending.clear()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
