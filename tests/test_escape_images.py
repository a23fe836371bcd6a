"""Hostile images: an image is data, never a path into the host (SECURITY.md, "Images").

Each image here is built in the test (tarfile, json, hashlib; no network) as an OCI
layout or a ``docker save`` archive and prepared on both paths, umoci (``tools``) and
the built-in applier (``builtin``). Each attack is asserted refused (a fatal
ProviderError naming the problem) or harmless, with the host unchanged: a canary
directory outside the cache keeps its files, and nothing appears outside the cache.
Every prepare runs under a time bound, so that a FIFO or ``/dev/zero`` cannot hang the
suite. The last tests start hostile images as sandboxes at every level where images
apply: the LocalProvider's default, with a network, under gVisor, and a DockerProvider
container of the image as the engine loaded it. The builders are ``image_kit.py``."""

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile

import pytest

from sandman_ray.errors import ProviderError
from sandman_ray.images import ImageCache, check_image_root
from sandman_ray.image_layers import ImageLimits
from sandman_ray import image_files
from image_kit import (BASE, SECRET, Unchanged, config_of, docker_archive, entry, image_of,
                       layer, make_host, oci, prepare, refused, sha)
from escape_kit import docker_provider, engine, provider  # noqa: F401 - fixtures, by name


@pytest.fixture
def host(tmp_path):
    return make_host(tmp_path)


PATHS = ["tools", "builtin"]


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


# --------------------------------------------------------------------------- at every level
# Each hostile image started as a sandbox, through the providers: a LocalProvider
# sandbox (its image prepared by the ImageCache) with the default isolation, with a
# network, under gVisor; and a DockerProvider container of the image as ``docker
# load`` hands it to the engine (its import path).
LEVELS = ("local", "local-network", "local-gvisor", "docker")
LOADED = "localhost/sandman-escape/hostile-%s:1"


def rootfs_layer(rootfs) -> bytes:
    """The directory ``rootfs`` as an uncompressed layer (owners root's)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(str(rootfs), arcname=".", filter=lambda m: (setattr(m, "uid", 0),
                                                            setattr(m, "gid", 0), m)[-1])
    return buf.getvalue()


@pytest.fixture(scope="module")
def level_host(tmp_path_factory):
    return make_host(tmp_path_factory.mktemp("level-host"))


@pytest.fixture(scope="module")
def hostile_images(busybox_rootfs, level_host, tmp_path_factory):
    """Two images over the busybox rootfs: ``aims`` aims at the host (members that
    climb out, links to the host's directory and its /etc/shadow, a device node); and
    ``user`` names a user that only a host passwd holds, its own passwd a link there.
    Each as an OCI layout and a ``docker save`` archive tagged for the engine."""
    where = tmp_path_factory.mktemp("hostile-levels")
    base = rootfs_layer(busybox_rootfs)
    aims = layer(entry("../../../../../../%s/dotdot" % level_host, data=b"dotdot\n"),
                 entry("abs", "symlink", link=str(level_host)),
                 entry("abs/planted", data=b"planted\n"),
                 entry("hostshadow", "symlink", link="/etc/shadow"),
                 entry("dev", "dir", mode=0o755), entry("dev/mem", "chr", devmajor=1))
    user = layer(entry("etc/passwd", "symlink", link=str(level_host / "passwd")))
    images = {}
    for name, top, config in (("aims", aims, {"Env": ["PATH=/bin"]}),
                              ("user", user, {"Env": ["PATH=/bin"], "User": "t4user"})):
        layers = [base, top]
        manifest = json.dumps([{"Config": "config.json", "RepoTags": [LOADED % name],
                                "Layers": ["%d/layer.tar" % i for i in range(2)]}]).encode()
        images[name] = {
            "oci": oci(where / name, layers, config),
            "archive": docker_archive(where / ("%s.tar" % name), layers, config,
                                      members=[entry("manifest.json", data=manifest)])}
    return images


@contextlib.contextmanager
def box_at(level, request, images, name):
    """A sandbox of hostile image ``name`` at ``level``."""
    from conftest import LOCAL_CACHE, LOCAL_STATE, Sandbox, run, shared_ray
    from sandman_ray.spec import SandboxSpec
    shared_ray()
    if level == "docker":
        engine = request.getfixturevalue("engine")
        engine.podman("load", "-i", images[name]["archive"][len("docker-archive:"):])
        with Sandbox(request.getfixturevalue("docker_provider"), LOADED % name) as sb:
            yield sb
        return
    from sandman_ray.providers.local import LocalProvider
    provider = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                             isolation="gvisor" if level == "local-gvisor" else "namespaces"
                             ).bind("hostile-%s" % os.urandom(3).hex())
    try:
        spec = SandboxSpec(image=images[name]["oci"], network=level == "local-network")
        with Sandbox(provider, spec) as sb:
            yield sb
    finally:
        run(provider.shutdown())


@pytest.mark.parametrize("level", LEVELS)
def test_a_hostile_image_reaches_nothing_of_the_host_at_any_level(request, level,
                                                                   hostile_images, level_host):
    """Its members that climbed out and its links to the host resolve inside the
    sandbox's own root (under gVisor, /tmp is a tmpfs of its own over them); the
    host's canary and /etc/shadow are not read through them; no device node is made;
    the host's directory is unchanged."""
    shadow = open("/etc/shadow", "rb").read()
    with Unchanged(level_host.parent), box_at(level, request, hostile_images, "aims") as sb:
        out = sb.client.exec(["/bin/sh", "-c",
                              "cat /abs/planted %s/canary /hostshadow; ls -l /dev/mem; "
                              "echo end" % level_host]).stdout
    assert out.endswith(b"end\n"), out
    assert SECRET not in out and (not shadow.strip() or shadow.strip() not in out)
    assert not out.startswith(b"c") and b"\nc" not in out  # no character device listed
    assert sorted(os.listdir(level_host)) == ["canary", "config.json", "passwd"]


@pytest.mark.parametrize("level", LEVELS)
def test_an_images_user_is_never_read_from_a_host_passwd_at_any_level(request, level,
                                                                       hostile_images):
    """The image's user is looked up in its own passwd, which is a link to the host's
    directory: the link resolves inside, where no such user is, so the sandbox is
    refused (or, where an engine allows it, runs as someone else): never as the host
    file's 4242."""
    from sandman_ray.errors import ProviderError
    try:
        with box_at(level, request, hostile_images, "user") as sb:
            ids = sb.client.exec(["/bin/sh", "-c", "id -u; id -g"]).stdout.split()
    except ProviderError as exc:
        assert "t4user" in str(exc) or "user" in str(exc), exc
    else:
        assert b"4242" not in ids and b"4343" not in ids, ids
