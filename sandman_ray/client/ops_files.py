"""A sandbox's files: read and write in pieces, stat, list, make, remove, move,
watch, and tar archives in and out (a mixin of ``operations._Operations``); and
``tar_of``, a tar of a mapping of files."""

import io
import tarfile
from typing import Callable, List, Mapping, Optional, Union

from sandman_ray.client.plans import (
    MAX_RESULT_BYTES, READ_CHUNK, UPLOAD_CHUNK, Plan, Request, _Transport, _present)
from sandman_ray.errors import ResultTooLarge
from sandman_ray.results import FileStat, Listing


class _Files(_Transport):
    """See the module's docstring."""

    # files
    def read_file(self, path: str, offset: int = 0, length: Optional[int] = None, *,
                  max_bytes: int = MAX_RESULT_BYTES):
        """Read a file (all of it from ``offset`` unless ``length`` is given). A file
        larger than ``max_bytes`` raises ResultTooLarge: what a sandbox writes must not
        be able to fill the memory of the process that reads it (a sparse file of a
        terabyte costs the sandbox nothing).

        Args:
            path: the file's path in the sandbox; a relative one is relative to the
                workdir.
            offset: the byte offset to read from.
            length: the most bytes to read; None: to the end of the file. The bytes are
                asked for READ_CHUNK (32 MiB) at a time.
            max_bytes: the most bytes the call may return (default MAX_RESULT_BYTES,
                1 GiB).

        Returns:
            (bytes): what was read; fewer than ``length`` where the file ends first.

        Raises:
            ResultTooLarge: when what was asked for is more than ``max_bytes``; a file
                already larger is refused at its first chunk, not read to the limit.
            DaemonError: ``NotARegularFile`` for a FIFO, a device or a socket; the OS's
                refusal (``FileNotFoundError``, ``PermissionError`` ...) with its errno.
        """
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
        """Write ``data`` to the file ``path``: without ``append`` the file is replaced
        atomically (written beside it, then renamed), so readers see the old file or the
        new one.

        Args:
            path: the file's path in the sandbox; a relative one is relative to the
                workdir.
            data: the contents: bytes, or a str written as UTF-8.
            mode: the file's permission bits; with ``append``, only a file it creates
                gets them.
            parents: create missing parent directories.
            append: add ``data`` to the end of the file instead of replacing it.

        Returns:
            (int): the file's size in bytes after the write.

        Raises:
            DaemonError: ``NotARegularFile`` with ``append`` when ``path`` is a FIFO, a
                device or a socket.
        """
        fields = {"path": path, "data": data, "mode": mode, "parents": parents, "append": append}
        return self._call("write_file", fields, lambda r: r["size"], self.default_timeout)

    def stat(self, path: str, follow_symlinks: bool = False):
        """What the sandbox's file system says of ``path``: its type, size, mode, owner
        and modification time.

        Args:
            path: the path in the sandbox; a relative one is relative to the workdir.
            follow_symlinks: describe what a symlink points to; False describes the
                symlink itself (its ``target`` set).

        Returns:
            (FileStat): the file's description.
        """
        return self._call("stat", _present({"path": path, "follow_symlinks": follow_symlinks}),
                                 FileStat.from_wire, self.default_timeout)

    def list_dir(self, path: str, *, limit: Optional[int] = None) -> "Listing":
        """The entries of directory ``path``, sorted by name: a list of FileStat whose
        ``truncated`` says the daemon stopped at ``limit`` entries or at what fits a
        reply.

        Args:
            path: the directory's path in the sandbox; a relative one is relative to the
                workdir.
            limit: the most entries to return; None: 100,000. The daemon also stops at
                half a frame (32 MiB) of entries.

        Returns:
            (Listing): the entries; names are str, or bytes where the file system's name
                is not UTF-8.
        """
        return self._call("list_dir", _present({"path": path, "limit": limit}),
                                 Listing.from_wire, self.default_timeout)

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755):
        """Make the directory ``path``.

        Args:
            path: the directory's path in the sandbox; a relative one is relative to the
                workdir.
            parents: also make missing parent directories, and accept a directory that
                exists already; False makes ``path`` alone.
            mode: the new directory's permission bits.

        Returns:
            (None): nothing.
        """
        return self._call("mkdir", _present({"path": path, "parents": parents, "mode": mode}),
                                 timeout=self.default_timeout)

    def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False):
        """Remove the file, symlink or directory ``path`` (a symlink itself, never what
        it points to).

        Args:
            path: the path in the sandbox; a relative one is relative to the workdir.
            recursive: remove a directory with everything in it; False removes only an
                empty one.
            missing_ok: a path that does not exist is no error.

        Returns:
            (None): nothing.

        Raises:
            DaemonError: ``FileNotFoundError`` when ``path`` does not exist and not
                ``missing_ok``.
        """
        return self._call("remove", _present({"path": path, "recursive": recursive,
                                                 "missing_ok": missing_ok}),
                                 timeout=self.default_timeout)

    def move(self, src: str, dst: str, *, overwrite: bool = True):
        """Move (rename) ``src`` to ``dst``; it works across file systems.

        Args:
            src: the path to move; a relative one is relative to the workdir.
            dst: where it goes.
            overwrite: replace what is at ``dst``; False refuses when ``dst`` exists.

        Returns:
            (None): nothing.

        Raises:
            DaemonError: ``FileExistsError`` when ``dst`` exists and not ``overwrite``.
        """
        return self._call("move", _present({"src": src, "dst": dst, "overwrite": overwrite}),
                                 timeout=self.default_timeout)

    def watch_dir(self, path: str, recursive: bool = False, *,
                  stop: Optional[Callable[[], bool]] = None):
        """What befalls directory ``path`` (and its subdirectories if ``recursive``): an
        iterator of ``("ready", b"")`` once the watch is in place, then of ``(kind,
        relative path)`` events (kind ``create``, ``write``,
        ``remove``, ``rename`` or ``chmod``; the path bytes) as they happen, until it is
        closed or the directory removed; then ``{"events", "overflowed"}``.

        Args:
            path: the directory to watch; a relative one is relative to the workdir.
            recursive: watch its subdirectories too, those made later included (at most
                8,192).
            stop: a function of no arguments asked every STOP_POLL_S (0.2 s) while no
                event comes, by the blocking client only (the asyncio client ignores it);
                True stops the watch. None: never asked.

        Returns:
            (ExecStream): on the blocking client, the iterator of events ending with
                ``{"events": int, "overflowed": bool}``: how many events were sent, and
                whether the kernel's queue overflowed while the client lagged (some
                events were lost). The asyncio client gives an async iterator of the same
                items. The client sets no time limit on it.

        Raises:
            DaemonError: ``NotADirectoryError`` if ``path`` is not a directory;
                ``Unsupported`` by a daemon whose Python lacks ``_ctypes``.
        """
        return self._stream("watch_dir", {"path": path, "recursive": recursive},
                            lambda r: r, None, stop)

    def get_archive(self, path: str, *, max_bytes: int = MAX_RESULT_BYTES):
        """A file or directory of the sandbox as an uncompressed tar (bytes); one larger
        than ``max_bytes`` raises ResultTooLarge (the rest of the stream is read and
        dropped, never kept).

        Args:
            path: the file or directory; a directory's contents are archived under
                ``.``, a file under its own name.
            max_bytes: the most bytes of tar kept (default MAX_RESULT_BYTES, 1 GiB).

        Returns:
            (bytes): an uncompressed POSIX (pax) tar.

        Raises:
            ResultTooLarge: when the tar is larger than ``max_bytes``.
            DaemonError: ``FileNotFoundError`` when ``path`` does not exist.
        """
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
        that would land outside it are refused. Returns the number of members.

        Args:
            path: the target directory in the sandbox; a relative one is relative to the
                workdir.
            tar: an uncompressed tar (``tar_of`` makes one), sent UPLOAD_CHUNK (8 MiB) at
                a time.

        Returns:
            (int): the number of members extracted.

        Raises:
            DaemonError: ``UnsafeArchive`` for a member that would land outside ``path``
                (an absolute name, ``..``), a link pointing outside it, or a device file.
        """
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
