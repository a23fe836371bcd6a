"""Snapshots of LocalProvider sandboxes: a sandbox's writable layer, copied to its
node's disk as a read-only layer that stacks over the sandbox's image.

A sandbox's files are an overlay: its image (shared, read-only) under a writable layer
of its own (a tmpfs). A snapshot copies that writable layer, and only it, to::

    <snapshot root>/<pool>/<name>/layer       the layer, owners as in an image
    <snapshot root>/<pool>/<name>/meta.json   its base image and config, size

The snapshot root (``LocalProvider(snapshot_root=...)``, root's alone, 0700) is a tmpfs
by default: memory, as the sandboxes' writable layers are. A layer of 1229 files and
25 MB was copied in 45 ms there, and in 1.4 s to this machine's disk, where each file
created costs ~1 ms.

and names it ``snapshot:<pool>/<name>``: a sandbox started from it has the overlay
``layer`` over the base image's own layers (``ImageCache.prepare``), with no copy of
the image. A snapshot of a sandbox started from a snapshot stacks one more layer.

The layer is copied as the overlay left it: files, directories, symlinks and FIFOs
with their modes, owners and times; whiteouts (character devices 0/0) and opaque
directories (``trusted.overlay.opaque``), which hide the image's files the sandbox
deleted; ``user.*`` extended attributes. Files are copied with ``copy_file_range``.
Owners are shifted from the sandbox's range of host ids to the image's (root inside,
host uid ``base``, is stored as 0), so the layer is idmapped to each new sandbox's
range as images are. Not copied: sockets, other device nodes (no sandbox can make
one), file capabilities and other ``security.*`` attributes; hard links become
separate files. Every path is opened below a directory descriptor without following
symbolic links: what the sandbox left cannot point the copy anywhere else.

Processes are not captured (CRIU fails on this kernel): a sandbox started from a
snapshot starts with its daemon alone.

Each node has a store of its own (``<snapshot root>/<node>/<pool>/...``: nodes that
share a machine share no store). A layer lives on the node where it was taken, and
reaches another node on demand: when a sandbox of it is to start there, that node's
agent asks the snapshot's agent for it (``export``: the layer and its meta as a tar,
its whiteouts as character devices and its opaque directories as pax xattr records,
through Ray's object store) and unpacks it into its own store (``import_tar``) first,
the snapshot's base first when that is a snapshot too. Both agents are the pool's own;
the tar is made from the store's own files, and is unpacked with tarfile's ``tar``
filter (no member outside the store, no link out of it), the modes kept.
"""

import json
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import List, Optional

from sandman_ray.errors import NotSupported, SnapshotInUse
from sandman_ray.providers.base import SnapshotInfo, fatal
from sandman_ray.spec import check_snapshot_name as check_name

PREFIX = "snapshot:"
_COPIED_XATTRS = ("trusted.overlay.opaque",)  # and every user.* one
_IDS = 65536  # ids of a sandbox's range


def image_ref(pool: str, name: str) -> str:
    return "%s%s/%s" % (PREFIX, pool, name)


def parse_ref(image: str):
    """(pool, name) of ``snapshot:<pool>/<name>``; ValueError naming the problem."""
    pool, sep, name = image[len(PREFIX):].partition("/")
    if not image.startswith(PREFIX) or not sep:
        raise ValueError("image %r: a snapshot is named snapshot:<pool>/<name>" % image)
    check_name(name)
    return pool, name


