"""Image root filesystems for sandboxes, unpacked once per node and shared read-only.

Image strings:
    host                        a read-only view of this machine
    dir:/path                   a rootfs directory, used in place
    oci:/layout[:tag]           an OCI image layout (tag default: the only one, or latest)
    docker-archive:/image.tar   ``docker save`` / ``podman save`` output
    REGISTRY/NAME[:TAG|@DIGEST] pulled with skopeo (e.g. docker.io/library/python:3.12)

Unpacked images live in ``<cache>/<digest>/rootfs`` keyed by the manifest (or config)
digest, built once even when many sandboxes ask at the same moment (a file lock per
digest, then an atomic rename). umoci unpacks OCI layouts and skopeo converts archives
and pulls when they are installed; otherwise a built-in layer applier does it, with
whiteouts and every path resolved inside the rootfs. ``PreparedImage.unpacked_by``
says which path was taken.
"""

import copy
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from sandman_ray.image_builders import MOUNT_POINTS, build_builtin, builtin_key
from sandman_ray.providers.base import fatal, transient
from sandman_ray.spec import parse_image as parse

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a sandbox honours: ``env`` ("K=V" strings),
    ``workdir`` and ``user``."""

    env: Tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""

    @classmethod
    def from_oci(cls, config: dict) -> "ImageConfig":
        c = config.get("config") or config.get("Config") or {}
        return cls(tuple(c.get("Env") or ()), c.get("WorkingDir") or "", c.get("User") or "")

    def env_dict(self) -> Dict[str, str]:
        return dict(item.split("=", 1) for item in self.env if "=" in item)


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for sandboxes. ``rootfs`` is None for ``host``; ``digest`` names
    the content; ``unpacked_by`` is ``umoci``, ``skopeo+umoci``, ``sandman`` (the
    built-in applier), ``in place`` or ``snapshot``. ``layers``: read-only layers that
    stack over ``rootfs``, the upper-most first (a snapshot's, providers/local/
    snapshots.py); a sandbox's overlay has them all below its writable layer."""

    image: str
    rootfs: Optional[Path]
    config: ImageConfig = field(default_factory=ImageConfig)
    digest: str = ""
    unpacked_by: str = "in place"
    layers: Tuple[Path, ...] = ()


