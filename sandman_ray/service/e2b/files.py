"""envd's filesystem service (``/filesystem.Filesystem/...``: stat, list, make dir,
move, remove, and watches of directories, streamed or polled) and its HTTP ``/files``
(downloads, and uploads as multipart or octet-stream), made of the daemon's file
operations and ``watch_dir``."""

import asyncio
import collections
import os
import posixpath
import secrets
import stat as stat_module
import time

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.multipart import parse_content_disposition

from sandman_ray.errors import DaemonError
from sandman_ray.service.e2b import connect
from sandman_ray.service.e2b.connect import RpcError, invalid
from sandman_ray.service.e2b.envd import (
    EnvdPart, _path, _rpc_error, relay, stream_response)
from sandman_ray.service.e2b.sandboxes import USER

UPLOAD_MAX = 1 << 30
CHUNK = 4 * 1024 * 1024  # what an upload or a download holds in memory at once
FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
              "symlink": "FILE_TYPE_SYMLINK"}
EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
               "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
               "chmod": "EVENT_TYPE_CHMOD"}
HTTP_STATUS = {"not_found": 404, "already_exists": 409, "permission_denied": 403,
               "invalid_argument": 400, "resource_exhausted": 507, "unavailable": 502}
WATCH_EVENTS_MAX = 10000  # events a polled watcher keeps until they are fetched
WATCHERS_MAX = 64  # watches of one sandbox, polled and streamed
LIST_MAX = 100000  # entries of one ListDir
KEEPALIVE = {"keepalive": {}}


class Files(EnvdPart):
    """See the module's docstring."""

    def routes(self) -> list:
        files = {"Stat": self.stat, "ListDir": self.list_dir, "MakeDir": self.make_dir,
                 "Move": self.move, "Remove": self.remove, "WatchDir": self.watch_dir,
                 "CreateWatcher": self.create_watcher,
                 "GetWatcherEvents": self.get_watcher_events,
                 "RemoveWatcher": self.remove_watcher}
        return [web.post("/filesystem.Filesystem/" + name, handler)
                for name, handler in files.items()] + [
            web.get("/files", self.download), web.post("/files", self.upload)]

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
                    if len(found) > LIST_MAX:
                        raise RpcError("resource_exhausted", "a listing holds at most %d "
                                       "entries: list less deep" % LIST_MAX)
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

    async def watch_dir(self, request):
        """A server stream: start once the watch is in place, then each event."""
        response = None
        error = None
        try:
            box, client = await self._sandbox(request)  # its token before its body
            message = await connect.stream_request(request)
            watcher_id = _reserve(box)  # a streamed watch counts as a polled one does
            try:
                watch = box.watchers[watcher_id] = await Watch.start(client, message)
            except BaseException:
                box.watchers.pop(watcher_id, None)
                raise
            try:
                response = await stream_response(request)
                await response.write(connect.envelope({"start": {}}))
                await relay(response, watch.follow(), request, KEEPALIVE)
            finally:
                watch.stop()
                box.watchers.pop(watcher_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            error = _rpc_error(exc)
        if response is None:
            response = await stream_response(request)
        await response.write(connect.end_of_stream(error))
        await response.write_eof()
        return response

    async def create_watcher(self, request):
        async def created(box, client, message):
            watcher_id = _reserve(box)
            try:
                box.watchers[watcher_id] = await Watch.start(client, message)
            except BaseException:
                box.watchers.pop(watcher_id, None)
                raise
            return {"watcherId": watcher_id}
        return await self._unary(request, created)

    async def get_watcher_events(self, request):
        async def taken(box, client, message):
            watch = _watcher(box, message)
            events = list(watch.events)
            watch.events.clear()
            return {"events": events}
        return await self._unary(request, taken)

    async def remove_watcher(self, request):
        async def removed(box, client, message):
            _watcher(box, message)
            box.watchers.pop(message["watcherId"]).stop()
            return {}
        return await self._unary(request, removed)

    async def download(self, request):
        """``/files``: the file, streamed CHUNK bytes at a time (never whole in memory)."""
        response = None
        try:
            box, client = await self._sandbox(request)
            path = _path(request.query.get("path"))
            st = await client.stat(path, follow_symlinks=True)
            if st.type != "file":
                raise invalid("%s is a %s, not a file" % (path, st.type))
            offset = 0
            while True:
                data = await client.read_file(path, offset, CHUNK)
                if response is None:
                    response = web.StreamResponse(headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Disposition": "attachment; filename=%s"
                        % posixpath.basename(path)})
                    await response.prepare(request)
                offset += len(data)
                if data:
                    await response.write(data)
                if len(data) < CHUNK:
                    break
        except Exception as exc:  # noqa: BLE001
            if response is not None:  # cut short: the client sees the length unmet
                raise
            return _http_error(_rpc_error(exc))
        await response.write_eof()
        return response

    async def upload(self, request):
        """``/files``: one file in an octet-stream body (``path`` in the query; gzip
        too, unpacked by aiohttp a bounded piece at a time), or files in a multipart body (each part's filename its path); each
        written as it comes, CHUNK bytes at a time, beside its path and then moved into
        place."""
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
                    written.append(await _write(client, _path(name), part.read_chunk))
            else:
                read = request.content.read  # (a gzip body arrives unpacked, in pieces)
                written.append(await _write(client, _path(request.query.get("path")), read))
        except RequestPayloadError as exc:  # a body that its encoding does not unpack
            return _http_error(invalid("the body could not be read: %s" % exc))
        except Exception as exc:  # noqa: BLE001
            return _http_error(_rpc_error(exc))
        return web.json_response(written)


