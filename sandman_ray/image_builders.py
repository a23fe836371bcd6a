"""Small real images built from local parts: a busybox-static rootfs (no libc, no
Python), OCI layouts and ``docker save`` archives made from any rootfs, and a Debian
minbase rootfs (debootstrap). The demo, the tests and the benchmarks use them; users can
package their own rootfs with them."""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Mount points a sandbox binds over; a read-only lower layer gets them at unpack time.
MOUNT_POINTS = (".sandman", "run/sandman", "proc", "dev", "tmp", "sys")

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
Layer = Dict[str, bytes]  # extra layer: member name -> content (".wh.x" names whiteout)


def find_busybox() -> str:
    """Path of a statically linked busybox (Debian package ``busybox-static``)."""
    for path in BUSYBOX_CANDIDATES:
        if os.path.exists(path):
            with open(path, "rb") as fh:
                if b"ld-linux" not in fh.read(4096 * 4):  # no ELF interpreter: static
                    return path
    raise FileNotFoundError("no static busybox found; install it: apt-get install busybox-static")


def _publish(tmp: Path, dest: Path) -> Path:
    try:
        tmp.rename(dest)
    except OSError:  # built concurrently by someone else: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_busybox_rootfs(dest: Path) -> Path:
    """A minimal rootfs at ``dest``: busybox and its applet links, /etc files, and the
    directories sandboxes mount over. Idempotent (an existing rootfs is kept)."""
    dest = Path(dest)
    if (dest / "bin" / "busybox").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp-%d" % os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    busybox = find_busybox()
    (tmp / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tmp / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", tmp / "bin" / applet)
    for sub in MOUNT_POINTS + ("etc", "root", "home", "var/tmp", "usr"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    os.symlink("../bin", tmp / "usr" / "bin")
    (tmp / "tmp").chmod(0o1777)
    (tmp / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                        "nobody:x:65534:65534:nobody:/:/bin/false\n")
    (tmp / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (tmp / "etc" / "os-release").write_text('ID=busybox\nNAME="BusyBox"\nVERSION_ID=static\n')
    return _publish(tmp, dest)


def build_debian_rootfs(dest: Path, suite: str = "bookworm",
                        include: Sequence[str] = (), users: Sequence[str] = ()) -> Path:
    """A Debian minbase rootfs with debootstrap (and the packages in ``include``, and a
    user of uid 1000 up, with a home of /home/<name>, for each name of ``users``):
    ~20 s and ~200 MB without Python, once; ``builtin:debian`` adds python3."""
    dest = Path(dest)
    if (dest / "etc" / "debian_version").exists():
        return dest
    if shutil.which("debootstrap") is None:
        raise FileNotFoundError("debootstrap is missing: apt-get install debootstrap")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp-%d" % os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    extra = ["--include=" + ",".join(include)] if include else []
    subprocess.run(["debootstrap", "--variant=minbase"] + extra + [suite, str(tmp)], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for sub in MOUNT_POINTS:
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    for uid, name in enumerate(users, 1000):
        add_user(tmp, name, uid)
    return _publish(tmp, dest)


def add_user(rootfs: Path, name: str, uid: int) -> None:
    """User ``name`` (uid and gid ``uid``, shell bash, home /home/<name> that it owns)
    in ``rootfs``, written into its account files as useradd would."""
    etc = rootfs / "etc"
    for path, line in (("passwd", "%s:x:%d:%d::/home/%s:/bin/bash" % (name, uid, uid, name)),
                       ("group", "%s:x:%d:" % (name, uid)), ("shadow", "%s:!:19000::::::" % name),
                       ("gshadow", "%s:!::" % name)):
        with open(etc / path, "a") as f:
            f.write(line + "\n")
    home = rootfs / "home" / name
    home.mkdir(parents=True, exist_ok=True)
    for skel in (etc / "skel").glob(".*") if (etc / "skel").is_dir() else ():
        shutil.copy2(skel, home / skel.name)
    for path in [home] + list(home.iterdir()):
        os.chown(path, uid, uid)


def _rootfs_layer(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(str(rootfs / entry), arcname=entry)
    return buf.getvalue()


def _files_layer(files: Layer) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _image_config(config: Optional[dict], diff_ids: List[str]) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux",
                       "config": config or {},
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_oci_layout(rootfs: Path, layout: Path, tag: str = "latest",
                     config: Optional[dict] = None, extra_layers: List[Layer] = ()) -> Path:
    """An OCI image layout at ``layout`` whose first layer is ``rootfs`` (gzip) and
    whose next layers hold ``extra_layers``; ``config`` is the image config's
    ``config`` part (Env, WorkingDir, User ...)."""
    layout = Path(layout)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = _sha(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest
    layers, diff_ids = [], []
    for raw in [_rootfs_layer(Path(rootfs))] + [_files_layer(l) for l in extra_layers]:
        packed = gzip.compress(raw, compresslevel=1)
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                       "digest": put(packed), "size": len(packed)})
        diff_ids.append(_sha(raw))
    cfg = _image_config(config, diff_ids)
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": put(cfg), "size": len(cfg)},
                           "layers": layers}).encode()
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest),
        "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return layout


def write_docker_archive(rootfs: Path, archive: Path, config: Optional[dict] = None,
                         extra_layers: List[Layer] = (), repo_tag: str = "local/image:latest") -> Path:
    """A ``docker save`` archive of ``rootfs`` (plus ``extra_layers``) at ``archive``."""
    raws = [_rootfs_layer(Path(rootfs))] + [_files_layer(l) for l in extra_layers]
    diff_ids = [_sha(r) for r in raws]
    cfg = _image_config(config, diff_ids)
    cfg_name = _sha(cfg).split(":")[1] + ".json"
    names = ["%s/layer.tar" % d.split(":")[1] for d in diff_ids]
    with tarfile.open(archive, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add(cfg_name, cfg)
        for name, raw in zip(names, raws):
            add(name, raw)
        add("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": [repo_tag],
                                          "Layers": names}]).encode())
    return Path(archive)


# ``builtin:<name>``: how each built-in image is made. builtin:debian is a task image of
# the kind agents work in: bash, python (also as ``python``) and a pager, which
# SWE-ReX's own suite runs (tests/peer) assumes. builtin:code runs programs of
# SandboxFusion's requests (service/fusion.py): python, bash, C and C++, and is E2B's
# ``base`` template (service/e2b), whose commands run as ``user`` in /home/user.
BUILTIN_PACKAGES = {"debian": ("python3", "python-is-python3", "less"),
                    "code": ("python3", "python-is-python3", "gcc", "g++", "libc6-dev")}
BUILTIN_USERS = {"debian": (), "code": ("user",)}


def builtin_key(name: str) -> str:
    """The cache entry of ``builtin:<name>``: named after what it is made of, so that a
    new package list builds a new entry instead of reusing the old one."""
    made_of = ",".join(BUILTIN_PACKAGES[name] + tuple("user:" + u for u in BUILTIN_USERS[name]))
    return "builtin-%s-%s" % (name, hashlib.sha256(made_of.encode()).hexdigest()[:8])


def build_builtin(name: str, dest: Path) -> Path:
    """The rootfs of ``builtin:<name>`` at ``dest`` (built once, ~40 s)."""
    return build_debian_rootfs(dest, include=BUILTIN_PACKAGES[name], users=BUILTIN_USERS[name])
