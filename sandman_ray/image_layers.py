"""The built-in layer applier: an image layer's tar stream applied onto a rootfs in one
pass, its bytes checked against the digests that name them.

A layer is hostile input. What holds it:

- it is read as a stream (tarfile ``r|``), never whole in memory; past
  ``ImageLimits.layer_bytes`` of uncompressed bytes or ``layer_members`` members it is
  refused (a gzip bomb of 1 MiB that inflates to terabytes stops at the cap), and so is
  an extended header larger than 64 KiB, more than 8 of them on one member, or a
  sparse member (a terabyte that is holes);
- every path resolves inside the rootfs as if it were ``/`` (``safe_join``): ``..``,
  absolute names, links (absolute or climbing) in a member's parents, hard links and
  whiteouts through links all land inside it; a hard link never follows a link;
- whiteouts apply in the order of the stream, as the OCI spec allows: ``.wh.NAME``
  removes what the layers below put at NAME, ``.wh..wh..opq`` empties a directory of
  what the layers below put there, and neither touches what this layer already wrote;
- device nodes are skipped (sandboxes get their own ``/dev``);
- the compressed bytes are hashed while read and checked against the descriptor's
  digest and size, the uncompressed stream against the config's ``rootfs.diff_ids``
  (``VerifiedStream``): a layer whose bytes are not the ones its image names is
  refused, and its half-applied rootfs is thrown away by the cache.
"""

import copy
import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, List, Optional, Set


