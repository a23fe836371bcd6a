"""Hostile images for the escape suite (``test_escape_images.py``): layers, OCI layouts
and ``docker save`` archives built in the test from tarfile, json and hashlib (no
network), a host directory for them to aim at, and what tells that the host did not
change."""

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from sandman_ray.errors import ProviderError
from sandman_ray.images import ImageCache

PREPARE_TIMEOUT_S = 60
SECRET = b"the host's secret\n"
PREPARE_TIMEOUT_S = 60


# --------------------------------------------------------------------------- building
def entry(name, kind="file", data=b"", link="", mode=0o644, uid=0, devmajor=0):
    """One layer member: ``kind`` file, dir, symlink, hardlink, fifo or chr."""
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid = mode, uid, uid
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                 "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                 "chr": tarfile.CHRTYPE}[kind]
    info.linkname = link
    info.devmajor, info.devminor = devmajor, 3 if kind == "chr" else 0
    info.size = len(data) if kind == "file" else 0
    return info, data


def layer(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


BASE = layer(entry("etc", "dir", mode=0o755), entry("bin", "dir", mode=0o755),
             entry("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
             entry("etc/group", data=b"root:x:0:\n"))


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def config_of(layers, config=None, **extra) -> bytes:
    return json.dumps(dict({"architecture": "amd64", "os": "linux", "config": config or {},
                            "rootfs": {"type": "layers",
                                       "diff_ids": [sha(raw) for raw in layers]}},
                           **extra)).encode()


def oci(where: Path, layers, config=None, *, tag="v1", config_raw=None, lie=None) -> str:
    """An OCI layout of ``layers`` (uncompressed tars, stored gzip); ``lie`` changes
    what the layout claims after it is built (a callable of the layout's paths)."""
    blobs = where / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        (blobs / sha(data)[7:]).write_bytes(data)
        return {"digest": sha(data), "size": len(data)}
    cfg = config_raw if config_raw is not None else config_of(layers, config)
    packed = [gzip.compress(raw, compresslevel=1) for raw in layers]
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(put(cfg), mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(put(p), mediaType="application/vnd.oci.image.layer.v1.tar+gzip")
                   for p in packed]}).encode()
    (where / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [dict(
        put(manifest), mediaType="application/vnd.oci.image.manifest.v1+json",
        annotations={"org.opencontainers.image.ref.name": tag})]}
    (where / "index.json").write_text(json.dumps(index))
    if lie:
        lie(where, blobs, manifest, cfg, packed)
    return "oci:%s:%s" % (where, tag)


def docker_archive(path: Path, layers, config=None, *, config_raw=None, members=()) -> str:
    """A ``docker save`` archive of ``layers``; ``members`` are added to it as they are."""
    cfg = config_raw if config_raw is not None else config_of(layers, config)
    names = ["%d/layer.tar" % i for i in range(len(layers))]
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("config.json", cfg)
        for name, raw in zip(names, layers):
            add(name, raw)
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
        if not any(info.name == "manifest.json" for info, _ in members):
            add("manifest.json", json.dumps([{"Config": "config.json", "Layers": names}]).encode())
    return "docker-archive:%s" % path


def image_of(kind: str, where: Path, layers, config=None) -> str:
    if kind == "oci":
        return oci(where / "layout", layers, config)
    return docker_archive(where / "image.tar", layers, config)


# --------------------------------------------------------------------------- the host
def make_host(tmp_path: Path) -> Path:
    """A host directory outside every cache: a 0700 directory holding a 0600 canary,
    a passwd naming ``t4user`` and a config whose Env is a secret."""
    secret = tmp_path / "host" / "secret"
    secret.mkdir(parents=True)
    secret.chmod(0o700)
    canary = secret / "canary"
    canary.write_bytes(SECRET)
    canary.chmod(0o600)
    (secret / "passwd").write_text("t4user:x:4242:4343::/:/bin/sh\n")
    (secret / "config.json").write_bytes(config_of([BASE], {"Env": ["STOLEN=yes"]}))
    return secret


def snapshot(root: Path, skip=("cache-",)) -> dict:
    """Every path under ``root`` (not following links) with its kind, size and content
    digest, but those under a cache (named ``cache-*``)."""
    seen = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(skip)]
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() \
                if stat.S_ISREG(st.st_mode) else ""
            seen[path] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_nlink, digest)
    return seen


class Unchanged:
    """The host below ``root`` is the same after the block as before it."""

    def __init__(self, root: Path):
        self.root = root

    def __enter__(self):
        self.before = snapshot(self.root)
        return self

    def __exit__(self, *exc):
        after = snapshot(self.root)
        assert after == self.before, "the host changed: %r" % sorted(
            set(after.items()) ^ set(self.before.items()))


def bounded(call, timeout=PREPARE_TIMEOUT_S):
    """``call()`` on a thread, its result or exception; a hang fails the test."""
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the test
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "still reading after %d s: a read without bound" % timeout
    if "error" in result:
        raise result["error"]
    return result["value"]


def prepare(path: str, tmp_path: Path, image: str, **kw):
    cache = ImageCache(tmp_path / ("cache-%s" % path), prefer_tools=(path == "tools"), **kw)
    return bounded(lambda: cache.prepare(image))


def refused(path, tmp_path, image, *words, **kw):
    with pytest.raises(ProviderError) as err:
        prepare(path, tmp_path, image, **kw)
    assert err.value.kind == "fatal", err.value
    for word in words:
        assert word in str(err.value), err.value
    return str(err.value)
