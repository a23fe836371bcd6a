"""Hostile images: an image is data, never a path into the host (SECURITY.md, "Images").

Each image here is built in the test (tarfile, json, hashlib; no network) as an OCI
layout or a ``docker save`` archive and prepared on both paths, umoci (``tools``) and
the built-in applier (``builtin``). Each attack is asserted refused (a fatal
ProviderError naming the problem) or harmless, with the host unchanged: a canary
directory outside the cache keeps its files, and nothing appears outside the cache.
Every prepare runs under a time bound, so that a FIFO or ``/dev/zero`` cannot hang the
suite."""

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from sandman_ray.errors import ProviderError
from sandman_ray.images import ImageCache, check_image_root
from sandman_ray.image_layers import ImageLimits
from sandman_ray import image_files

PATHS = ["tools", "builtin"]
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
@pytest.fixture
def host(tmp_path):
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


# --------------------------------------------------------------------------- dir: images
def test_dir_image_of_the_hosts_root_is_refused(tmp_path):
    cache = ImageCache(tmp_path / "cache")  # trusts no directory
    for image in ("dir:/", "dir:/etc", "dir:/root", "dir:%s" % tmp_path):
        with pytest.raises(ProviderError) as err:
            cache.prepare(image)
        assert err.value.kind == "fatal" and image in str(err.value) and \
            "image_roots" in str(err.value)


def test_dir_images_only_from_a_trusted_root_and_never_through_a_link_out(tmp_path, host):
    root = tmp_path / "images"
    (root / "busybox" / "bin").mkdir(parents=True)
    (root / "to-host").symlink_to(host)
    (root / "to-etc").symlink_to("/etc")
    cache = ImageCache(tmp_path / "cache", image_roots=[str(root)])
    prepared = cache.prepare("dir:%s/busybox" % root)
    assert prepared.rootfs == root / "busybox"
    for image in ("dir:/", "dir:%s/../host/secret" % root, "dir:%s/to-host" % root,
                  "dir:%s/to-etc" % root, "dir:%s/busybox/../.." % root):
        with pytest.raises(ProviderError, match="image_roots") as err:
            cache.prepare(image)
        assert err.value.kind == "fatal" and image in str(err.value)
    # a trusted root that another user may change is no longer trusted
    root.chmod(0o777)
    with pytest.raises(ProviderError, match="may be changed by another user"):
        cache.prepare("dir:%s/busybox" % root)


def test_image_roots_refuse_the_host_and_the_providers_own_directories(tmp_path):
    from sandman_ray.providers.local import LocalProvider
    for root in ("/", "/etc", "/usr", "/var", "/tmp", "/root/images", "/dev/shm/images",
                 "/proc/1/root", "/run/images", "relative"):
        with pytest.raises(ValueError, match="image_roots"):
            check_image_root(root)
        with pytest.raises(ValueError, match="image_roots"):
            LocalProvider(image_roots=[root])
    state, cache = tmp_path / "state", tmp_path / "cache"
    for root in (tmp_path, state, cache / "images"):
        with pytest.raises(ValueError, match="the provider's own"):
            LocalProvider(state_root=str(state), cache_root=str(cache), image_roots=[str(root)])
    assert LocalProvider(state_root=str(state), cache_root=str(cache),
                         image_roots=[str(tmp_path / "images")]).image_roots


# --------------------------------------------------------------------------- users
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["oci", "docker-archive"])
def test_image_user_is_never_looked_up_in_a_host_file(path, kind, tmp_path, host):
    """config.User t4user, etc/passwd an absolute link to a host passwd that names it:
    the link resolves inside the image, which has no such user."""
    hostile = layer(entry("etc", "dir", mode=0o755),
                    entry("etc/passwd", "symlink", link=str(host / "passwd")),
                    entry("etc/group", "symlink", link="../../../../../../" + str(host / "passwd")))
    image = image_of(kind, tmp_path, [hostile], {"User": "t4user"})
    with Unchanged(tmp_path):
        refused(path, tmp_path, image, "no passwd entry for 't4user'", image)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_image_user_lookup_refuses_what_is_not_a_regular_file(path, target, tmp_path):
    """etc/passwd a link to /dev/zero (inside the image: none), or a FIFO of the image:
    the create neither hangs nor reads without end."""
    passwd = entry("etc/passwd", "fifo") if target == "fifo" else \
        entry("etc/passwd", "symlink", link=target)
    hostile = layer(entry("etc", "dir", mode=0o755), entry("dev", "dir", mode=0o755),
                    entry("dev/zero", "fifo"), passwd)
    image = oci(tmp_path / "layout", [hostile], {"User": "t4user"})
    message = refused(path, tmp_path, image, "passwd")
    if path == "tools":  # umoci makes the image's FIFOs (the built-in applier skips them)
        assert "etc/passwd is not a regular file (a FIFO)" in message


