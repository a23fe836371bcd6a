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

A snapshot is charged what it takes: its files' blocks, and ENTRY_BYTES for each entry
besides its link target and extended attributes (a layer of empty names still fills a
store's memory and inodes), against the pool's budget on the node and the store's free
bytes and inodes. The walk holds its directories open on a stack, so it is linear in
the entries however deep; it stops at MAX_ENTRIES or after CAPTURE_S (10,000 entries:
0.33 s here on a tmpfs, as 240-deep chains or flat; 200,000: 5.4 s).

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
        ``name``, refused past ``budget`` bytes (``room``), past the entries the store
        has room for (``entries_room``) or after CAPTURE_S. Blocking: the agent runs it
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
                size = copy_layer(upper_fd, layer, base_id, budget, self.entries_room(),
                                  CAPTURE_S)
            finally:
                os.close(layer)
            info = SnapshotInfo(name=name, image=image_ref(self.pool, name), base=image.image,
                                size_bytes=size, node_id=node_id, source=source,
                                created_at=time.time())
            # the cache entry under it, which the image cache never evicts (image_budget)
            meta = dict(info.to_dict(), base_rootfs=str(image.rootfs),
                        config={"env": list(image.config.env),
                                "workdir": image.config.workdir, "user": image.config.user})
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

    def entries_room(self) -> int:
        """Entries a new snapshot may make here: MAX_ENTRIES, and no more than the
        inodes the filesystem has free past a reserve of a tenth of them (where it
        counts them)."""
        fs = os.statvfs(self.root)
        if fs.f_files == 0:  # a filesystem that allocates inodes as it goes
            return MAX_ENTRIES
        return max(0, min(MAX_ENTRIES, fs.f_favail - fs.f_files // 10))

    def list(self) -> List[SnapshotInfo]:
        found = []
        for entry in sorted(self.dir.glob("[!.]*/meta.json")):
            try:
                meta = json.loads(entry.read_text())
            except (OSError, ValueError):
                continue
            meta.pop("config", None)
            meta.pop("base_rootfs", None)  # the image cache's (image_budget.py)
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
# what every entry of a layer (a file, directory, link, FIFO or whiteout) costs a
# snapshot beside its data: its inode and its name in the store (tmpfs keeps ~700
# bytes of each; a disk's directories take blocks of their own)
ENTRY_BYTES = 1024
MAX_ENTRIES = 200_000  # entries a snapshot may hold, whatever inodes its store has free
CAPTURE_S = 60.0  # the longest a capture may copy (its sandbox is frozen meanwhile)


class Copy:
    """One layer's copy: the bytes it allocated so far against ``budget``, the entries
    it made against ``entries``, and the time it may take (``seconds``; each None: no
    limit); and the files of more than one link already copied (inode -> the path of
    the first, from the destination's root), which the next names link to."""

    def __init__(self, budget: Optional[int], entries: Optional[int] = None,
                 seconds: Optional[float] = None):
        self.budget, self.entries, self.seconds = budget, entries, seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.allocated = 0
        self.count = 0
        self.linked = {}

    def charge(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.budget is not None and self.allocated > self.budget:
            raise fatal("the snapshot would hold more than %d bytes, the room left for this "
                        "pool's snapshots on this node" % self.budget)

    def entry(self, nbytes: int = 0) -> None:
        """One more entry of the layer, holding ``nbytes`` beside its ENTRY_BYTES."""
        self.count += 1
        if self.entries is not None and self.count > self.entries:
            raise fatal("the snapshot would hold more than %d entries (files, directories "
                        "and links), what this node's store has room for" % self.entries)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise fatal("the snapshot took more than %g s to copy (%d entries so far): its "
                        "sandbox stays frozen no longer" % (self.seconds, self.count))
        self.charge(ENTRY_BYTES + nbytes)


class _Level:
    """A directory of the copy's walk: the source's and the destination's open, the
    names in it left to copy, and its path from the roots."""

    def __init__(self, s_dir: int, d_dir: int, parts: tuple):
        self.s_dir, self.d_dir, self.parts = s_dir, d_dir, parts
        self.names = None  # listed on its first turn

    def close(self) -> None:
        os.close(self.s_dir)
        os.close(self.d_dir)


def copy_layer(src: int, dst: int, base_id: int, budget: Optional[int] = None,
               entries: Optional[int] = None, seconds: Optional[float] = None) -> int:
    """Copy the tree below the directory ``src`` into the empty directory ``dst``
    (both descriptors), owners shifted down by ``base_id``; the bytes charged for it
    (its data, ENTRY_BYTES an entry, link targets and extended attributes). The walk
    keeps each open directory's descriptors on a stack (two a level, at most
    MAX_DEPTH levels: deeper is refused), so its cost is linear in the entries however
    deep they lie, and nothing is opened through a link. Holes stay holes, hard links
    stay links; past ``budget`` bytes, ``entries`` entries or ``seconds`` the copy
    stops (``fatal``)."""
    copy = Copy(budget, entries, seconds)
    own = os.fstat(src)
    os.fchmod(dst, stat.S_IMODE(own.st_mode))
    os.fchown(dst, *_shifted(own, base_id))
    stack = [_Level(os.dup(src), os.dup(dst), ())]
    try:
        while stack:
            level = stack[-1]
            if level.names is None:
                level.names = os.listdir(level.s_dir)
            if not level.names:  # done: its own attributes, then its parent's turn
                copy.charge(_copy_xattrs(level.s_dir, level.d_dir))
                stack.pop().close()
                continue
            child = _copy_entry(level.names.pop(), level, dst, base_id, copy)
            if child is not None:
                stack.append(child)
                if len(stack) > MAX_DEPTH + 1:
                    raise fatal("the layer is deeper than %d directories" % MAX_DEPTH)
    finally:
        for level in stack:
            level.close()
    return copy.allocated


def _shifted(st: os.stat_result, base_id: int):
    """The owner an image would have: the range's ids down to 0..65535; anything else
    (the overlay's own whiteouts, made by host root) root's."""
    uid, gid = st.st_uid - base_id, st.st_gid - base_id
    return (uid if 0 <= uid < _IDS else 0), (gid if 0 <= gid < _IDS else 0)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _copy_entry(name: str, level: _Level, d_root: int, base_id: int,
                copy: Copy) -> Optional[_Level]:
    """Copy the entry ``name`` of ``level``; a directory's level, its turn next."""
    s_dir, d_dir = level.s_dir, level.d_dir
    st = os.stat(name, dir_fd=s_dir, follow_symlinks=False)
    mode, owner = st.st_mode, _shifted(st, base_id)
    if stat.S_ISDIR(mode):
        copy.entry(st.st_blocks * 512)
        os.mkdir(name, 0o700, dir_fd=d_dir)
        os.chmod(name, stat.S_IMODE(mode), dir_fd=d_dir)
        os.chown(name, *owner, dir_fd=d_dir, follow_symlinks=False)
        below = os.open(name, _DIR_FLAGS, dir_fd=s_dir)
        try:
            seen = os.fstat(below)
            if (seen.st_ino, seen.st_dev) != (st.st_ino, st.st_dev):
                raise fatal("snapshot: %r changed while it was copied" % name)
            made = os.open(name, _DIR_FLAGS, dir_fd=d_dir)
        except BaseException:
            os.close(below)
            raise
        return _Level(below, made, level.parts + (name,))
    if stat.S_ISREG(mode) and st.st_nlink > 1 and st.st_ino in copy.linked:
        copy.entry()
        os.link(copy.linked[st.st_ino], name, src_dir_fd=d_root, dst_dir_fd=d_dir,
                follow_symlinks=False)
        return None
    if stat.S_ISREG(mode):
        copy.entry()
        _copy_file(name, s_dir, d_dir, st, owner, copy)
        if st.st_nlink > 1:
            copy.linked[st.st_ino] = "/".join(level.parts + (name,))
        return None
    if stat.S_ISLNK(mode):
        target = os.readlink(name, dir_fd=s_dir)
        copy.entry(max(len(os.fsencode(target)), st.st_blocks * 512))
        os.symlink(target, name, dir_fd=d_dir)
    elif stat.S_ISCHR(mode) and st.st_rdev == 0:  # a whiteout: the image's file was deleted
        copy.entry()
        os.mknod(name, stat.S_IFCHR | 0o600, 0, dir_fd=d_dir)
    elif stat.S_ISFIFO(mode):
        copy.entry()
        os.mkfifo(name, 0o600, dir_fd=d_dir)
    else:
        return None  # sockets and device nodes: not files a snapshot carries
    os.chown(name, *owner, dir_fd=d_dir, follow_symlinks=False)
    if not stat.S_ISLNK(mode):
        os.chmod(name, stat.S_IMODE(mode), dir_fd=d_dir)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d_dir, follow_symlinks=False)
    return None


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
            copy.charge(_copy_xattrs(src, dst))
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


def _copy_xattrs(src: int, dst: int) -> int:
    """Copy the extended attributes a layer keeps; the bytes of their names and values."""
    try:
        names = os.listxattr(src)
    except OSError:
        return 0
    copied = 0
    for key in names:
        if _copied_xattr(key):
            try:
                value = os.getxattr(src, key)
                os.setxattr(dst, key, value)
            except OSError:
                continue
            copied += len(key) + len(value)
    return copied


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