class SnapshotStore:
    """The snapshots of one pool on this node, under ``root`` (``snapshots_root``)."""

    def __init__(self, root: Path, pool: str):
        self.root = Path(root)
        self.pool = pool
        self.dir = self.root / pool

    def path(self, name: str) -> Path:
        return self.dir / check_name(name)

    def capture(self, upper_fd: int, name: str, base_id: int, image, source: str,
                node_id: Optional[str], budget: Optional[int] = None) -> SnapshotInfo:
        """Copy the upper directory open as ``upper_fd`` (a sandbox whose root inside
        is host id ``base_id``, started from the PreparedImage ``image``) as snapshot
        ``name``, refused past ``budget`` bytes (``room``). Blocking: the agent runs it
        on a thread, with the sandbox frozen."""
        dest = self.path(name)
        if dest.exists():
            raise fatal("pool %s already has a snapshot named %r" % (self.pool, name))
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        building = self.dir / (".building-%s-%s" % (name, secrets.token_hex(4)))
        building.mkdir(mode=0o700)
        try:
            (building / "layer").mkdir(mode=0o755)
            layer = os.open(building / "layer", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW |
                            os.O_CLOEXEC)
            try:
                size = copy_layer(upper_fd, layer, base_id, budget)
            finally:
                os.close(layer)
            info = SnapshotInfo(name=name, image=image_ref(self.pool, name), base=image.image,
                                size_bytes=size, node_id=node_id, source=source,
                                created_at=time.time())
            meta = dict(info.to_dict(), config={"env": list(image.config.env),
                                                "workdir": image.config.workdir,
                                                "user": image.config.user})
            (building / "meta.json").write_text(json.dumps(meta))
            os.rename(building, dest)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        return info

    def meta(self, name: str) -> dict:
        try:
            return json.loads((self.path(name) / "meta.json").read_text())
        except FileNotFoundError:
            raise fatal("pool %s has no snapshot named %r on this node"
                        % (self.pool, name)) from None

    def room(self, limit: int) -> int:
        """Bytes a new snapshot of this pool may take here: ``limit`` less what its
        snapshots hold, and no more than the filesystem has free past a reserve of a
        tenth of its size."""
        held = sum(info.size_bytes for info in self.list())
        fs = os.statvfs(self.root)
        free = fs.f_bavail * fs.f_frsize - fs.f_blocks * fs.f_frsize // 10
        return max(0, min(limit - held, free))

    def list(self) -> List[SnapshotInfo]:
        found = []
        for entry in sorted(self.dir.glob("[!.]*/meta.json")):
            try:
                meta = json.loads(entry.read_text())
            except (OSError, ValueError):
                continue
            meta.pop("config", None)
            found.append(SnapshotInfo(**meta))
        return found

    def export(self, name: str) -> bytes:
        """Snapshot ``name`` (its meta and its layer) as a tar, for another node."""
        import io
        import tarfile
        src = self.path(name)
        if not (src / "meta.json").exists():
            raise fatal("pool %s has no snapshot named %r on this node" % (self.pool, name))
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in [src / "meta.json", src / "layer"] + _below(src / "layer"):
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(src)))
                if info is None:  # a socket: a layer has none
                    continue
                for key in _xattrs(path):
                    info.pax_headers["SCHILY.xattr." + key] = os.getxattr(
                        path, key, follow_symlinks=False).decode("latin-1")
                if info.isreg():
                    with open(path, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
        return out.getvalue()

    def import_tar(self, name: str, data: bytes) -> None:
        """Unpack what ``export`` made on another node as snapshot ``name`` here (a
        snapshot this node has already is kept)."""
        import io
        import tarfile
        dest = self.path(name)
        if (dest / "meta.json").exists():
            return
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        building = self.dir / (".importing-%s-%s" % (name, secrets.token_hex(4)))
        building.mkdir(mode=0o700)
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
                members = tar.getmembers()
                tar.extractall(building, members=members, numeric_owner=True,
                               filter=_layer_members())
            for member in members:  # the opaque directories' marks
                for key, value in member.pax_headers.items():
                    if key.startswith("SCHILY.xattr.") and \
                            _copied_xattr(key[len("SCHILY.xattr."):]):
                        os.setxattr(building / member.name, key[len("SCHILY.xattr."):],
                                    value.encode("latin-1"), follow_symlinks=False)
            os.rename(building, dest)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    def delete(self, name: str) -> None:
        """Remove snapshot ``name``; SnapshotInUse while another snapshot of the pool
        stacks on it. (Its sandboxes are the agent's to check.)"""
        ref = image_ref(self.pool, name)
        above = [info.name for info in self.list() if info.base == ref]
        if above:
            raise SnapshotInUse("snapshot %s is the base of snapshot(s) %s: delete those first"
                                % (ref, ", ".join(above)))
        target = self.path(name)
        if not target.exists():
            return
        doomed = self.dir / (".deleting-%s-%s" % (name, secrets.token_hex(4)))
        os.rename(target, doomed)  # gone from listings at once
        shutil.rmtree(doomed, ignore_errors=True)

    def delete_all(self) -> int:
        """Remove every snapshot of the pool on this node (its pool is shut down)."""
        count = len(self.list())
        shutil.rmtree(self.dir, ignore_errors=True)
        return count


MAX_DEPTH = 256  # directory levels a layer may have (deeper: the snapshot is refused)


class Copy:
    """One layer's copy: the bytes it allocated so far against ``budget`` (None: no
    limit), and the files of more than one link already copied (inode -> the path of
    the first, from the destination's root), which the next names link to."""

    def __init__(self, budget: Optional[int]):
        self.budget = budget
        self.allocated = 0
        self.linked = {}

    def charge(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.budget is not None and self.allocated > self.budget:
            raise fatal("the snapshot would hold more than %d bytes, the room left for this "
                        "pool's snapshots on this node" % self.budget)


def copy_layer(src: int, dst: int, base_id: int, budget: Optional[int] = None) -> int:
    """Copy the tree below the directory ``src`` into the empty directory ``dst``
    (both descriptors), owners shifted down by ``base_id``; the bytes allocated for it.
    Iterative, each directory opened (component by component, no link followed) only
    when its turn comes, so neither a deep nor a wide tree exhausts the stack or the
    descriptors; deeper than MAX_DEPTH is refused. Holes stay holes, hard links stay
    links, and past ``budget`` bytes the copy stops (``fatal``)."""
    copy = Copy(budget)
    own = os.fstat(src)
    os.fchmod(dst, stat.S_IMODE(own.st_mode))
    os.fchown(dst, *_shifted(own, base_id))
    stack = [()]  # directories to copy, as paths of components below the roots
    while stack:
        parts = stack.pop()
        if len(parts) > MAX_DEPTH:
            raise fatal("the layer is deeper than %d directories" % MAX_DEPTH)
        s_dir, d_dir = _open_below(src, parts), None
        try:
            d_dir = _open_below(dst, parts)
            for entry in os.scandir(s_dir):
                _copy_entry(entry.name, parts, s_dir, d_dir, dst, base_id, stack, copy)
            _copy_xattrs(s_dir, d_dir)
        finally:
            os.close(s_dir)
            if d_dir is not None:
                os.close(d_dir)
    return copy.allocated


def _open_below(root: int, parts) -> int:
    """The directory ``root``/``parts...`` open, no link followed on the way."""
    fd = os.dup(root)
    for part in parts:
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _shifted(st: os.stat_result, base_id: int):
    """The owner an image would have: the range's ids down to 0..65535; anything else
    (the overlay's own whiteouts, made by host root) root's."""
    uid, gid = st.st_uid - base_id, st.st_gid - base_id
    return (uid if 0 <= uid < _IDS else 0), (gid if 0 <= gid < _IDS else 0)


def _copy_entry(name: str, parts, s_dir: int, d_dir: int, d_root: int, base_id: int,
                stack: list, copy: Copy) -> None:
    st = os.stat(name, dir_fd=s_dir, follow_symlinks=False)
    mode, owner = st.st_mode, _shifted(st, base_id)
    if stat.S_ISDIR(mode):
        os.mkdir(name, 0o700, dir_fd=d_dir)
        os.chmod(name, stat.S_IMODE(mode), dir_fd=d_dir)
        os.chown(name, *owner, dir_fd=d_dir, follow_symlinks=False)
        stack.append(parts + (name,))
        return
    if stat.S_ISREG(mode) and st.st_nlink > 1 and st.st_ino in copy.linked:
        os.link(copy.linked[st.st_ino], name, src_dir_fd=d_root, dst_dir_fd=d_dir,
                follow_symlinks=False)
        return
    if stat.S_ISREG(mode):
        _copy_file(name, s_dir, d_dir, st, owner, copy)
        if st.st_nlink > 1:
            copy.linked[st.st_ino] = "/".join(parts + (name,))
        return
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(name, dir_fd=s_dir), name, dir_fd=d_dir)
    elif stat.S_ISCHR(mode) and st.st_rdev == 0:  # a whiteout: the image's file was deleted
        os.mknod(name, stat.S_IFCHR | 0o600, 0, dir_fd=d_dir)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(name, 0o600, dir_fd=d_dir)
    else:
        return  # sockets and device nodes: not files a snapshot carries
    os.chown(name, *owner, dir_fd=d_dir, follow_symlinks=False)
    if not stat.S_ISLNK(mode):
        os.chmod(name, stat.S_IMODE(mode), dir_fd=d_dir)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d_dir, follow_symlinks=False)