def test_a_spec_users_names_are_read_below_the_rootfs(tmp_path, host, monkeypatch):
    """spec.user for a dir: image goes through the same reads (and the walk that a
    kernel without openat2 gets refuses the link outright)."""
    from sandman_ray.image_files import resolve_user
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "passwd").symlink_to(host / "passwd")
    (rootfs / "etc" / "group").write_text("staff:x:50:\n")
    with pytest.raises(ProviderError, match="no passwd entry for 't4user'"):
        resolve_user(rootfs, "t4user", "dir:%s" % rootfs)
    assert resolve_user(rootfs, "7:staff", "dir:x") == "7:50"
    assert resolve_user(rootfs, "0", "dir:x") == ""
    monkeypatch.setattr(image_files, "use_openat2", False)
    with pytest.raises(ProviderError, match="etc/passwd"):
        resolve_user(rootfs, "t4user", "dir:%s" % rootfs)
    assert resolve_user(rootfs, "7:staff", "dir:x") == "7:50"


@pytest.mark.parametrize("path", PATHS)
def test_the_images_user_is_resolved_once_when_prepared(path, tmp_path):
    base = layer(entry("etc", "dir", mode=0o755),
                 entry("etc/passwd", data=b"app:x:1234:2345::/:/bin/sh\n"),
                 entry("etc/group", data=b""))
    image = oci(tmp_path / "layout", [base], {"User": "app"})
    prepared = prepare(path, tmp_path, image)
    assert prepared.run_as == "1234:2345"
    meta = json.loads((prepared.rootfs.parent / "meta.json").read_text())
    assert meta["user"] == "1234:2345"


# --------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blob", ["config", "layer"])
def test_a_blob_that_links_out_of_the_layout_is_not_read(path, blob, tmp_path, host):
    """The config (or a layer) blob is a link to a host file whose digest is the one
    the manifest names: only the refusal to follow it keeps the host file out."""
    target = host / "config.json" if blob == "config" else host / "layer.tar.gz"
    if blob == "layer":
        target.write_bytes(gzip.compress(BASE))

    def link(where, blobs, manifest, cfg, packed):
        name = sha(cfg if blob == "config" else packed[0])[7:]
        (blobs / name).unlink()
        (blobs / name).symlink_to(target)
    raw = target.read_bytes() if blob == "config" else None
    layers = [BASE] if blob == "config" else [gzip.decompress(target.read_bytes())]
    image = oci(tmp_path / "layout", layers, config_raw=raw, lie=link)
    with Unchanged(tmp_path):
        refused(path, tmp_path, image, "blobs/sha256/")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what", ["fifo", "dev-zero", "directory"])
def test_layout_files_that_are_not_regular_files_are_refused(path, what, tmp_path):
    layout = tmp_path / "layout"
    image = oci(layout, [BASE])
    index = layout / "index.json"
    index.unlink()
    if what == "fifo":
        os.mkfifo(index)
    elif what == "dev-zero":
        index.symlink_to("/dev/zero")  # inside the layout: no such file
    else:
        index.mkdir()
    refused(path, tmp_path, image, "index.json", "not an OCI layout")


