"""Client of the sandbox daemon (``daemon/sandmand/``; its protocol is
``daemon/docs/protocol.md``).

Every operation is written once, as a *plan*: a generator that yields the requests it
needs and receives their results. ``DaemonClient`` drives plans over a blocking socket
(for scripts, tests and the handle hosts' threads); ``AsyncDaemonClient`` drives the
same plans over asyncio with many requests in flight on one connection (for asyncio
callers and the providers' probes). Both use the daemon's own frame definitions,
codec and op table (``sandmand.wire``): each method is named as the op it sends.
"""

import asyncio
import collections
import errno
import io
import itertools
import os
import socket
import stat
import tarfile
import threading
import time
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Union

from sandman_ray.daemon.sandmand.wire import (
    MAX_FRAME, PROTOCOL_VERSION, CodecError, FrameReader, encode_frame, unpack)
from sandman_ray.errors import (
    AuthError, CallTimeout, ConnectionLost, DaemonError, ProtocolError, ResultTooLarge,
    SandmanError)
from sandman_ray.results import (  # noqa: F401 - ExecResult ... are the client's too
    ExecResult, FileStat, Listing, ProcessOutput, ProcessStatus)

Command = Union[str, Sequence[str]]
OnOutput = Callable[[str, bytes], None]
# Slack added to a command's own timeout for the client-side wait on its reply.
REPLY_SLACK_S = 30.0
READ_CHUNK = 32 * 1024 * 1024  # the daemon answers at most this much per read_file
UPLOAD_CHUNK = 8 * 1024 * 1024
MAX_RESULT_BYTES = 1 << 30  # read_file and get_archive keep at most this (max_bytes)
STREAM_BUFFER = 8 * 1024 * 1024  # streamed output an asyncio reader may lag by
CANCEL_WAIT_S = 10.0  # a stream given up: how long its end may take to arrive
STOP_POLL_S = 0.2  # how often a blocking stream asks its ``stop`` while no output comes


class ExecStream:
    """What ``exec_stream`` returns on a blocking connection: iterate it for
    ``(stream, bytes)`` chunks and, last, the ExecResult (a NamedTuple too: tell it by
    ``isinstance(item, ExecResult)``), which ``result`` keeps.
    ``close()`` (or dropping it) before the end kills the command."""

    def __init__(self, frames):
        self._frames = frames
        self.result: Optional[ExecResult] = None

    def __iter__(self) -> "ExecStream":
        return self

    def __next__(self):
        item = next(self._frames)
        if isinstance(item, ExecResult):
            self.result = item
        return item

    def close(self) -> None:
        self._frames.close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Request:
    """One request of a multi-step plan: the op, its fields, the client-side timeout
    for its reply and, for streaming ops, a callback for its events."""

    __slots__ = ("op", "fields", "timeout", "on_event")

    def __init__(self, op: str, fields: Dict[str, Any], timeout: Optional[float] = None,
                 on_event: Optional[OnOutput] = None):
        self.op, self.fields, self.timeout, self.on_event = op, fields, timeout, on_event


Plan = Generator[Request, Any, Any]


def _present(fields: Dict[str, Any]) -> Dict[str, Any]:
    """The fields that were given (None means "the daemon's default")."""
    return {k: v for k, v in fields.items() if v is not None}


def _reply_timeout(command_timeout: Optional[float], default: Optional[float]) -> Optional[float]:
    if command_timeout is None:
        return None
    return command_timeout + REPLY_SLACK_S if default is None else max(default, command_timeout + REPLY_SLACK_S)