class ImageCache:
    """Unpacked images under ``root``; one per digest, shared by every sandbox."""

    def __init__(self, root: Path, prefer_tools: bool = True,
                 snapshots_root: Optional[Path] = None):
        self.root = Path(root)
        self.prefer_tools = prefer_tools
        self.root.mkdir(parents=True, exist_ok=True)
        # the pools' snapshots on this node (providers/local/snapshots.py)
        self.snapshots_root = Path(snapshots_root) if snapshots_root else \
            self.root.parent / "snapshots"

    def prepare(self, image: str) -> PreparedImage:
        """Make ``image`` ready (blocking: call it off the event loop)."""
        kind, location, tag = parse(image)
        if kind == "host":
            return PreparedImage(image, None, ImageConfig(), "host", "in place")
        if kind == "builtin":
            return self._builtin(image, location)
        if kind == "dir":
            if not os.path.isdir(location):
                raise fatal("image %r: no such directory" % image)
            return PreparedImage(image, Path(location), ImageConfig(), "dir:" + location)
        if kind == "snapshot":
            return self._snapshot(image, location)
        if kind == "registry":
            location, tag = self._pull(location)
            kind = "oci"
        if kind == "oci":
            return self._oci(image, Path(location), tag)
        return self._docker_archive(image, Path(location))

    # ---- snapshots: a layer of this node's disk over the image it was taken on
    def _snapshot(self, image: str, location: str) -> PreparedImage:
        """A snapshot's layer over its base, itself prepared (a snapshot's base existed
        before it, so the chain ends)."""
        from sandman_ray.providers.local.snapshots import SnapshotStore
        pool, name = location.split("/", 1)
        store = SnapshotStore(self.snapshots_root, pool)
        meta = store.meta(name)
        base = self.prepare(meta["base"])
        if base.rootfs is None:
            raise fatal("image %r: its base %r has no rootfs" % (image, meta["base"]))
        config = meta.get("config") or {}
        return PreparedImage(image, base.rootfs,
                             ImageConfig(tuple(config.get("env") or ()),
                                         config.get("workdir") or "", config.get("user") or ""),
                             image, "snapshot", (store.path(name) / "layer",) + base.layers)

    # ---- OCI layouts
    def _oci(self, image: str, layout: Path, tag: str) -> PreparedImage:
        manifest_digest, manifest = _oci_manifest(layout, tag, image)
        config = json.loads(_blob(layout, manifest["config"]["digest"]))

        def unpack(dest: Path) -> str:
            if self.prefer_tools and shutil.which("umoci"):
                ref = "%s:%s" % (layout, tag or _oci_tag(layout, manifest_digest))
                _run(["umoci", "raw", "unpack", "--image", ref, str(dest)], image)
                return "umoci"
            dest.mkdir()
            for layer in manifest["layers"]:
                with _open_layer(layout / "blobs" / _digest_path(layer["digest"])) as fh:
                    apply_layer(fh, dest)
            return "sandman"
        return self._cached(image, manifest_digest, ImageConfig.from_oci(config), unpack)

    # ---- docker save archives
    def _docker_archive(self, image: str, archive: Path) -> PreparedImage:
        if not archive.is_file():
            raise fatal("image %r: no such file" % image)
        with tarfile.open(archive) as tar:
            try:
                manifest = json.load(tar.extractfile("manifest.json"))[0]
                config_raw = tar.extractfile(manifest["Config"]).read()
            except (KeyError, IndexError, ValueError, AttributeError) as exc:
                raise fatal("image %r is not a docker save archive: %s" % (image, exc)) from exc
        digest = "sha256:" + hashlib.sha256(config_raw).hexdigest()
        config = ImageConfig.from_oci(json.loads(config_raw))

        def unpack(dest: Path) -> str:
            if self.prefer_tools and shutil.which("skopeo") and shutil.which("umoci"):
                layout = dest.parent / (dest.name + ".oci")
                _run(["skopeo", "copy", "--quiet", "docker-archive:%s" % archive,
                      "oci:%s:image" % layout], image)
                try:
                    _run(["umoci", "raw", "unpack", "--image", "%s:image" % layout, str(dest)],
                         image)
                finally:
                    shutil.rmtree(layout, ignore_errors=True)
                return "skopeo+umoci"
            dest.mkdir()
            with tarfile.open(archive) as tar:
                for name in manifest["Layers"]:
                    with _open_layer(tar.extractfile(name)) as fh:
                        apply_layer(fh, dest)
            return "sandman"
        return self._cached(image, digest, config, unpack)

    # ---- registries
    def _pull(self, reference: str) -> Tuple[str, str]:
        if not shutil.which("skopeo"):
            raise fatal("image %r: pulling from a registry needs skopeo and umoci "
                        "(apt-get install skopeo umoci)" % reference)
        name = hashlib.sha256(reference.encode()).hexdigest()[:24]
        layout = self.root / "layouts" / name
        layout.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / ("pull-%s.lock" % name)):
            _run(["skopeo", "copy", "--quiet", "docker://" + reference,
                  "oci:%s:image" % layout], reference)
        return str(layout), "image"

    # ---- built-in images
    def _builtin(self, image: str, name: str) -> PreparedImage:
        entry = self.root / builtin_key(name)
        rootfs = entry / "rootfs"
        if not (entry / "meta.json").exists():
            with _locked(self.root / ("%s.lock" % entry.name)):
                if not (entry / "meta.json").exists():  # built meanwhile by another process
                    try:
                        build_builtin(name, rootfs)
                    except (OSError, subprocess.CalledProcessError) as exc:
                        why = (exc.stderr or b"").decode(errors="replace")[-400:] if \
                            isinstance(exc, subprocess.CalledProcessError) else str(exc)
                        raise fatal("image %s could not be built (debootstrap needs Debian's "
                                    "package mirror): %s" % (image, why)) from exc
                    (entry / "meta.json").write_text(json.dumps(
                        {"image": image, "unpacked_by": "debootstrap"}))
        return PreparedImage(image, rootfs, ImageConfig(workdir="/root"), image, "debootstrap")

    # ---- the cache itself
    def _cached(self, image: str, digest: str, config: ImageConfig, unpack) -> PreparedImage:
        key = digest.replace(":", "-")
        entry = self.root / key
        meta_path = entry / "meta.json"
        if not meta_path.exists():
            with _locked(self.root / (key + ".lock")):
                if not meta_path.exists():  # another process may have built it meanwhile
                    self._build(image, entry, unpack)
        meta = json.loads(meta_path.read_text())
        return PreparedImage(image, entry / "rootfs", config, digest, meta["unpacked_by"])

    def _build(self, image: str, entry: Path, unpack) -> None:
        work = entry.with_name(entry.name + ".building")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(entry, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            how = unpack(work / "rootfs")
            for point in MOUNT_POINTS:
                target = safe_join(work / "rootfs", point)
                if not os.path.lexists(target):
                    os.makedirs(target, exist_ok=True)
            (work / "meta.json").write_text(json.dumps({"image": image, "unpacked_by": how}))
            work.rename(entry)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        logger.info("image %s unpacked by %s into %s", image, how, entry)


# --------------------------------------------------------------------------- layers
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
                raise fatal("too many symlinks resolving %r in the image" % rel)
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


def apply_layer(fileobj, dest: Path) -> None:
    """Apply one image layer (an uncompressed tar stream) on top of ``dest``: whiteouts
    (``.wh.NAME``) delete from the layers below, opaque markers (``.wh..wh..opq``) empty
    a directory of what the layers below put there, every path stays in ``dest``."""
    data = fileobj.read()  # two passes: whiteouts first, then the layer's own entries
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        for member in members:
            head, _, base = member.name.rstrip("/").rpartition("/")
            if base == ".wh..wh..opq":
                directory = safe_join(dest, head, follow_last=True)
                if os.path.isdir(directory):
                    for child in os.listdir(directory):
                        _remove(directory / child)
            elif base.startswith(".wh."):
                _remove(safe_join(dest, head + "/" + base[4:]))
        for member in members:
            base = member.name.rstrip("/").rpartition("/")[2]
            if base.startswith(".wh.") or member.isdev():
                continue  # sandboxes get their own /dev
            target = safe_join(dest, member.name)
            if target == Path(dest):
                continue
            if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)
                                                and not os.path.islink(target)):
                _remove(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            if member.islnk():
                os.link(safe_join(dest, member.linkname), target)
                continue
            # extract under the resolved name: no symlink left in its parents
            member = copy.copy(member)
            member.name = str(target.relative_to(dest))
            tar.extract(member, dest, set_attrs=True, numeric_owner=True, **_TRUSTED)


# paths are checked above; keep ownership, modes and absolute links of the image
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


class _open_layer:
    """A layer blob as an uncompressed stream (gzip detected by its magic bytes)."""

    def __init__(self, source):
        self.fh = open(source, "rb") if isinstance(source, (str, Path)) else source

    def __enter__(self):
        head = self.fh.read(2)
        self.fh.seek(0)
        return gzip.GzipFile(fileobj=self.fh) if head == b"\x1f\x8b" else self.fh

    def __exit__(self, *exc):
        self.fh.close()


# --------------------------------------------------------------------------- OCI helpers
def _digest_path(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    if not value or "/" in value or "/" in algorithm:
        raise fatal("bad digest %r" % digest)
    return "%s/%s" % (algorithm, value)


def _blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / _digest_path(digest)).read_bytes()


def _oci_manifest(layout: Path, tag: str, image: str) -> Tuple[str, dict]:
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, ValueError) as exc:
        raise fatal("image %r: not an OCI layout (%s)" % (image, exc)) from exc
    manifests = index.get("manifests") or []
    if tag:
        manifests = [m for m in manifests
                     if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag]
    elif len(manifests) > 1:
        manifests = [m for m in manifests if (m.get("annotations") or {}).get(
            "org.opencontainers.image.ref.name") == "latest"] or manifests[:0]
    if len(manifests) != 1:
        raise fatal("image %r: %s" % (image, "no manifest tagged %r" % tag if tag else
                                      "the layout holds several images; name a tag"))
    digest = manifests[0]["digest"]
    manifest = json.loads(_blob(layout, digest))
    if "manifests" in manifest:  # an index: take the linux/amd64 image
        chosen = [m for m in manifest["manifests"]
                  if (m.get("platform") or {}).get("architecture") in ("amd64", None)]
        if not chosen:
            raise fatal("image %r has no linux/amd64 image" % image)
        digest = chosen[0]["digest"]
        manifest = json.loads(_blob(layout, digest))
    return digest, manifest