@pytest.mark.parametrize("path", PATHS)
def test_a_huge_index_is_read_no_further_than_its_cap(path, tmp_path):
    layout = tmp_path / "layout"
    image = oci(layout, [BASE])
    with open(layout / "index.json", "ab") as fh:
        fh.truncate(64 * 2 ** 20)  # sparse: 64 MiB of NULs after the JSON
    refused(path, tmp_path, image, "index.json", "larger than",
            limits=ImageLimits(json_bytes=2 ** 20))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lie", ["manifest", "config", "layer", "size", "diff_id"])
def test_claimed_digests_that_do_not_match_are_refused(path, lie, tmp_path):
    honest = layer(entry("etc", "dir", mode=0o755), entry("etc/motd", data=b"honest\n"))
    evil = layer(entry("etc", "dir", mode=0o755), entry("etc/motd", data=b"evil!!\n"))

    def tamper(where, blobs, manifest, cfg, packed):
        if lie == "manifest":
            (blobs / sha(manifest)[7:]).write_bytes(manifest.replace(b'"size"', b'"size" '))
        elif lie == "config":
            (blobs / sha(cfg)[7:]).write_bytes(cfg.replace(b"amd64", b"AMD64"))
        elif lie in ("layer", "size"):
            evil_packed = gzip.compress(evil, compresslevel=1)
            if lie == "size":
                evil_packed += b"\0" * 16
            (blobs / sha(packed[0])[7:]).write_bytes(evil_packed)
    config_raw = config_of([evil]) if lie == "diff_id" else None
    image = oci(tmp_path / "layout", [honest], config_raw=config_raw, lie=tamper)
    words = {"manifest": "digest", "config": "digest", "layer": "digest", "size": "bytes",
             "diff_id": "digest"}[lie]
    refused(path, tmp_path, image, words, "refused")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["oci", "docker-archive"])
def test_a_hostile_image_cannot_take_the_cache_entry_of_the_one_it_claims(path, kind, tmp_path):
    """The hostile image claims the legitimate one's digests (its index names the
    legitimate manifest, or its archive carries the legitimate config) with its own
    layer; prepared first, it must be refused, and the legitimate image then gets its
    own files."""
    honest = layer(entry("etc", "dir", mode=0o755), entry("etc/motd", data=b"honest\n"))
    evil = layer(entry("etc", "dir", mode=0o755), entry("etc/motd", data=b"EVIL\n"))
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    good = image_of(kind, tmp_path / "good", [honest])
    if kind == "oci":
        def swap(where, blobs, manifest, cfg, packed):
            (blobs / sha(packed[0])[7:]).write_bytes(gzip.compress(evil))
        bad = oci(tmp_path / "bad" / "layout", [honest], lie=swap)
    else:
        bad = docker_archive(tmp_path / "bad" / "image.tar", [evil],
                             config_raw=config_of([honest]))
    refused(path, tmp_path, bad, "digest")
    prepared = prepare(path, tmp_path, good)
    assert (prepared.rootfs / "etc" / "motd").read_bytes() == b"honest\n"