# --------------------------------------------------------------------------- operations
class _Operations:
    """Every daemon operation, once, each a method named as its op in the wire's table
    (``sandmand.wire.OPS``, whose fields are its parameters). ``_run(plan)`` is the
    transport: a value for the blocking client, an awaitable for the asyncio client."""

    default_timeout: Optional[float] = None

    def _call(self, op: str, fields: Dict[str, Any], convert=None, timeout=None,
              on_event=None):  # pragma: no cover - implemented by the transports
        """One request; ``convert`` turns its result into the value returned."""
        raise NotImplementedError

    def _run(self, plan: Plan):  # pragma: no cover - implemented by the transports
        """Several requests, each depending on the last: a generator of Requests."""
        raise NotImplementedError

    def ping(self):
        return self._call("ping", {}, timeout=self.default_timeout)

    def info(self):
        """pid, uptime, python, os_release, limits ... of the daemon (a dict)."""
        return self._call("info", {}, timeout=self.default_timeout)

    def exec(self, cmd: Command, *, timeout: Optional[float] = None, cwd: Optional[str] = None,
             env: Optional[Dict[str, Optional[str]]] = None, stdin: Optional[bytes] = None,
             max_output: Optional[int] = None, kill_grace_s: Optional[float] = None,
             command_id: Optional[str] = None, on_output: Optional[OnOutput] = None):
        """Run a command once (a shell string, or an argv list run without a shell).
        With ``on_output`` the output is streamed to it as ``(stream, bytes)`` and the
        result's stdout/stderr are empty. ``command_id``: run it once per lease; a
        retry with the same id gets the first run's result (waiting while it runs)."""
        fields = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
        if timeout is not None or cwd or env or stdin or max_output is not None \
                or kill_grace_s is not None or on_output or command_id is not None:
            fields.update(_present({"timeout": timeout, "cwd": cwd, "env": env, "stdin": stdin,
                                    "max_output": max_output, "kill_grace_s": kill_grace_s,
                                    "command_id": command_id,
                                    "stream": True if on_output else None}))
        return self._call("exec", fields, ExecResult.from_wire,
                          _reply_timeout(timeout, self.default_timeout), on_output)

    def exec_stream(self, cmd: Command, *, timeout: Optional[float] = None,
                    cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
                    stdin: Optional[bytes] = None, max_output: Optional[int] = None,
                    kill_grace_s: Optional[float] = None, command_id: Optional[str] = None,
                    stop: Optional[Callable[[], bool]] = None):
        """Run a command, its output streamed: an iterator of ``(stream, bytes)``
        chunks as they arrive ("stdout" or "stderr"), then the ExecResult (its stdout
        and stderr empty), also kept as the iterator's ``result``. The daemon sends
        what the reader takes (a reader that lags slows the command's writes, and
        nothing piles up); a reader that stops, closes the iterator or is cancelled
        kills the command. No cap unless ``max_output`` is given. ``stop``: asked
        every STOP_POLL_S while no output comes (blocking client); True gives the
        stream up, as closing it does."""
        fields = _present({"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
                           "cwd": cwd, "env": env, "stdin": stdin, "max_output": max_output,
                           "kill_grace_s": kill_grace_s, "command_id": command_id,
                           "stream": True})
        return self._stream("exec", fields, ExecResult.from_wire,
                            _reply_timeout(timeout, self.default_timeout), stop)

    def _stream(self, op: str, fields: Dict[str, Any], convert, timeout: Optional[float],
                stop=None):
        raise NotImplementedError  # pragma: no cover - implemented by the transports

    def cancel(self, target: int):
        """Give up request ``target`` in flight on this connection (its command is
        killed); whether it was in flight."""
        return self._call("cancel", {"target": target}, lambda r: r["cancelled"],
                          self.default_timeout)

    # sessions
    def session_open(self, session: str = "default", *, shell: Optional[str] = None,
                     cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None):
        return self._call("session_open", _present({"session": session, "shell": shell,
                                                  "cwd": cwd, "env": env}),
                                 timeout=self.default_timeout)

    def run(self, cmd: str, *, session: str = "default", timeout: Optional[float] = None,
            max_output: Optional[int] = None, kill_grace_s: Optional[float] = None,
            command_id: Optional[str] = None):
        """Run ``cmd`` in a persistent shell session (opened on first use for
        ``default``): cwd, variables and functions carry over to the next run.
        ``command_id``: as for ``exec``, once per lease."""
        fields = _present({"session": session, "cmd": cmd, "timeout": timeout,
                           "max_output": max_output, "kill_grace_s": kill_grace_s,
                           "command_id": command_id})
        return self._call("run", fields, ExecResult.from_wire,
                                 _reply_timeout(timeout, self.default_timeout))

    def session_close(self, session: str = "default", *, kill_grace_s: Optional[float] = None):
        """Stop the session's shell and everything it started (TERM, then KILL after
        ``kill_grace_s``)."""
        return self._call("session_close", _present({"session": session,
                                                     "kill_grace_s": kill_grace_s}),
                          timeout=self.default_timeout)

    def session_list(self):
        return self._call("session_list", {}, timeout=self.default_timeout)

    # background processes
    def spawn(self, cmd: Command, *, cwd: Optional[str] = None,
              env: Optional[Dict[str, Optional[str]]] = None, stdin: Optional[bytes] = None,
              buffer_bytes: Optional[int] = None, command_id: Optional[str] = None):
        """Start a background process; returns its pid. ``command_id``: started once
        per lease; a retry with the same id gets the same pid."""
        fields = _present({"cmd": cmd if isinstance(cmd, str) else list(cmd), "cwd": cwd,
                           "env": env, "stdin": stdin, "buffer_bytes": buffer_bytes,
                           "command_id": command_id})
        return self._call("spawn", fields, lambda r: r["pid"], self.default_timeout)

    def proc_status(self, pid: int):
        return self._call("proc_status", _present({"pid": pid}), ProcessStatus.from_wire,
                                 self.default_timeout)

    def proc_list(self):
        return self._call("proc_list", {}, lambda rs: [ProcessStatus.from_wire(r) for r in rs],
                                 self.default_timeout)

    def proc_output(self, pid: int, stream: str = "stdout", cursor: int = 0,
                    max_bytes: Optional[int] = None):
        fields = _present({"pid": pid, "stream": stream, "cursor": cursor, "max_bytes": max_bytes})
        return self._call("proc_output", fields, ProcessOutput.from_wire,
                                 self.default_timeout)

    def proc_wait(self, pid: int, timeout: Optional[float] = None):
        return self._call("proc_wait", _present({"pid": pid, "timeout": timeout}),
                                 ProcessStatus.from_wire,
                                 _reply_timeout(timeout, self.default_timeout))

    def proc_signal(self, pid: int, signal: Union[int, str] = "TERM", group: bool = True):
        return self._call("proc_signal", _present({"pid": pid, "signal": signal, "group": group}),
                                 ProcessStatus.from_wire, self.default_timeout)

    # terminals
    def pty_open(self, cmd: Optional[Command] = None, *, cols: int = 80, rows: int = 24,
                 cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
                 stdin: Optional[bytes] = None, buffer_bytes: Optional[int] = None):
        """Start ``cmd`` (default: the sandbox's shell) on a new terminal of ``cols``
        by ``rows``; returns ``{"pty": id, "pid": pid}``. Its output is kept in a ring
        of ``buffer_bytes`` (1 MiB) for ``pty_read``."""
        fields = _present({"cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd),
                           "cols": cols, "rows": rows, "cwd": cwd, "env": env, "stdin": stdin,
                           "buffer_bytes": buffer_bytes})
        return self._call("pty_open", fields, timeout=self.default_timeout)

    def pty_write(self, pty: int, data: Union[bytes, str]):
        """Type ``data`` into the terminal (keys: ``"\\x03"`` is Ctrl-C)."""
        return self._call("pty_write", {"pty": pty, "data": data}, timeout=self.default_timeout)

    def pty_read(self, pty: int, cursor: int = 0, *, max_bytes: Optional[int] = None,
                 timeout: Optional[float] = None):
        """The terminal's output from byte ``cursor``, waiting up to ``timeout`` s for
        some when there is none yet: ``{"data", "cursor" (where to go on), "dropped",
        "eof", "running", "exit_code", ...}``."""
        fields = _present({"pty": pty, "cursor": cursor, "max_bytes": max_bytes,
                           "timeout": timeout})
        return self._call("pty_read", fields, timeout=_reply_timeout(timeout, self.default_timeout))

    def pty_resize(self, pty: int, cols: int, rows: int):
        return self._call("pty_resize", {"pty": pty, "cols": cols, "rows": rows},
                          timeout=self.default_timeout)

    def pty_close(self, pty: int, *, kill_grace_s: Optional[float] = None):
        """End the terminal, its command and everything it started."""
        return self._call("pty_close", _present({"pty": pty, "kill_grace_s": kill_grace_s}),
                          timeout=self.default_timeout)

    def pty_list(self):
        return self._call("pty_list", {}, timeout=self.default_timeout)

    # files
    def read_file(self, path: str, offset: int = 0, length: Optional[int] = None, *,
                  max_bytes: int = MAX_RESULT_BYTES):
        """Read a file (all of it from ``offset`` unless ``length`` is given). A file
        larger than ``max_bytes`` raises ResultTooLarge: what a sandbox writes must not
        be able to fill the memory of the process that reads it (a sparse file of a
        terabyte costs the sandbox nothing)."""
        return self._run(self._read_plan(path, offset, length, max_bytes))

    def _read_plan(self, path: str, offset: int, length: Optional[int],
                   max_bytes: int = MAX_RESULT_BYTES) -> Plan:
        chunks: List[bytes] = []
        want, got, start = length, 0, offset
        while True:
            ask = READ_CHUNK if want is None else min(want, READ_CHUNK)
            r = yield Request("read_file", {"path": path, "offset": offset, "length": ask},
                              self.default_timeout)
            chunks.append(r["data"])
            got += len(r["data"])
            # a file already larger than max_bytes is refused at its first chunk, not
            # read to the limit (a sparse terabyte would cost a gigabyte of reading)
            wanted = r["size"] - start if want is None else min(want, r["size"] - start)
            if got > max_bytes or wanted > max_bytes:
                raise ResultTooLarge("%s holds more than max_bytes=%d bytes; read it in parts "
                                     "(offset, length) or raise the limit" % (path, max_bytes))
            offset += len(r["data"])
            if want is not None:
                want -= len(r["data"])
            if r["eof"] or not r["data"] or (want is not None and want <= 0):
                return b"".join(chunks)

    def write_file(self, path: str, data: Union[bytes, str], *, mode: int = 0o644,
                   parents: bool = True, append: bool = False):
        fields = {"path": path, "data": data, "mode": mode, "parents": parents, "append": append}
        return self._call("write_file", fields, lambda r: r["size"], self.default_timeout)

    def stat(self, path: str, follow_symlinks: bool = False):
        return self._call("stat", _present({"path": path, "follow_symlinks": follow_symlinks}),
                                 FileStat.from_wire, self.default_timeout)

    def list_dir(self, path: str, *, limit: Optional[int] = None) -> "Listing":
        """The entries of directory ``path``, sorted by name: a list of FileStat whose
        ``truncated`` says the daemon stopped at ``limit`` entries or at what fits a
        reply."""
        return self._call("list_dir", _present({"path": path, "limit": limit}),
                                 Listing.from_wire, self.default_timeout)

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755):
        return self._call("mkdir", _present({"path": path, "parents": parents, "mode": mode}),
                                 timeout=self.default_timeout)

    def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False):
        return self._call("remove", _present({"path": path, "recursive": recursive,
                                                 "missing_ok": missing_ok}),
                                 timeout=self.default_timeout)

    def move(self, src: str, dst: str, *, overwrite: bool = True):
        return self._call("move", _present({"src": src, "dst": dst, "overwrite": overwrite}),
                                 timeout=self.default_timeout)

    def get_archive(self, path: str, *, max_bytes: int = MAX_RESULT_BYTES):
        """A file or directory of the sandbox as an uncompressed tar (bytes); one larger
        than ``max_bytes`` raises ResultTooLarge (the rest of the stream is read and
        dropped, never kept)."""
        return self._run(self._get_archive_plan(path, max_bytes))

    def _get_archive_plan(self, path: str, max_bytes: int = MAX_RESULT_BYTES) -> Plan:
        chunks: List[bytes] = []
        size = [0]

        def keep(_event, data):
            size[0] += len(data)
            if size[0] <= max_bytes:
                chunks.append(data)
            else:
                chunks.clear()
        yield Request("get_archive", {"path": path}, self.default_timeout, keep)
        if size[0] > max_bytes:
            raise ResultTooLarge("the archive of %s is %d bytes, more than max_bytes=%d"
                                 % (path, size[0], max_bytes))
        return b"".join(chunks)

    def put_archive(self, path: str, tar: bytes):
        """Extract an uncompressed tar under ``path`` (created if missing); members
        that would land outside it are refused. Returns the number of members."""
        return self._run(self._put_archive_plan(path, tar))

    def _put_archive_plan(self, path: str, tar: bytes) -> Plan:
        begun = yield Request("put_archive_begin", {"path": path}, self.default_timeout)
        upload = begun["upload"]
        view = memoryview(tar)
        for start in range(0, len(view), UPLOAD_CHUNK):
            yield Request("put_archive_data", {"upload": upload,
                                           "data": bytes(view[start:start + UPLOAD_CHUNK])},
                          self.default_timeout)
        done = yield Request("put_archive_end", {"upload": upload}, self.default_timeout)
        return done["files"]

    def shutdown(self, kill_grace_s: Optional[float] = None):
        """Stop every process of the sandbox and the daemon itself."""
        return self._call("shutdown", _present({"kill_grace_s": kill_grace_s}),
                                 timeout=self.default_timeout)

    def renew(self, phase: str, root: Optional[str] = None, token: Optional[str] = None,
              admin: Optional[str] = None):
        """The launcher's: ready the sandbox for its next lease (see the protocol doc);
        needs a connection made with the admin token."""
        return self._call("renew", _present({"phase": phase, "root": root, "token": token,
                                             "admin": admin}),
                          timeout=self.default_timeout)


