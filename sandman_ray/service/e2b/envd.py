"""envd, E2B's in-sandbox API, served by the service for its E2B sandboxes: the
Connect-RPC process service (start, connect, list, input, stdin, signals, terminals),
the filesystem service (stat, list, make dir, move, remove), HTTP ``/files`` (upload and
download) and ``/health``; each call made of the sandbox daemon's operations.

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
import stat as stat_module
import time
from typing import Optional

from aiohttp import web
from aiohttp.multipart import parse_content_disposition

from sandman_ray.errors import DaemonError, SandmanError
from sandman_ray.service.e2b import connect
from sandman_ray.service.e2b.connect import RpcError, b64, invalid
from sandman_ray.service.e2b.sandboxes import USER

HOME = "/home/user"
PROC_BUFFER = 4 * 1024 * 1024  # each stream's ring in the daemon: what a reconnect finds
UPLOAD_MAX = 1 << 30
KEEPALIVE_DEFAULT_S = 50.0
FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
              "symlink": "FILE_TYPE_SYMLINK"}
# the daemon's error kinds, as Connect's codes
CODES = {"FileNotFoundError": "not_found", "ProcessNotFound": "not_found",
         "TerminalNotFound": "not_found", "FileExistsError": "already_exists",
         "PermissionError": "permission_denied", "NotADirectoryError": "invalid_argument",
         "IsADirectoryError": "invalid_argument", "BadRequest": "invalid_argument",
         "LimitExceeded": "resource_exhausted", "StdinClosed": "failed_precondition",
         "TerminalClosed": "failed_precondition", "OSError": "internal"}
HTTP_STATUS = {"not_found": 404, "already_exists": 409, "permission_denied": 403,
               "invalid_argument": 400, "resource_exhausted": 507, "unavailable": 502}


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
    raise exc


def _entry(st, path: str) -> dict:
    kind = st.type
    mode = st.mode & 0o7777
    entry = {"name": posixpath.basename(path) or "/",
             "type": FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
             "path": path, "size": str(st.size), "mode": mode,
             "permissions": stat_module.filemode(mode | _TYPE_BITS.get(kind, 0)),
             "owner": _NAMES.get(st.uid, str(st.uid)), "group": _NAMES.get(st.gid, str(st.gid)),
             "modifiedTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(st.mtime)) + "Z"}
    if kind == "symlink":
        entry["isSymlink"] = True
        if st.target is not None:
            entry["symlinkTarget"] = st.target if isinstance(st.target, str) else \
                st.target.decode(errors="replace")
    return entry


_TYPE_BITS = {"file": stat_module.S_IFREG, "dir": stat_module.S_IFDIR,
              "symlink": stat_module.S_IFLNK}
_NAMES = {0: "root", 1000: USER}


class Envd:
    """envd's routes over the service's E2B sandboxes (``sandboxes``, sandboxes.py)."""

    def __init__(self, sandboxes):
        self.sandboxes = sandboxes

    def routes(self) -> list:
        process = {"Start": self.start, "Connect": self.connect_process, "List": self.list,
                   "SendInput": self.send_input, "StreamInput": self.stream_input,
                   "SendSignal": self.send_signal, "CloseStdin": self.close_stdin,
                   "Update": self.update}
        files = {"Stat": self.stat, "ListDir": self.list_dir, "MakeDir": self.make_dir,
                 "Move": self.move, "Remove": self.remove, "WatchDir": self.not_served,
                 "CreateWatcher": self.not_served, "GetWatcherEvents": self.not_served,
                 "RemoveWatcher": self.not_served}
        routes = [web.post("/process.Process/" + name, handler)
                  for name, handler in process.items()]
        routes += [web.post("/filesystem.Filesystem/" + name, handler)
                   for name, handler in files.items()]
        return routes + [web.get("/health", self.health), web.get("/files", self.download),
                         web.post("/files", self.upload)]

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
            message = await connect.unary_request(request)
            box, client = await self._sandbox(request)
            return web.json_response(await work(box, client, message))
        except Exception as exc:  # noqa: BLE001 - in Connect's shape, or raised on
            return connect.error_response(_rpc_error(exc))

    async def not_served(self, request) -> web.Response:
        return connect.error_response(RpcError(
            "unimplemented", "%s is not served by sandman" % request.path.rsplit("/", 1)[1]))

    # ---- process.Process
    async def start(self, request):
        async def begin(box, client, message):
            config = message.get("process") or {}
            if not isinstance(config, dict):
                raise invalid("process is an object")
            cmd = connect.text(config, "cmd")
            args = config.get("args") or []
            if not cmd or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise invalid("process.cmd is a command and process.args a list of strings")
            envs = config.get("envs") or {}
            if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
                raise invalid("process.envs is an object of strings")
            env = dict(box.envs, HOME=HOME, USER=USER, **envs)
            cwd = _path(connect.text(config, "cwd", None) or HOME, "process.cwd")
            argv = [cmd] + args
            pty = message.get("pty")
            if pty is not None:
                size = (pty.get("size") or {}) if isinstance(pty, dict) else None
                if not isinstance(size, dict):
                    raise invalid("pty.size is an object")
                opened = await client.pty_open(argv, cols=int(size.get("cols") or 80),
                                               rows=int(size.get("rows") or 24), cwd=cwd,
                                               env=env, buffer_bytes=PROC_BUFFER)
                pid = opened["pid"]
                box.procs[pid] = {"config": config, "pty": opened["pty"]}
            else:
                pid = await client.spawn(argv, cwd=cwd, env=env, buffer_bytes=PROC_BUFFER,
                                         stdin_open=bool(message.get("stdin")) or None)
                box.procs[pid] = {"config": config, "pty": None}
            if message.get("tag"):
                box.procs[pid]["tag"] = connect.text(message, "tag")
            return pid
        return await self._stream(request, begin, kill_at_deadline=True)

    async def connect_process(self, request):
        async def find(box, client, message):
            return self._pid_of(box, message.get("process"))
        return await self._stream(request, find, kill_at_deadline=False)

    async def _stream(self, request, begin, kill_at_deadline: bool):
        """A server stream of a process's events: start (its pid), its output as it
        comes, its end. The call's deadline (``Connect-Timeout-Ms``) ends it with
        deadline_exceeded and, for a Start, kills the process, as envd does; a client
        that goes away stops the following only."""
        response = None
        error = None
        try:
            message = await connect.stream_request(request)
            deadline = connect.timeout_s(request)
            box, client = await self._sandbox(request)
            pid = await begin(box, client, message)
            record = box.procs.get(pid, {})
            response = web.StreamResponse(headers={"Content-Type": connect.STREAM_JSON})
            await response.prepare(request)
            await response.write(connect.envelope({"event": {"start": {"pid": pid}}}))
            follow = self._follow_pty(client, record["pty"]) if record.get("pty") else \
                self._follow(client, pid)
            killer = None
            if kill_at_deadline and deadline:  # whether or not its client is still there
                killer = asyncio.get_running_loop().call_later(
                    deadline, lambda: asyncio.ensure_future(self._kill(client, record, pid)))
            try:
                await asyncio.wait_for(self._relay(response, follow, request), deadline)
            except asyncio.TimeoutError:
                error = RpcError("deadline_exceeded", "the command ran past its timeout "
                                 "(%g s) and was killed" % deadline if kill_at_deadline else
                                 "the connection's timeout (%g s) passed" % deadline)
            else:
                if killer is not None:  # it ended in time
                    killer.cancel()
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            error = _rpc_error(exc)
        if response is None:  # nothing was sent: the whole answer is its error's end
            response = web.StreamResponse(headers={"Content-Type": connect.STREAM_JSON})
            await response.prepare(request)
        await response.write(connect.end_of_stream(error))
        await response.write_eof()
        return response

    @staticmethod
    async def _kill(client, record: dict, pid: int) -> None:
        try:
            if record.get("pty"):
                await client.pty_close(record["pty"], kill_grace_s=0)
            else:
                await client.proc_signal(pid, "KILL")
        except SandmanError:  # ended meanwhile, or its sandbox did
            pass

    async def _relay(self, response, follow, request) -> None:
        every = float(request.headers.get("Keepalive-Ping-Interval") or KEEPALIVE_DEFAULT_S)
        pending = None
        events = follow.__aiter__()
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=max(1.0, every))
                if not done:
                    await response.write(connect.envelope({"event": {"keepalive": {}}}))
                    continue
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                await response.write(connect.envelope({"event": event}))
        finally:
            if pending is not None:
                pending.cancel()
            await events.aclose()

    async def _follow(self, client, pid):
        stream = client.proc_follow(pid)
        try:
            async for item in stream:
                if isinstance(item, tuple):
                    yield {"data": {item[0]: b64(item[1])}}
                else:
                    yield self._end(item)
        finally:
            await stream.aclose()

    async def _follow_pty(self, client, term: int):
        cursor = 0
        while True:
            got = await client.pty_read(term, cursor, timeout=30.0)
            cursor = got["cursor"]
            if got["data"]:
                yield {"data": {"pty": b64(got["data"])}}
            if got.get("eof") or (not got["running"] and not got["data"]):
                if got["running"]:
                    got = await client.pty_close(term)
                yield self._end(got)
                return

    @staticmethod
    def _end(status: dict) -> dict:
        code = status.get("exit_code")
        sig = status.get("signal")
        end = {"exited": code is not None and not sig,
               "exitCode": code if code is not None else -1,
               "status": ("signal: %s" % _signal_name(sig)) if sig else
               "exit status %d" % (code or 0)}
        return {"end": end}

    def _pid_of(self, box, selector) -> int:
        if not isinstance(selector, dict):
            raise invalid("process is a selector: {pid} or {tag}")
        if "pid" in selector:
            pid = connect.integer(selector["pid"], "process.pid")
            if pid not in box.procs:
                raise RpcError("not_found", "process with pid %d not found" % pid)
            return pid
        tag = connect.text(selector, "tag")
        for pid, record in box.procs.items():
            if record.get("tag") == tag:
                return pid
        raise RpcError("not_found", "process with tag %r not found" % tag)

    async def list(self, request):
        async def running(box, client, message):
            alive = {p.pid for p in await client.proc_list() if p.running}
            alive |= {t["pid"] for t in await client.pty_list() if t["running"]}
            procs = []
            for pid, record in list(box.procs.items()):
                if pid not in alive:
                    continue
                info = {"config": record["config"], "pid": pid}
                if "tag" in record:
                    info["tag"] = record["tag"]
                procs.append(info)
            return {"processes": procs}
        return await self._unary(request, running)

    async def _input(self, box, client, selector, given) -> None:
        pid = self._pid_of(box, selector)
        if not isinstance(given, dict):
            raise invalid("input is {stdin} or {pty}")
        record = box.procs[pid]
        if "pty" in given:
            if not record.get("pty"):
                raise invalid("process %d has no terminal" % pid)
            await client.pty_write(record["pty"], connect.unb64(given["pty"], "input.pty"))
        elif "stdin" in given:
            await client.proc_stdin(pid, connect.unb64(given["stdin"], "input.stdin"))
        else:
            raise invalid("input is {stdin} or {pty}")

    async def send_input(self, request):
        async def send(box, client, message):
            await self._input(box, client, message.get("process"), message.get("input"))
            return {}
        return await self._unary(request, send)

    async def stream_input(self, request):
        """A client stream: its first message names the process, the next carry input."""
        try:
            box, client = await self._sandbox(request)
            selector = None
            async for message in connect.envelopes(request):
                if "start" in message:
                    selector = (message["start"] or {}).get("process")
                    self._pid_of(box, selector)
                elif "data" in message:
                    if selector is None:
                        raise invalid("the stream's first message is its start")
                    await self._input(box, client, selector, (message["data"] or {}).get("input"))
            error = None
        except Exception as exc:  # noqa: BLE001
            error = _rpc_error(exc)
        body = (b"" if error else connect.envelope({})) + connect.end_of_stream(error)
        return web.Response(body=body, headers={"Content-Type": connect.STREAM_JSON})

    async def send_signal(self, request):
        async def signal(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            sig = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL",
                   15: "TERM"}.get(message.get("signal"))
            if sig is None:
                raise invalid("signal is SIGNAL_SIGKILL or SIGNAL_SIGTERM")
            record = box.procs[pid]
            if record.get("pty"):
                status = await client.pty_list()
                if not any(t["pty"] == record["pty"] and t["running"] for t in status):
                    raise RpcError("not_found", "process with pid %d not found" % pid)
                await client.pty_close(record["pty"], kill_grace_s=0 if sig == "KILL" else 0.5)
            elif not (await client.proc_signal(pid, sig)).running:
                raise RpcError("not_found", "process with pid %d not found" % pid)
            return {}
        return await self._unary(request, signal)

    async def close_stdin(self, request):
        async def close(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            await client.proc_stdin(pid, close=True)
            return {}
        return await self._unary(request, close)

    async def update(self, request):
        async def resize(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            size = ((message.get("pty") or {}).get("size") or {})
            record = box.procs[pid]
            if not record.get("pty"):
                raise invalid("process %d has no terminal" % pid)
            await client.pty_resize(record["pty"], int(size.get("cols") or 80),
                                    int(size.get("rows") or 24))
            return {}
        return await self._unary(request, resize)

    # ---- filesystem.Filesystem
    async def stat(self, request):
        async def one(box, client, message):
            path = _path(message.get("path"))
            return {"entry": _entry(await client.stat(path), path)}
        return await self._unary(request, one)

    async def list_dir(self, request):
        async def entries(box, client, message):
            path = _path(message.get("path"))
            depth = connect.integer(message.get("depth", 1) or 1, "depth", 1, 64)
            found = []
            level = [path]
            for _ in range(depth):
                deeper = []
                for where in level:
                    for st in await client.list_dir(where):
                        name = st.name if isinstance(st.name, str) else st.name.decode(
                            errors="replace")
                        full = posixpath.join(where, name)
                        found.append(_entry(st, full))
                        if st.type == "dir":
                            deeper.append(full)
                level = deeper
            return {"entries": found}
        return await self._unary(request, entries)

    async def make_dir(self, request):
        async def made(box, client, message):
            path = _path(message.get("path"))
            try:
                st = await client.stat(path)
            except DaemonError as exc:
                if exc.type != "FileNotFoundError":
                    raise
            else:
                raise RpcError("already_exists", "%s already exists (a %s)" % (path, st.type))
            await client.mkdir(path, parents=True)
            return {"entry": _entry(await client.stat(path), path)}
        return await self._unary(request, made)

    async def move(self, request):
        async def moved(box, client, message):
            src = _path(message.get("source"), "source")
            dst = _path(message.get("destination"), "destination")
            await client.move(src, dst)
            return {"entry": _entry(await client.stat(dst), dst)}
        return await self._unary(request, moved)

    async def remove(self, request):
        async def removed(box, client, message):
            await client.remove(_path(message.get("path")), recursive=True)
            return {}
        return await self._unary(request, removed)

    # ---- HTTP
    async def health(self, request):
        try:
            self.sandboxes.for_envd(sandbox_id_of(request), request.headers.get("X-Access-Token"))
        except LookupError as exc:
            return web.json_response({"message": "%s; it was not found" % exc}, status=502)
        return web.Response(status=204)

    async def download(self, request):
        try:
            box, client = await self._sandbox(request)
            path = _path(request.query.get("path"))
            data = await client.read_file(path)
        except Exception as exc:  # noqa: BLE001
            return _http_error(_rpc_error(exc))
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={"Content-Disposition": "attachment; filename=%s"
                                     % posixpath.basename(path)})

    async def upload(self, request):
        """``/files``: one file in an octet-stream body (``path`` in the query), or
        files in a multipart body (each part's filename its path)."""
        try:
            box, client = await self._sandbox(request)
            written = []
            if request.content_type == "multipart/form-data":
                reader = await request.multipart()
                async for part in reader:
                    # the part's own file name, as sent (aiohttp's ``filename`` drops a
                    # leading "/"); the query's path names a lone file
                    _, params = parse_content_disposition(
                        part.headers.get("Content-Disposition"))
                    name = request.query.get("path") if "path" in request.query else \
                        params.get("filename")
                    written.append(await self._write(client, _path(name), part.read_chunk))
            else:
                if request.headers.get("Content-Encoding", "identity") not in ("identity", "gzip"):
                    raise invalid("uploads are plain or gzip")
                read = request.content.read
                if request.headers.get("Content-Encoding") == "gzip":
                    import zlib
                    data = zlib.decompress(await _read_all(read), 16 + zlib.MAX_WBITS)
                    chunks = [data]

                    async def read(_n=0):
                        return chunks.pop() if chunks else b""
                written.append(await self._write(client, _path(request.query.get("path")), read))
        except Exception as exc:  # noqa: BLE001
            return _http_error(_rpc_error(exc))
        return web.json_response(written)

    async def _write(self, client, path: str, read) -> dict:
        data = await _read_all(read)
        await client.write_file(path, data, parents=True)
        return {"name": posixpath.basename(path), "type": "file", "path": path}


async def _read_all(read) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = await read(1 << 20)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > UPLOAD_MAX:
            raise RpcError("resource_exhausted", "an upload is at most %d bytes" % UPLOAD_MAX)
        chunks.append(chunk)


def _http_error(error: RpcError) -> web.Response:
    return web.json_response({"code": HTTP_STATUS.get(error.code, 500),
                              "message": error.message},
                             status=HTTP_STATUS.get(error.code, 500))


def _signal_name(sig) -> str:
    import signal
    try:
        return signal.Signals(sig).name.lower()[3:]
    except ValueError:
        return str(sig)