# --------------------------------------------------------------------------- layers
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["oci", "docker-archive"])
def test_paths_and_links_out_of_the_rootfs_land_inside_it(path, kind, tmp_path, host):
    """``..``, absolute names, a member below an absolute or a climbing link, and
    whiteouts through links: the host's directory is untouched, what the layer
    wrote is in the cache."""
    first = layer(entry("etc", "dir", mode=0o755), entry("etc/passwd", data=b"root\n"),
                  entry("../../../../../../%s/dotdot" % host),
                  entry("%s/absolute" % host),
                  entry("abs", "symlink", link=str(host)),
                  entry("rel", "symlink", link="../../../../../../../../" + str(host)),
                  entry("etc-link", "symlink", link="/etc"),
                  entry("abs/planted", data=b"x"), entry("rel/planted-too", data=b"x"))
    second = layer(entry("abs/.wh.canary"), entry("rel/.wh.passwd"),
                   entry("etc-link/.wh..wh..opq"))
    image = image_of(kind, tmp_path, [first, second])
    hosts_etc = sorted(os.listdir("/etc"))
    try:
        with Unchanged(tmp_path / "host"):
            prepared = prepare(path, tmp_path, image)
    except ProviderError as exc:  # umoci may refuse some of it outright: as good
        assert path == "tools" and exc.kind == "fatal", exc
        return
    finally:
        assert sorted(os.listdir("/etc")) == hosts_etc
    inside = prepared.rootfs / str(host).lstrip("/")
    assert os.path.islink(prepared.rootfs / "abs")
    assert (inside / "planted").exists() and (inside / "planted-too").exists()
    assert (inside / "dotdot").exists() and (inside / "absolute").exists()
    assert os.listdir(prepared.rootfs / "etc") == []  # emptied through the link, inside


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("via", ["absolute", "symlink"])
def test_hard_links_never_reach_a_host_file(path, via, tmp_path, host):
    """A hard link naming a host file, or naming a link of the layer to one: never
    the host's inode (os.link would follow the link by default)."""
    canary = host / "canary"
    if via == "absolute":
        members = [entry("h", "hardlink", link=str(canary))]
    else:
        members = [entry("s", "symlink", link=str(canary)), entry("h", "hardlink", link="s")]
    image = oci(tmp_path / "layout", [layer(*members)])
    # the cache on the canary's filesystem: a link across filesystems would fail anyway
    before = os.stat(canary)
    try:
        prepared = prepare(path, tmp_path, image)
    except ProviderError as exc:
        assert exc.kind == "fatal" and ("hard link" in str(exc) or "umoci" in str(exc))
    else:
        linked = os.lstat(prepared.rootfs / "h")
        assert (linked.st_dev, linked.st_ino) != (before.st_dev, before.st_ino)
    after = os.stat(canary)
    assert after.st_nlink == before.st_nlink == 1 and canary.read_bytes() == SECRET


@pytest.mark.parametrize("path", PATHS)
def test_device_nodes_are_not_made_and_setuid_files_stay_out_of_other_users_reach(
        path, tmp_path):
    hostile = layer(entry("dev", "dir", mode=0o755), entry("dev/mem", "chr", devmajor=1),
                    entry("bin", "dir", mode=0o755),
                    entry("bin/su", data=b"#!/bin/sh\n", mode=0o4755))
    image = oci(tmp_path / "layout", [hostile])
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    tmp_path.chmod(0o755)
    prepared = prepare(path, open_dir, image)
    assert not os.path.lexists(prepared.rootfs / "dev" / "mem")
    su = prepared.rootfs / "bin" / "su"
    assert os.stat(su).st_mode & stat.S_ISUID  # the image's, kept as it is
    if os.geteuid() == 0:
        nobody = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                                 "--clear-groups", "stat", str(su)],
                                capture_output=True, text=True, timeout=30)
        assert nobody.returncode != 0 and "Permission denied" in nobody.stderr


@pytest.mark.parametrize("path", PATHS)
def test_a_gzip_bomb_stops_at_the_layer_cap(path, tmp_path):
    bomb = layer(entry("zeros", data=b"\0" * (48 * 2 ** 20)))
    image = oci(tmp_path / "layout", [bomb])
    blobs = (tmp_path / "layout" / "blobs" / "sha256").iterdir()
    assert min(os.path.getsize(b) for b in blobs) < 2 ** 20  # a bomb: small, packed
    refused(path, tmp_path, image, "larger than %d bytes" % (8 * 2 ** 20),
            limits=ImageLimits(layer_bytes=8 * 2 ** 20))
    assert not any(p.name.endswith(".building") for p in (tmp_path / ("cache-" + path)).iterdir())


def test_a_layer_with_too_many_members_is_refused(tmp_path):
    many = layer(*[entry("f%d" % i) for i in range(300)])
    image = oci(tmp_path / "layout", [many])
    refused("builtin", tmp_path, image, "more than 100 members",
            limits=ImageLimits(layer_members=100))


