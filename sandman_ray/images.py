"""Image root filesystems for sandboxes, unpacked once per node and shared read-only.

Image strings:
    host                        a read-only view of this machine
    dir:/path                   a rootfs directory, used in place: only below a directory
                                the provider trusts (``ImageCache.image_roots``)
    oci:/layout[:tag]           an OCI image layout (tag default: the only one, or latest)
    docker-archive:/image.tar   ``docker save`` / ``podman save`` output
    REGISTRY/NAME[:TAG|@DIGEST] pulled with skopeo (e.g. docker.io/library/python:3.12)

Unpacked images live in ``<cache>/<digest>/rootfs`` keyed by the digest of the
manifest (or, for an archive, the config) as read and checked (``image_layouts``: a
layout or archive whose bytes are not the ones its digests name is refused), built
once even when many sandboxes ask at the same moment (a file lock per digest, then an
atomic rename). umoci unpacks a private layout of the checked blobs when it is
installed, skopeo pulls; otherwise the built-in layer applier (``image_layers``) does
it, with whiteouts and every path resolved inside the rootfs. ``PreparedImage.
unpacked_by`` says which path was taken. The image's config is checked when it is
prepared, and its user resolved then, through reads that never leave the image
(``image_files``); the result is kept in the entry's ``meta.json``.
"""

import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from sandman_ray.image_budget import ImageBudget, tree_bytes
from sandman_ray.image_builders import MOUNT_POINTS, build_builtin, builtin_key
from sandman_ray.image_files import resolve_user
from sandman_ray.image_layers import ImageLimits, safe_join
from sandman_ray.image_layouts import Verified, read_docker_archive, read_oci
from sandman_ray.errors import fatal, transient
from sandman_ray.spec import parse_image as parse

logger = logging.getLogger(__name__)
# What an entry's meta.json says once it was built from checked bytes (image_layouts)
CHECKED = 1



@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a sandbox honours: ``env`` ("K=V" strings),
    ``workdir`` and ``user`` (as the image names it; ``PreparedImage.run_as`` is its
    resolved ids)."""

    env: Tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""

    @classmethod
    def from_oci(cls, config: dict, image: str = "") -> "ImageConfig":
        """The config's ``config`` part, checked: ``Env`` a list of ``K=V`` strings
        (a name before the ``=``), ``User`` and ``WorkingDir`` strings, none with a
        NUL; anything else is a fatal error naming the field."""
        c = config.get("config") or config.get("Config") or {}
        if not isinstance(c, dict):
            raise fatal("image %r: its config's config is not an object: refused" % image)
        env = c.get("Env") or []
        if not isinstance(env, list):
            raise fatal("image %r: its config's Env is not a list: refused" % image)
        for index, item in enumerate(env):
            if not isinstance(item, str) or "\0" in item or not item.partition("=")[0] \
                    or "=" not in item:
                raise fatal("image %r: its config's Env[%d] (%r) is not a NAME=value string "
                            "without NUL: refused" % (image, index, item))
        for key in ("User", "WorkingDir"):
            value = c.get(key) or ""
            if not isinstance(value, str) or "\0" in value:
                raise fatal("image %r: its config's %s (%r) is not a string without NUL: "
                            "refused" % (image, key, value))
        return cls(tuple(env), c.get("WorkingDir") or "", c.get("User") or "")

    def env_dict(self) -> Dict[str, str]:
        return dict(item.split("=", 1) for item in self.env if "=" in item)


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for sandboxes. ``rootfs`` is None for ``host``; ``digest`` names
    the content; ``unpacked_by`` is ``umoci``, ``sandman`` (the
    built-in applier), ``in place`` or ``snapshot``. ``layers``: read-only layers that
    stack over ``rootfs``, the upper-most first (a snapshot's, providers/local/
    snapshots.py); a sandbox's overlay has them all below its writable layer."""

    image: str
    rootfs: Optional[Path]
    config: ImageConfig = field(default_factory=ImageConfig)
    digest: str = ""
    unpacked_by: str = "in place"
    layers: Tuple[Path, ...] = ()
    # config.user as ``uid:gid``, resolved when the image was prepared ("": root)
    run_as: str = ""
    # what keeps its cache entry from eviction while a sandbox uses it (image_budget)
    hold: object = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        """The sandbox that used it is gone: its cache entry may be evicted."""
        if self.hold is not None:
            self.hold.close()


# Never trusted as a root of ``dir:`` images (``check_image_root``): the host's root and
# these directories, nor any directory that holds one of them: each holds the host's
# secrets, its kernel's interfaces or the programs its root runs, and a sandbox over it
# (idmapped: its root files become the sandbox root's) would own them.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64",
               "/libx32", "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv",
               "/sys", "/tmp", "/usr", "/var", "/var/tmp")