def tar_of(files: Dict[str, Union[str, bytes]], mode: int = 0o644) -> bytes:
    """An uncompressed tar of ``{relative path: contents}``, for ``put_archive``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path, contents in sorted(files.items()):
            data = contents.encode() if isinstance(contents, str) else bytes(contents)
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


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


# --------------------------------------------------------------------------- blocking
class DaemonClient(_Operations):
    """Blocking client over one connection; calls from several threads are serialised.

    ``default_timeout`` bounds the wait for each reply (commands with their own timeout
    get that plus ``REPLY_SLACK_S``); None waits as long as it takes.
    """

    def __init__(self, address: str, token: str, *, connect_timeout: float = 10.0,
                 default_timeout: Optional[float] = None, hello_first: bool = True):
        """``hello_first`` False: send the hello and return without its answer, which
        comes with the first call's (a wrong token then fails that call with
        AuthError; the daemon runs nothing a connection sends before its hello is
        accepted): a first call costs one round trip, not two."""
        self.address = address
        self.default_timeout = default_timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._reader = FrameReader(MAX_FRAME)
        self._frames: List[bytes] = []
        # one receive buffer for the connection's life: a fresh bytes object per recv
        # costs an allocation (and page faults) on every reply. 64 KiB: a handle host
        # keeps a few connections per lease; larger replies arrive over several recvs
        self._recv_buf = bytearray(1 << 16)
        self._recv_view = memoryview(self._recv_buf)
        self._timeout: Optional[float] = connect_timeout
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
                n = self._sock.recv_into(self._recv_buf)
            except socket.timeout:
                continue
            if not n:
                raise ConnectionLost("daemon at %s closed the connection during %s"
                                     % (self.address, op))
            try:
                # frames may be views of the receive buffer: decoded before the next recv
                self._frames.extend(self._reader.feed(self._recv_view[:n]))
            except CodecError as exc:
                raise ProtocolError(str(exc)) from exc
        try:
            reply = unpack(self._frames.pop(0))
        except CodecError as exc:
            raise ProtocolError("undecodable reply: %s" % exc) from exc
        if not isinstance(reply, dict):
            raise ProtocolError("reply is not a map: %r" % (reply,))
        return reply


# --------------------------------------------------------------------------- asyncio
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
                      default_timeout: Optional[float] = None) -> "AsyncDaemonClient":
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
            await client._request("hello", _hello_fields(token), connect_timeout, None,
                                  hello=True)
        except (OSError, asyncio.TimeoutError) as exc:
            client.close()
            raise ConnectionLost("cannot connect to daemon at %s: %s" % (address, exc)) from exc
        except BaseException:
            client.close()
            raise
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