# The most of one extended header (a pax record, a GNU long name) and how many of them
# one member may have: long names and xattrs fit many times over
HEADER_BYTES = 64 * 1024
HEADERS_PER_MEMBER = 8
_DIGEST = re.compile(r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageLimits:
    """What the cache reads of one image before it refuses it.

    layer_bytes: the uncompressed bytes of one layer (and the compressed ones).
    layer_members: the members (files, directories, links ...) of one layer.
    json_bytes: an ``index.json``, manifest, config, or ``docker save`` manifest.
    archive_members: the members of a ``docker save`` archive itself (its layers are
        counted apart, as layers).
    """

    layer_bytes: int = 64 * 2 ** 30
    layer_members: int = 2_000_000
    json_bytes: int = 8 * 2 ** 20
    archive_members: int = 100_000


class LayerRefused(Exception):
    """Why a layer (or a blob) is refused; the cache names the image and layer."""


def check_digest(digest: object, what: str) -> str:
    """``digest`` if it is a sha256 or sha512 digest in its canonical form."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise LayerRefused("%s: %r is not a sha256 or sha512 digest" % (what, digest))
    return digest


class VerifiedStream(io.RawIOBase):
    """``source`` read through a hash: at most ``cap`` bytes (and at most ``size``,
    when known); ``verify()`` reads what is left (within the same bounds) and checks
    the size and the digest. ``digest`` None checks only the bounds. What is read is
    copied to ``copy_to`` when given."""

    def __init__(self, source: BinaryIO, digest: Optional[str], size: Optional[int],
                 cap: int, what: str, copy_to: Optional[BinaryIO] = None):
        super().__init__()
        self.source, self.digest, self.size, self.cap, self.what = \
            source, digest, size, cap, what
        self.copy_to = copy_to
        if digest is not None:
            check_digest(digest, what)
        algorithm = digest.split(":", 1)[0] if digest else "sha256"
        self.hash = hashlib.new(algorithm)
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer)
        data = self.source.read(min(len(view), _CHUNK))
        n = len(data)
        if n:
            self.count += n
            if self.count > self.cap:
                raise LayerRefused("%s is larger than %d bytes" % (self.what, self.cap))
            if self.size is not None and self.count > self.size:
                raise LayerRefused("%s is larger than the %d bytes its descriptor says"
                                   % (self.what, self.size))
            self.hash.update(data)
            if self.copy_to is not None:
                self.copy_to.write(data)
            view[:n] = data
        return n

    def verify(self) -> None:
        while self.read(_CHUNK):
            pass
        if self.size is not None and self.count != self.size:
            raise LayerRefused("%s holds %d bytes, its descriptor says %d"
                               % (self.what, self.count, self.size))
        if self.digest is not None:
            got = "%s:%s" % (self.digest.split(":", 1)[0], self.hash.hexdigest())
            if got != self.digest:
                raise LayerRefused("%s has digest %s, not the %s it is named by"
                                   % (self.what, got, self.digest))


def apply_blob(raw: BinaryIO, dest: Path, digest: Optional[str], size: Optional[int],
               diff_id: str, limits: "ImageLimits", what: str) -> None:
    """Apply a layer blob (gzip or plain tar) read from ``raw`` onto ``dest``, checking
    its bytes against ``digest``/``size`` and its uncompressed stream against
    ``diff_id``. LayerRefused says why it is not applied in full."""
    packed, buffered, plain = _layer_streams(raw, digest, size, diff_id, limits, what)
    apply_layer(io.BufferedReader(plain, _CHUNK), dest, limits, what)
    _finish(packed, buffered, plain)


def check_blob(raw: BinaryIO, digest: Optional[str], size: Optional[int],
               diff_id: Optional[str], limits: "ImageLimits", what: str,
               copy_to: Optional[BinaryIO] = None) -> None:
    """``apply_blob``'s checks without applying: the blob's digest and size and, when
    ``diff_id`` is given, its uncompressed stream's; its bytes copied to ``copy_to``."""
    if diff_id is None:
        packed = VerifiedStream(raw, digest, size, limits.layer_bytes, what, copy_to)
        packed.verify()
        return
    _finish(*_layer_streams(raw, digest, size, diff_id, limits, what, copy_to))


def _layer_streams(raw, digest, size, diff_id, limits, what, copy_to=None):
    """The blob as read (hashed), buffered, and uncompressed (hashed)."""
    check_digest(diff_id, what + " diff_id")
    packed = VerifiedStream(raw, digest, size, limits.layer_bytes, what, copy_to)
    buffered = io.BufferedReader(packed, _CHUNK)
    head = buffered.peek(4)[:4]
    if head == b"\x28\xb5\x2f\xfd":
        raise LayerRefused("%s is zstd-compressed, which this agent cannot check" % what)
    stream = gzip.GzipFile(fileobj=buffered, mode="rb") if head[:2] == b"\x1f\x8b" else buffered
    plain = VerifiedStream(stream, diff_id, None, limits.layer_bytes, what + " (uncompressed)")
    return packed, buffered, plain


def _finish(packed, buffered, plain) -> None:
    plain.verify()
    while buffered.read(_CHUNK):  # what follows the gzip stream is part of the blob too
        pass
    packed.verify()


# --------------------------------------------------------------------------- the applier
def safe_join(root: Path, rel: str, follow_last: bool = False) -> Path:
    """``rel`` inside ``root``, resolving symlinks as if ``root`` were ``/``: an
    absolute or ``..``-climbing link can never lead out of the rootfs. The last
    component is followed only with ``follow_last``."""
    root = Path(root)
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    current: List[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = root.joinpath(*current, part)
        if os.path.islink(candidate) and (parts or follow_last):
            hops += 1
            if hops > 40:
                raise LayerRefused("too many symlinks resolving %r in the image" % rel)
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        current.append(part)
    return root.joinpath(*current)


def _remove(path: Path) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path)


class BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose extended headers are bounded and that is never sparse."""

    def _proc_member(self, tar):
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                         tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
            if self.size > HEADER_BYTES:
                raise LayerRefused("an extended header of %d bytes (the most: %d)"
                                   % (self.size, HEADER_BYTES))
            tar.sandman_headers = getattr(tar, "sandman_headers", 0) + 1
            if tar.sandman_headers > HEADERS_PER_MEMBER:
                raise LayerRefused("more than %d extended headers on one member"
                                   % HEADERS_PER_MEMBER)
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise LayerRefused("a sparse member (%r)" % self.name)
        return super()._proc_member(tar)

    def _proc_gnusparse_00(self, *args):
        raise LayerRefused("a sparse member (%r)" % self.name)

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


# keep ownership, modes and absolute links of the image: every path is checked here
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def apply_layer(fileobj: BinaryIO, dest: Path, limits: Optional[ImageLimits] = None,
                what: str = "layer") -> None:
    """Apply one image layer (an uncompressed tar stream) on top of ``dest`` in one
    pass (the module's docstring says what holds it). LayerRefused says why not."""
    limits = limits or ImageLimits()
    dest = Path(dest)
    written: Set[str] = set()  # what this layer put (and their parents): whiteouts spare it
    count = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r|", tarinfo=BoundedTarInfo) as tar:
            while True:
                tar.sandman_headers = 0
                member = tar.next()
                if member is None:
                    break
                tar.members.clear()  # stream mode keeps every member's header otherwise
                count += 1
                if count > limits.layer_members:
                    raise LayerRefused("%s has more than %d members"
                                       % (what, limits.layer_members))
                if sum(len(k) + len(v) for k, v in tar.pax_headers.items()) > HEADER_BYTES:
                    raise LayerRefused("%s: its global headers pass %d bytes"
                                       % (what, HEADER_BYTES))
                _apply_member(tar, member, dest, written)
    except LayerRefused:
        raise
    except (tarfile.TarError, OSError, ValueError, EOFError, zlib.error, RecursionError,
            UnicodeError) as exc:
        raise LayerRefused("%s: %s: %s" % (what, type(exc).__name__, exc)) from exc


def _mark(written: Set[str], rel: str) -> None:
    while rel and rel not in written:
        written.add(rel)
        rel = rel.rpartition("/")[0]


def _apply_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path,
                  written: Set[str]) -> None:
    head, _, base = member.name.rstrip("/").rpartition("/")
    if base == ".wh..wh..opq":
        directory = safe_join(dest, head, follow_last=True)
        if os.path.isdir(directory) and not os.path.islink(directory):
            for child in os.listdir(directory):
                if str((directory / child).relative_to(dest)) not in written:
                    _remove(directory / child)
        return
    if base.startswith(".wh."):
        target = safe_join(dest, head + "/" + base[4:])
        if target != dest and str(target.relative_to(dest)) not in written:
            _remove(target)
        return
    if member.isdev():
        return  # sandboxes get their own /dev
    target = safe_join(dest, member.name)
    if target == dest:
        return
    if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)
                                        and not os.path.islink(target)):
        _remove(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    rel = str(target.relative_to(dest))
    _mark(written, rel)
    if member.islnk():
        source = safe_join(dest, member.linkname)
        if not os.path.lexists(source) or os.path.isdir(source) and not os.path.islink(source):
            raise LayerRefused("hard link %r names %r, which is no file of the image"
                               % (member.name, member.linkname))
        os.link(source, target, follow_symlinks=False)  # a link to a link, never its target
        return
    # extract under the resolved name: no symlink left in its parents
    member = copy.copy(member)
    member.name = rel
    tar.extract(member, dest, set_attrs=True, numeric_owner=True, **_TRUSTED)
