"""An image's files read as data, never as paths into the host.

Every file the agent (host root) reads of an image (its ``etc/passwd`` and
``etc/group``, an OCI layout's ``index.json``, manifests, configs and blobs) is opened
below a directory descriptor of the image with ``openat2(RESOLVE_IN_ROOT)``: a link,
absolute or climbing, resolves as if the image's directory were ``/``, so it can never
name a host file. Only regular files are read (a FIFO, a device or a directory is
refused after the open, which never blocks: ``O_NONBLOCK``), and never more than a cap
of bytes. On a kernel without ``openat2`` (before 5.6) the path is walked one component
at a time with ``O_NOFOLLOW``, and any link on the way is refused.

The image's user (``config.User`` or a spec's ``user``) is resolved here too, through
the same reads: ``resolve_user``.
"""

import ctypes
import errno
import logging
import os
import stat
from pathlib import Path
from typing import Optional

from sandman_ray.errors import ProviderError
from sandman_ray.errors import fatal

logger = logging.getLogger(__name__)

SYS_OPENAT2 = 437  # the same number on every architecture (the generic table, 5.6+)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
# The most of an image's etc/passwd or etc/group read for a user lookup.
ACCOUNTS_CAP = 4 * 2 ** 20
_CHUNK = 1 << 20


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # no libc to call through: the walk below does it
    _libc = None
# False once the kernel said it has no openat2 (ENOSYS); tests set it to test the walk.
use_openat2 = _libc is not None


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _walk(dir_fd: int, path: str, flags: int) -> int:
    """``path`` below ``dir_fd`` one component at a time, refusing every link and
    ``..`` (the fallback of a kernel without openat2)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OSError(errno.EXDEV, "a path that climbs out of the image", path)
    current = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=current)
            os.close(current)
            current = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
    finally:
        os.close(current)


def open_below(dir_fd: int, path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` resolved inside ``dir_fd`` as if it were ``/`` (links
    included); OSError when it cannot be (ELOOP or ENOTDIR for a link the fallback
    refuses)."""
    global use_openat2
    if use_openat2:
        try:
            return _openat2(dir_fd, path, flags)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            use_openat2 = False
            logger.warning("this kernel has no openat2: an image's files are read with "
                           "O_NOFOLLOW walks, which refuse every link")
    return _walk(dir_fd, path, flags)


def open_root(path: Path, image: str) -> int:
    """A directory descriptor of an image's directory (a rootfs, an OCI layout)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise fatal("image %r: %s: %s" % (image, path, exc.strerror or exc)) from exc


def open_regular(dir_fd: int, path: str, image: str) -> int:
    """``path`` below ``dir_fd`` opened for reading, refused unless it is a regular file
    (the open does not block on a FIFO: O_NONBLOCK, cleared once it is known regular)."""
    try:
        fd = open_below(dir_fd, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise fatal("image %r: %s: %s" % (image, path, exc.strerror or exc)) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise fatal("image %r: %s is not a regular file (%s): refused"
                         % (image, path, _kind(mode)))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "mode %o" % mode


def read_capped(fd: int, cap: int, what: str) -> bytes:
    """At most ``cap`` bytes of ``fd`` (closed after); ``what`` past it is refused."""
    chunks, total = [], 0
    try:
        while True:
            chunk = os.read(fd, min(_CHUNK, cap + 1 - total))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise fatal("%s is larger than %d bytes: refused" % (what, cap))
    finally:
        os.close(fd)


def read_file(dir_fd: int, path: str, cap: int, image: str) -> bytes:
    """The bytes of the regular file ``path`` below ``dir_fd``, at most ``cap``."""
    return read_capped(open_regular(dir_fd, path, image), cap,
                       "image %r: %s" % (image, path))


# --------------------------------------------------------------------------- users
def resolve_user(rootfs: Optional[Path], user: str, image: str) -> str:
    """``user`` (``name``, ``uid``, ``name:group``, ``uid:gid``) as ``uid:gid``, names
    looked up in the image's ``etc/passwd`` and ``etc/group`` (read below ``rootfs``,
    the host's for ``host``); ``""`` for root. A name the image does not know is a
    fatal error, never a silent run as root."""
    if not user:
        return ""
    if "\0" in user or "\n" in user:
        raise fatal("image %r: user %r holds a NUL or a newline: refused" % (image, user))
    name, _, group = user.partition(":")
    tables = {}

    def lookup(table: str, key: str, column: int) -> str:
        if table not in tables:
            tables[table] = _accounts(rootfs, table, image)
        for line in tables[table]:
            fields = line.split(":")
            if len(fields) > column and (fields[0] == key or fields[2] == key):
                value = fields[column]
                if not value.isdigit():
                    raise fatal("image %r: its etc/%s gives %r a non-numeric id %r"
                                 % (image, table, key, value))
                return value
        raise fatal("image %s has no %s entry for %r (user %r)" % (image, table, key, user))
    uid = name if name.isdigit() else lookup("passwd", name, 2)
    if group:
        gid = group if group.isdigit() else lookup("group", group, 2)
    else:
        gid = uid if name.isdigit() else lookup("passwd", name, 3)
    return "" if uid == "0" and gid == "0" else "%s:%s" % (uid, gid)


def _accounts(rootfs: Optional[Path], table: str, image: str) -> list:
    """The lines of the image's etc/``table``; none when it has no such file."""
    root = open_root(rootfs or Path("/"), image)
    try:
        try:
            fd = open_regular(root, "etc/" + table, image)
        except ProviderError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOENT:
                return []
            raise
        data = read_capped(fd, ACCOUNTS_CAP, "image %r: etc/%s" % (image, table))
    finally:
        os.close(root)
    return data.decode(errors="replace").splitlines()