def _copy_file(name: str, s_dir: int, d_dir: int, st, owner, copy: Copy) -> None:
    """A regular file's data extents (``sendfile``; its holes stay holes), attributes,
    owner, mode and times, set through its descriptor. Opened without blocking and
    checked to be the file that was looked at: a FIFO put in its place (the sandbox is
    frozen, but a capture must not hang on a layer it does not trust) is refused."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                  dir_fd=s_dir)
    try:
        now = os.fstat(src)
        if not stat.S_ISREG(now.st_mode) or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise fatal("snapshot: %r changed while it was copied" % name)
        copy.charge(now.st_blocks * 512)
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=d_dir)
        try:
            _copy_extents(src, dst, now.st_size)
            _copy_xattrs(src, dst)
            os.fchown(dst, *owner)
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_extents(src: int, dst: int, size: int) -> None:
    """The data of ``src`` into ``dst`` at the same offsets, holes skipped, then the
    size set: a sparse terabyte costs what it holds."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past offset
            break
        end = os.lseek(src, start, os.SEEK_HOLE)
        os.lseek(dst, start, os.SEEK_SET)
        while start < end:
            try:
                n = os.sendfile(dst, src, start, end - start)
            except OSError:
                os.lseek(src, start, os.SEEK_SET)
                n = _copy_plain(src, dst)
            if n == 0:
                break
            start += n
        offset = end
    os.ftruncate(dst, size)