# ... nor anything below these: kernel interfaces, secrets, runtime state (no image
# lives there, and what does can change under a sandbox: /dev/shm is everyone's)
NEVER_BELOW = ("/boot", "/dev", "/etc", "/proc", "/root", "/run", "/sys", "/var/run")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_image_root(root: str, reserved: Iterable[str] = ()) -> str:
    """``root`` (resolved) if it may be trusted for ``dir:`` images; ValueError naming
    the rule otherwise. ``reserved``: the provider's state, cache and snapshot roots,
    which hold other sandboxes' layers and the cache's entries (refused too, and
    anything inside or around them)."""
    if not isinstance(root, str) or not root.startswith("/"):
        raise ValueError("image_roots: %r is not an absolute path" % (root,))
    try:
        real = os.path.realpath(root)
    except OSError as exc:
        raise ValueError("image_roots: %s cannot be resolved (%s): refused"
                         % (root, exc.strerror)) from exc
    for path in (os.path.abspath(root), real):  # as named, and where its links lead
        for system in ("/",) + SYSTEM_DIRS:
            if _inside(system, path):
                raise ValueError("image_roots: %s (%s) is or holds the host's %s: refused"
                                 % (root, path, system))
        for system in NEVER_BELOW:
            if _inside(path, system):
                raise ValueError("image_roots: %s (%s) is below the host's %s: refused"
                                 % (root, path, system))
    for other in reserved:
        other = os.path.realpath(str(other))
        if _inside(real, other) or _inside(other, real):
            raise ValueError("image_roots: %s (%s) is or holds the provider's own %s (its "
                             "state, cache or snapshots): refused" % (root, real, other))
    return real


def _changeable_by_others(root: str) -> Optional[str]:
    """Why ``root`` (resolved) could be changed by a user other than root and the
    agent's, so that an image below it could become any host path; None if it cannot."""
    try:
        st = os.stat(root)
    except OSError as exc:
        return "%s: %s" % (root, exc.strerror)
    if not stat.S_ISDIR(st.st_mode):
        return "%s is not a directory" % root
    for path in [root] + [str(p) for p in Path(root).parents]:
        st = os.stat(path)
        if st.st_uid not in (0, os.geteuid()) or (
                st.st_mode & 0o022 and not (path != root and st.st_mode & stat.S_ISVTX)):
            return "%s may be changed by another user (uid %d, mode %o)" \
                % (path, st.st_uid, stat.S_IMODE(st.st_mode))
    return None