async def _write(client, path: str, read) -> dict:
    """Write what ``read(n)`` gives, to its end, to ``path``: beside it first, then moved
    into place (a reader of ``path`` never sees half of it)."""
    beside = "%s.e2b-upload-%s" % (path, secrets.token_hex(6))
    size, first = 0, True
    try:
        while True:
            chunk = await read(CHUNK)
            if not chunk and not first:
                break
            size += len(chunk)
            if size > UPLOAD_MAX:
                raise RpcError("resource_exhausted", "an upload is at most %d bytes"
                               % UPLOAD_MAX)
            await client.write_file(beside, chunk, parents=True, append=not first)
            first = False
        await client.move(beside, path)
    except BaseException:
        try:
            await client.remove(beside, missing_ok=True)
        except Exception:  # noqa: BLE001 - the sandbox went; its files with it
            pass
        raise
    return {"name": posixpath.basename(path), "type": "file", "path": path}


class Watch:
    """One directory watched by the daemon (``watch_dir``), its events kept as E2B's
    ``FilesystemEvent`` until they are taken."""

    def __init__(self, client, path: str, recursive: bool):
        self.stream = client.watch_dir(path, recursive)
        self.events = collections.deque(maxlen=WATCH_EVENTS_MAX)
        self.more = asyncio.Event()
        self.ended = False
        self.ready = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(self._run())

    @classmethod
    async def start(cls, client, message: dict) -> "Watch":
        path = _path(message.get("path"))
        recursive = message.get("recursive", False)
        if not isinstance(recursive, bool):
            raise invalid("recursive is true or false")
        watch = cls(client, path, recursive)
        try:
            await watch.ready
        except BaseException:
            watch.stop()
            raise
        return watch

    async def _run(self) -> None:
        try:
            async for item in self.stream:
                if not isinstance(item, tuple):
                    break
                kind, name = item
                if kind == "ready":
                    self.ready.set_result(None)
                elif kind in EVENT_TYPES:
                    self.events.append({"name": os.fsdecode(name), "type": EVENT_TYPES[kind]})
                    self.more.set()
        except Exception as exc:  # noqa: BLE001 - the daemon's refusal, told by start
            if not self.ready.done():
                self.ready.set_exception(exc)
        finally:
            self.ended = True
            self.more.set()
            if not self.ready.done():
                self.ready.set_exception(RpcError("not_found", "the watch ended at once"))

    async def follow(self):
        """Each event as a WatchDir message, until the watch ends."""
        while True:
            while self.events:
                yield {"filesystem": self.events.popleft()}
            if self.ended:
                return
            self.more.clear()
            await self.more.wait()

    def stop(self) -> None:
        self.task.cancel()


def _reserve(box) -> str:
    """A new watcher's id, its place in the sandbox's watchers held (None until it
    starts), or resource_exhausted at WATCHERS_MAX."""
    if len(box.watchers) >= WATCHERS_MAX:
        raise RpcError("resource_exhausted", "a sandbox holds at most %d watches"
                       % WATCHERS_MAX)
    watcher_id = secrets.token_hex(8)
    box.watchers[watcher_id] = None
    return watcher_id


def _watcher(box, message: dict) -> Watch:
    watcher_id = message.get("watcherId")
    watch = box.watchers.get(watcher_id) if isinstance(watcher_id, str) else None
    if watch is None:
        raise RpcError("not_found", "watcher %r not found" % message.get("watcherId"))
    return watch


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


def _http_error(error: RpcError) -> web.Response:
    return web.json_response({"code": HTTP_STATUS.get(error.code, 500),
                              "message": error.message},
                             status=HTTP_STATUS.get(error.code, 500))