def _oci_tag(layout: Path, digest: str) -> str:
    for m in json.loads((layout / "index.json").read_text()).get("manifests", []):
        if m.get("digest") == digest:
            return (m.get("annotations") or {}).get("org.opencontainers.image.ref.name", "latest")
    return "latest"


def _run(argv: List[str], image: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return
    err = (proc.stderr or proc.stdout).strip()
    low = err.lower()
    if any(s in low for s in ("no such host", "dial tcp", "connection refused", "i/o timeout",
                              "network is unreachable", "temporary failure in name resolution",
                              "tls handshake timeout")):
        raise transient("image %r: the registry is unreachable: %s" % (image, err[-400:]))
    if any(s in low for s in ("unauthorized", "authentication required", "denied")):
        raise fatal("image %r: the registry refused access (credentials?): %s" % (image, err[-400:]))
    if any(s in low for s in ("manifest unknown", "not found", "name unknown")):
        raise fatal("image %r: no such image in the registry: %s" % (image, err[-400:]))
    raise fatal("image %r: %s failed: %s" % (image, argv[0], err[-400:]))


class _locked:
    """An exclusive file lock (across processes and threads of this node)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def main(argv=None) -> int:
    """``python -m sandman_ray.images CACHE_ROOT``: build the built-in images
    into a LocalProvider cache root ahead of their first use (``make`` does)."""
    import argparse
    from sandman_ray.spec import BUILTIN_IMAGES
    parser = argparse.ArgumentParser(prog="python -m sandman_ray.images")
    parser.add_argument("cache_root", type=Path, help="a LocalProvider's cache_root")
    args = parser.parse_args(argv)
    cache = ImageCache(args.cache_root / "images")
    for name in BUILTIN_IMAGES:
        print("builtin:%s in %s" % (name, cache.prepare("builtin:" + name).rootfs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
