"""Files and archives: read, write, stat, list, make, remove and move files; a tar of a
file or directory streamed out, and one uploaded in steps and extracted safely."""

import errno
import os
import stat

from ..fields import RequestError, as_bytes, bad_request, field, path_field
from ..wire import CHUNK, MAX_LIST_BYTES, MAX_READ, MAX_UPLOADS, MAX_UPLOADS_PER_CONNECTION

INLINE_READ = 256 * 1024  # read_file reads larger than this run on a thread


class FileOps:
    """The Daemon's file and archive ops (a mixin: the state is the Daemon's)."""

    async def op_read_file(self, req):
        """Up to ``length`` bytes (at most MAX_READ) from ``offset``. A read larger than
        INLINE_READ runs on a thread, so that other connections' calls are answered
        meanwhile (a sparse file of any size reads as fast as memory copies)."""
        path = path_field(req)
        offset = field(req, "offset", 0)
        length = field(req, "length", MAX_READ)
        if offset < 0 or length < 0:
            raise bad_request("offset and length must not be negative")
        length = min(length, MAX_READ)
        fh = open_regular(path, "rb")
        try:
            if min(length, os.fstat(fh.fileno()).st_size - offset) <= INLINE_READ:
                return _read_part(fh, offset, length)
            return await self.loop.run_in_executor(None, _read_part, fh, offset, length)
        finally:
            fh.close()

    def op_write_file(self, req):
        path = path_field(req)
        data = as_bytes(req["data"])
        mode = field(req, "mode", 0o644) & 0o7777
        append = field(req, "append", False)
        parent = os.path.dirname(os.path.abspath(path))
        if field(req, "parents", True):
            os.makedirs(parent, exist_ok=True)
        if append:
            with open_regular(path, "ab", mode) as fh:
                _write_fd(fh.fileno(), data)
                return {"size": os.fstat(fh.fileno()).st_size}
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

    def op_stat(self, req):
        return stat_result(path_field(req), field(req, "follow_symlinks", False))

    def op_list_dir(self, req):
        """Up to ``limit`` entries, and no more than fit half a frame: past either the
        listing stops, with ``truncated`` set."""
        path = path_field(req)
        limit = field(req, "limit", 100000)
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

    def op_mkdir(self, req):
        path = path_field(req)
        mode = field(req, "mode", 0o755) & 0o7777
        if field(req, "parents", True):
            os.makedirs(path, mode, exist_ok=True)
        else:
            os.mkdir(path, mode)
        return None

    async def op_remove(self, req):
        path = path_field(req)
        recursive = field(req, "recursive", False)
        missing_ok = field(req, "missing_ok", False)
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

    async def op_move(self, req):
        src, dst = path_field(req, "src"), path_field(req, "dst")
        if not field(req, "overwrite", True) and os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "destination exists", dst)
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            import shutil
            await self.loop.run_in_executor(None, shutil.move, src, dst)
        return None

    async def op_get_archive(self, req, reply):
        path = path_field(req)
        if not os.path.lexists(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        writer = _EventWriter(self.loop, reply)
        size = await self.loop.run_in_executor(None, _tar_directory, path, writer)
        return {"size": size}

    # An upload belongs to the connection that began it: no other connection can add
    # to it, and it is dropped (its spool file with it) when that connection closes.
    def op_put_archive_begin(self, req, conn):
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

    def op_put_archive_data(self, req, conn):
        path, spool = conn.upload(req)
        spool.write(req["data"])
        return None

    async def op_put_archive_end(self, req, reply):
        path, spool = reply.conn.upload(req)
        reply.conn.drop_upload(req["upload"])
        try:
            spool.seek(0)
            count = await self.loop.run_in_executor(None, _untar, spool, path)
        finally:
            spool.close()
        return {"files": count}


_OPEN_FLAGS = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
               "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def _read_part(fh, offset, length):
    size = os.fstat(fh.fileno()).st_size
    fh.seek(offset)
    data = fh.read(length)
    return {"data": data, "size": size, "eof": offset + len(data) >= size}


def open_regular(path, mode="rb", perms=0o644):
    """``path`` opened as a file object (``mode`` rb, wb or ab), refused unless it is a
    regular file. Opened without blocking: a FIFO (the tenant's, or swapped in under a
    copy) would hold the opening thread until someone opens its other end, and a
    device would answer without end; either way the caller gets an error at once."""
    flags = _OPEN_FLAGS[mode] | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, perms)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # a FIFO no one reads, opened for writing
            raise
        fd = None
        st = os.stat(path)
    if fd is not None:
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
    if not stat.S_ISREG(st.st_mode):
        if fd is not None:
            os.close(fd)
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "special file")
        raise RequestError("NotARegularFile", "%s is a %s, not a regular file"
                           % (os.fsdecode(path), kind))
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


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


def _tarfile():
    """tarfile without user and group name lookups: those would load the NSS modules
    that the sandbox's own /etc/nsswitch.conf names, from the sandbox's own files, into
    the daemon, which outlives its tenants (providers/local/renew.py). Archives carry
    numeric owners only. Its file opens are ``open_regular``'s."""
    import tarfile
    tarfile.pwd = tarfile.grp = None
    # the files it reads (get_archive) and writes (put_archive) are opened as regular
    # files only, without blocking: a FIFO in their place is an error, not a hang
    tarfile.bltn_open = open_regular
    return tarfile


def _tar_directory(path, writer):
    tarfile = _tarfile()
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
    tarfile = _tarfile()
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