def test_an_extended_header_past_its_cap_is_refused(tmp_path):
    info, _ = entry("long")
    info.pax_headers = {"comment": "x" * (200 * 1024)}
    image = oci(tmp_path / "layout", [layer((info, b""))])
    refused("builtin", tmp_path, image, "extended header")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field,value,words", [
    ("Env", "PATH=/bin", "Env is not a list"),
    ("Env", ["NOEQUALS"], "Env[0]"),
    ("Env", ["A=b\0c"], "Env[0]"),
    ("Env", [7], "Env[0]"),
    ("User", "root\0", "User"),
    ("WorkingDir", ["/"], "WorkingDir"),
])
def test_image_configs_are_checked_when_prepared(path, field, value, words, tmp_path):
    image = oci(tmp_path / "layout", [BASE], {field: value})
    refused(path, tmp_path, image, words, "refused")


# --------------------------------------------------------------------------- archives
@pytest.mark.parametrize("path", PATHS)
def test_an_archive_that_is_a_fifo_or_names_host_files_is_refused(path, tmp_path, host):
    fifo = tmp_path / "fifo.tar"
    os.mkfifo(fifo)
    refused(path, tmp_path, "docker-archive:%s" % fifo, "not a regular file")
    # its config a link member to a host file: resolved among the archive's members
    names = ["0/layer.tar"]
    manifest = entry("manifest.json", data=json.dumps(
        [{"Config": "cfg-link", "Layers": names}]).encode())
    cfg_link, _ = entry("cfg-link", "symlink", link=str(host / "config.json"))
    image = docker_archive(tmp_path / "image.tar", [BASE], members=[(cfg_link, b""), manifest])
    with Unchanged(tmp_path):
        refused(path, tmp_path, image, "cfg-link")


@pytest.mark.parametrize("path", PATHS)
def test_an_honest_image_still_unpacks_on_both_paths(path, tmp_path):
    files = layer(entry("etc", "dir", mode=0o755), entry("etc/motd", data=b"hi\n"),
                  entry("etc/gone", data=b"x"), entry("opt", "dir", mode=0o755),
                  entry("opt/a", data=b"a"))
    whiteouts = layer(entry("etc/.wh.gone"), entry("opt/.wh..wh..opq"), entry("opt/b", data=b"b"))
    for kind in ("oci", "docker-archive"):
        where = tmp_path / kind
        where.mkdir()
        prepared = prepare(path, where, image_of(kind, where, [files, whiteouts],
                                                 {"Env": ["A=1"], "User": "0:0"}))
        root = prepared.rootfs
        assert (root / "etc" / "motd").read_bytes() == b"hi\n"
        assert not os.path.lexists(root / "etc" / "gone")
        assert sorted(os.listdir(root / "opt")) == ["b"]
        assert prepared.config.env == ("A=1",) and prepared.run_as == ""
        assert prepared.unpacked_by == ("umoci" if path == "tools" and shutil.which("umoci")
                                        else "sandman")


# --------------------------------------------------------------------------- a real pool
@pytest.fixture(scope="module")
def cluster():
    from conftest import local_ray
    yield from local_ray()


def test_a_pool_refuses_dir_images_outside_its_roots_and_serves_those_inside(
        cluster, busybox_rootfs, tmp_path_factory):
    """Through the real pool: ``dir:/`` and a directory outside ``image_roots`` (the
    project's own busybox, trusted by the other tests' providers but not this one's)
    fail the acquire with the reason; a rootfs below the trusted root serves."""
    import ray
    import sandman_ray as sandman
    from sandman_ray.image_builders import build_busybox_rootfs
    from conftest import LOCAL_CACHE, LOCAL_STATE, unique_pool
    trusted = tmp_path_factory.mktemp("trusted-images")
    inside = build_busybox_rootfs(trusted / "busybox")
    pool = unique_pool(sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                                             image_roots=[str(trusted)]), "images")
    try:
        for image in ("dir:/", "dir:%s" % busybox_rootfs, "dir:%s/../.." % inside):
            with pytest.raises(sandman.ProviderError) as err:
                sandman.acquire(image, pool=pool, timeout=60)
            assert "image_roots" in str(err.value) and image in str(err.value)
        with sandman.sandbox("dir:%s" % inside, pool=pool, timeout=60) as sb:
            assert ray.get(sb.exec.remote("cat /etc/os-release")).stdout.startswith(b"ID=busybox")
    finally:
        sandman.shutdown_pool(pool)
