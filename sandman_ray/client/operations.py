"""The daemon's operations, each written once as a plan (a generator that yields
the requests it needs and receives their results), for both clients to drive; and
what they share: streams of a command's output, requests, tar building."""

import io
import tarfile
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Sequence, Union

from sandman_ray.errors import ResultTooLarge
from sandman_ray.results import ExecResult, FileStat, Listing, ProcessOutput, ProcessStatus


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
    """What ``exec_stream`` and ``proc_follow`` return on a blocking connection:
    iterate it for ``(stream, bytes)`` chunks and, last, the result (exec_stream's
    ExecResult, a NamedTuple too: tell it by ``isinstance(item, ExecResult)``;
    proc_follow's status), which ``result`` keeps. ``close()`` (or dropping it) before
    the end kills exec_stream's command; a followed process goes on."""

    def __init__(self, frames):
        self._frames = frames
        self.result: Optional[ExecResult] = None

    def __iter__(self) -> "ExecStream":
        return self

    def __next__(self):
        item = next(self._frames)
        if type(item) is not tuple:  # the chunks are plain (stream, bytes) tuples
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
              buffer_bytes: Optional[int] = None, command_id: Optional[str] = None,
              stdin_open: Optional[bool] = None):
        """Start a background process; returns its pid. ``command_id``: started once
        per lease; a retry with the same id gets the same pid. ``stdin_open``: its stdin
        stays open for ``proc_stdin`` (else it reads ``stdin``, then end of file)."""
        fields = _present({"cmd": cmd if isinstance(cmd, str) else list(cmd), "cwd": cwd,
                           "env": env, "stdin": stdin, "buffer_bytes": buffer_bytes,
                           "stdin_open": stdin_open,
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

    def proc_follow(self, pid: int, stdout_cursor: int = 0, stderr_cursor: int = 0, *,
                    stop: Optional[Callable[[], bool]] = None):
        """A background process's output as it comes, from the cursors on: an iterator
        of ``(stream, bytes)`` chunks, then its status (a dict with ``exit_code``,
        ``stdout_cursor``, ``stderr_cursor`` and ``dropped``, the bytes its ring
        buffers had let go before they were sent) once it exits, also kept as the
        iterator's ``result``. Closing the iterator stops following; the process goes
        on."""
        return self._stream("proc_follow", {"pid": pid, "stdout_cursor": stdout_cursor,
                                            "stderr_cursor": stderr_cursor},
                            lambda r: r, None, stop)

    def proc_stdin(self, pid: int, data: Union[bytes, str] = b"", close: bool = False):
        """Write to the stdin of a process spawned with ``stdin_open`` (then close it if
        ``close``); the bytes written."""
        return self._call("proc_stdin", _present({"pid": pid, "data": data, "close": close}),
                          lambda r: r["written"], self.default_timeout)

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

    def watch_dir(self, path: str, recursive: bool = False, *,
                  stop: Optional[Callable[[], bool]] = None):
        """What befalls directory ``path`` (and its subdirectories if ``recursive``): an
        iterator of ``("ready", b"")`` once the watch is in place, then of ``(kind,
        relative path)`` events (kind ``create``, ``write``,
        ``remove``, ``rename`` or ``chmod``; the path bytes) as they happen, until it is
        closed or the directory removed; then ``{"events", "overflowed"}``."""
        return self._stream("watch_dir", {"path": path, "recursive": recursive},
                            lambda r: r, None, stop)

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


def tar_of(files: Mapping[str, Union[str, bytes]], mode: int = 0o644) -> bytes:
    """An uncompressed tar of ``{relative path: contents}``, for ``put_archive``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path, contents in sorted(files.items()):
            data = contents.encode() if isinstance(contents, str) else bytes(contents)
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