class ImageCache:
    """Unpacked images under ``root``; one per digest, shared by every sandbox.

    image_roots: the directories whose subdirectories may be ``dir:`` images (used in
        place, their root-owned files becoming the sandbox root's). A ``dir:`` image
        below none of them is refused (a fatal ProviderError naming the image and
        ``image_roots``) rather than shown like ``host`` (owners unmapped, only what
        any user may read): a path into the host has no business being an image,
        and a refusal cannot be got subtly wrong. Checked by ``check_image_root``.
    reserved: directories never trusted for ``dir:`` images (the agent's state, cache
        and snapshot roots); the cache's own root and snapshots always are.
    limits: what is read of one image before it is refused (``ImageLimits``).
    """

    def __init__(self, root: Path, prefer_tools: bool = True,
                 snapshots_root: Optional[Path] = None, image_roots: Iterable[str] = (),
                 reserved: Iterable[Path] = (), limits: Optional[ImageLimits] = None,
                 snapshot_store=None, budget_bytes: Optional[int] = None):
        self.root = Path(root)
        # a pool's snapshots on this node: SnapshotStore(snapshots_root, pool), given by
        # the provider that keeps them (providers/local/snapshots.py); none refuses them
        self.snapshot_store = snapshot_store
        self.prefer_tools = prefer_tools
        self.limits = limits or ImageLimits()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # setuid files of images live here: no other user's
        # the pools' snapshots on this node (providers/local/snapshots.py)
        self.snapshots_root = Path(snapshots_root) if snapshots_root else \
            self.root.parent / "snapshots"
        self.budget = ImageBudget(self.root, budget_bytes, self.snapshots_root)
        reserved = [str(p) for p in reserved] + [str(self.root), str(self.snapshots_root)]
        self.image_roots = tuple(check_image_root(r, reserved) for r in image_roots)

    def prepare(self, image: str) -> PreparedImage:
        """Make ``image`` ready (blocking: call it off the event loop)."""
        kind, location, tag = parse(image)
        if kind == "host":
            return PreparedImage(image, None, ImageConfig(), "host", "in place")
        if kind == "builtin":
            return self._builtin(image, location)
        if kind == "dir":
            return self._dir(image, location)
        if kind == "snapshot":
            return self._snapshot(image, location)
        if kind == "registry":
            location, tag = self._pull(location)
            kind = "oci"
        if kind == "oci":
            verified = read_oci(Path(location), tag, image, self.limits)
        else:
            verified = read_docker_archive(Path(location), image, self.limits)
        try:
            config = ImageConfig.from_oci(verified.config, image)
            return self._cached(image, verified.digest, config,
                                lambda dest: self._unpack(verified, dest))
        finally:
            verified.close()

    # ---- dir: a rootfs of a trusted directory, in place
    def _dir(self, image: str, location: str) -> PreparedImage:
        """A trusted root's directory, resolved (links included) before it is checked,
        and refused before its existence is (no host path is probed for a tenant)."""
        path = os.path.realpath(location)
        roots = [r for r in self.image_roots if _inside(path, r)]
        if not roots:
            raise fatal("image %r: %s is below none of the directories this provider "
                        "trusts for dir: images (image_roots=%r): refused"
                        % (image, path, list(self.image_roots)))
        why = _changeable_by_others(roots[0])
        if why is not None:
            raise fatal("image %r: its image root %s is not to be trusted now: %s: refused"
                        % (image, roots[0], why))
        if not os.path.isdir(path):
            raise fatal("image %r: no such directory" % image)
        return PreparedImage(image, Path(path), ImageConfig(), "dir:" + path)

    # ---- snapshots: a layer of this node's disk over the image it was taken on
    def _snapshot(self, image: str, location: str) -> PreparedImage:
        """A snapshot's layer over its base, itself prepared (a snapshot's base existed
        before it, so the chain ends)."""
        if self.snapshot_store is None:
            raise fatal("image %r: this image cache keeps no snapshots" % image)
        pool, name = location.split("/", 1)
        store = self.snapshot_store(self.snapshots_root, pool)
        meta = store.meta(name)
        base = self.prepare(meta["base"])
        if base.rootfs is None:
            raise fatal("image %r: its base %r has no rootfs" % (image, meta["base"]))
        config = meta.get("config") or {}
        user = config.get("user") or ""
        run_as = base.run_as if user == base.config.user else \
            resolve_user(base.rootfs, user, image)
        return PreparedImage(image, base.rootfs,
                             ImageConfig(tuple(config.get("env") or ()),
                                         config.get("workdir") or "", user),
                             image, "snapshot", (store.path(name) / "layer",) + base.layers,
                             run_as, base.hold)

    # ---- OCI layouts and docker save archives, checked (image_layouts)
    def _unpack(self, verified: Verified, dest: Path) -> str:
        if self.prefer_tools and shutil.which("umoci"):
            # the checked blobs, the cache's own copy: its hashing and copying cost a
            # 206 MB Debian minbase image 4.2 s here against umoci alone's 1.8 s (the
            # built-in applier: 3.9 s), once per image and node
            layout = dest.parent / "layout"
            try:
                verified.private_layout(layout)
                _run(["umoci", "raw", "unpack", "--image", "%s:image" % layout, str(dest)],
                     verified.image)
            finally:
                shutil.rmtree(layout, ignore_errors=True)
            _drop_devices(dest)  # as the built-in applier does: sandboxes have their own
            return "umoci"
        verified.unpack_builtin(dest)
        return "sandman"

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
        """The entry of ``digest`` (checked: image_layouts), built by ``unpack`` if it is
        not there yet, or was built before images were checked (no ``checked`` mark in
        its meta.json: its key may be one a hostile image claimed)."""
        key = digest.replace(":", "-")
        entry = self.root / key
        hold = self.budget.hold(key)  # held by the sandbox: not evicted under it
        built = False
        try:
            meta = self._meta(entry)
            if meta is None:
                with _locked(self.root / (key + ".lock")):
                    meta = self._meta(entry)
                    if meta is None:  # another process may have built it meanwhile
                        self._build(image, entry, config, unpack)
                        meta, built = self._meta(entry), True
            self.budget.used(key, hit=not built)
            if built:  # the others, least recently used first, make room for it
                self.budget.fit(keep=(key,))
        except BaseException:
            hold.close()
            raise
        return PreparedImage(image, entry / "rootfs", config, digest, meta["unpacked_by"],
                             run_as=meta["user"], hold=hold)

    @staticmethod
    def _meta(entry: Path) -> Optional[dict]:
        try:
            meta = json.loads((entry / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return meta if meta.get("checked") == CHECKED else None

    def _build(self, image: str, entry: Path, config: ImageConfig, unpack) -> None:
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
            # the image's user, resolved once, below the rootfs (never on a create)
            user = resolve_user(work / "rootfs", config.user, image)
            (work / "meta.json").write_text(json.dumps(
                {"image": image, "unpacked_by": how, "user": user, "checked": CHECKED,
                 "bytes": tree_bytes(work / "rootfs")}))
            work.rename(entry)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        logger.info("image %s unpacked by %s into %s", image, how, entry)


def _drop_devices(rootfs: Path) -> None:
    """Remove the device nodes umoci made (as root it makes an image's): the built-in
    applier skips them, and no sandbox needs one of its image's."""
    for top, dirs, files in os.walk(rootfs):  # never follows links
        for name in files + dirs:
            path = os.path.join(top, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                os.unlink(path)


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