def _copy_plain(src: int, dst: int) -> int:
    data = os.read(src, 1 << 20)
    view = memoryview(data)
    while view:
        view = view[os.write(dst, view):]
    return len(data)


def _copied_xattr(key: str) -> bool:
    return key in _COPIED_XATTRS or key.startswith("user.")


def _xattrs(path) -> list:
    try:
        return [k for k in os.listxattr(path, follow_symlinks=False) if _copied_xattr(k)]
    except OSError:
        return []


def archive_meta(data: bytes) -> dict:
    """The meta of a snapshot that ``export`` made: its first member, read without
    scanning the rest of the archive."""
    import io
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        first = tar.next()
        if first is None or first.name != "meta.json":
            raise fatal("a snapshot archive must begin with its meta.json")
        return json.loads(tar.extractfile(first).read())


def _below(top: Path) -> List[Path]:
    """Every path below ``top``, parents first, without following links."""
    found = []
    for parent, dirs, files in os.walk(top, followlinks=False):
        dirs.sort()
        found += [Path(parent) / name for name in sorted(dirs + files)]
    return found


def _layer_members():
    """The extraction filter of an exported snapshot: members are what a layer holds
    (absolute symbolic link targets included: ``/usr/bin/python`` and the like resolve
    in the sandbox's root), owners and modes as they are; a name that is absolute,
    climbs with ``..`` or lies below a link of the archive is refused, and so is a hard
    link to anything but a regular file the archive itself put there before it (a hard
    link is made on the host, where its target would be a host file)."""
    links, files = set(), set()

    def check(member, path):
        parts = member.name.split("/")
        if member.name.startswith("/") or ".." in parts or any(
                "/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise ValueError("snapshot archive member %r is outside its layer" % member.name)
        if member.islnk() and member.linkname not in files:
            raise ValueError("snapshot archive member %r links to %r, which is not a file of "
                             "the archive" % (member.name, member.linkname))
        if member.issym() or member.islnk():
            links.add(member.name)
        elif member.isreg():
            files.add(member.name)
        return member
    return check


def _copy_xattrs(src: int, dst: int) -> None:
    try:
        names = os.listxattr(src)
    except OSError:
        return
    for key in names:
        if _copied_xattr(key):
            try:
                os.setxattr(dst, key, os.getxattr(src, key))
            except OSError:
                pass


def unsupported_why(sandbox) -> Optional[str]:
    """Why ``sandbox`` (a SandboxProcess) cannot be snapshotted, or None."""
    if sandbox.image.rootfs is None:
        return ("sandbox %s runs the host image, a view of this machine, not an image a "
                "layer can stack on" % sandbox.sandbox_id)
    if getattr(sandbox, "writable", None) is None:
        return ("sandbox %s keeps no handle on its writable layer (an agent that is not "
                "root, or gVisor, whose layer lives in runsc)" % sandbox.sandbox_id)
    return None


def not_supported(sandbox) -> NotSupported:
    return NotSupported("snapshot of %s" % unsupported_why(sandbox))
