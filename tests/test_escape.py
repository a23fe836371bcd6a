"""The escape suite: attacks a hostile agent would try from inside a sandbox, through
the daemon a lease talks to, each asserted to fail with the host unchanged. SECURITY.md
lists every attack with what stops it. This module: users, files, devices, processes,
the token and the limits; ``test_escape_leases.py``: leases that end and the daemon's
door; ``test_escape_network.py``: the network, gVisor and an agent that is not root.
The sandboxes are real (``escape_kit.py``)."""

import os
import shutil
import stat
import subprocess
import tempfile
import uuid

import pytest

from conftest import Sandbox
from escape_kit import IMAGES, BOXES, DOCKER_IMAGE, busybox_like, daemon_pid, sh
from escape_kit import host_secrets, read_each
from escape_kit import (  # noqa: F401 - fixtures: pytest finds them by name
    box, boxes, docker_box, docker_provider, engine, provider)


@pytest.mark.parametrize("box", BOXES, indirect=True)
def test_root_inside_is_an_unprivileged_range_of_host_ids(box):
    sb = box
    base = sb.info.details["host_root_id"]
    assert base is not None and base >= 1 << 30
    with open("/proc/%d/status" % daemon_pid(sb)) as fh:
        ids = dict(line.split(":", 1) for line in fh)
    assert ids["Uid"].split() == [str(base)] * 4 and ids["Gid"].split() == [str(base)] * 4
    assert sh(sb, "id -u; id -g") == "0\n0\n"  # and yet root as the sandbox sees it


@pytest.mark.parametrize("box", BOXES, indirect=True)
def test_proc_sys_cannot_be_written(box):
    before = open("/proc/sys/kernel/core_pattern").read()
    out = sh(box, "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern; echo rc=$?; "
                           "echo 1 > /proc/sys/vm/drop_caches; echo rc=$?")
    assert "rc=0" not in out and out.count("Read-only file system") == 2
    assert open("/proc/sys/kernel/core_pattern").read() == before


@pytest.mark.parametrize("box", BOXES, indirect=True)
def test_a_setuid_root_binary_made_inside_gives_no_one_root_on_the_host(box):
    """The attack of a sandbox whose root is host root: copy a shell, make it setuid
    root, run it from the host as nobody. Here the copy belongs to the range (and its
    filesystem is nosuid): run as nobody, it is not root."""
    sb = box
    shell = "/bin/busybox" if busybox_like(sb) else "/bin/dash"
    name = "/tmp/suid-%s" % uuid.uuid4().hex[:6]
    out = sh(sb, "cp %s %s && chown 0:0 %s && chmod 4755 %s && echo made" % ((shell, name) +
                                                                            (name,) * 2))
    assert "made" in out
    # as it would land on the host: copied out with its owner and mode
    where = tempfile.mkdtemp(prefix="sandman-landed-")
    os.chmod(where, 0o755)
    landed = os.path.join(where, "busybox")  # the name busybox needs to pick its applet
    subprocess.run(["cp", "-a", "/proc/%d/root%s" % (daemon_pid(sb), name), landed], check=True)
    try:
        st = os.stat(landed)
        assert st.st_uid == sb.info.details["host_root_id"] and st.st_mode & stat.S_ISUID
        argv = [landed] + (["sh"] if busybox_like(sb) else []) + ["-c", "id -u"]
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                            "--clear-groups"] + argv, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() in ("65534", str(st.st_uid)), r
    finally:
        shutil.rmtree(where)


@pytest.mark.parametrize("box", BOXES, indirect=True)
def test_files_made_inside_belong_to_the_range_on_the_host(box):
    sb = box
    base = sb.info.details["host_root_id"]
    sh(sb, "touch /tmp/mine /tmp/root-made && chown 1000:1000 /tmp/mine")
    assert os.stat("/proc/%d/root/tmp/mine" % daemon_pid(sb)).st_uid == base + 1000
    assert os.stat("/proc/%d/root/tmp/root-made" % daemon_pid(sb)).st_uid == base


@pytest.mark.parametrize("image", IMAGES)
def test_nothing_on_the_hosts_disk_is_writable_from_inside(boxes, image):
    """The daemon's socket is the agent's (bound outside, handed over as a
    descriptor): no host directory is bound writable, so nothing inside can fill the
    host's disk, leave a tree the host cannot remove, or swap the socket for its own."""
    sb = boxes[image]
    path = sb.info.address.partition(":")[2]
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    with open("/proc/%d/mountinfo" % daemon_pid(sb)) as fh:
        mounts = [line.split() for line in fh]
    writable = [m[4] for m in mounts if "rw" in m[5].split(",")
                and m[m.index("-") + 1] not in ("tmpfs", "overlay", "proc", "devpts", "mqueue",
                                                   "devtmpfs")]  # /dev/null and the like
    assert writable == [], writable


def test_a_containers_one_writable_host_directory_cannot_redirect_the_host(docker_box):
    """A container's daemon makes its socket in a host directory bound at /run/sandman,
    the one host directory it can write (beside the engine's own files of the
    container, such as /etc/hosts). Swapped for a symlink to a socket of the host, the
    socket does not take the host's next connection there: the host refuses to follow
    it, and the host's socket saw nothing."""
    import socket as sockets
    from sandman_ray import DaemonClient, SandmanError
    sb = docker_box
    with open("/proc/%d/mountinfo" % daemon_pid(sb)) as fh:
        mounts = [line.split() for line in fh]
    writable = [m[4] for m in mounts if "rw" in m[5].split(",")
                and m[m.index("-") + 1] not in ("tmpfs", "overlay", "proc", "devpts", "mqueue",
                                                   "devtmpfs", "sysfs", "cgroup2", "cgroup")]
    engine_files = {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv"}
    assert "/run/sandman" in writable and set(writable) <= engine_files | {"/run/sandman"}, \
        writable
    bait = os.path.join(tempfile.mkdtemp(prefix="sandman-bait-"), "host.sock")
    server = sockets.socket(sockets.AF_UNIX)
    server.bind(bait)
    server.listen(4)
    server.setblocking(False)
    try:
        out = sh(sb, "cd /run/sandman && mv sock real && ln -s %s sock && echo swapped" % bait)
        assert "swapped" in out
        with pytest.raises(SandmanError, match="not a socket"):
            DaemonClient(sb.info.address, sb.info.token, connect_timeout=5).ping()
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        sh(sb, "cd /run/sandman && rm -f sock && mv real sock")
        server.close()
        shutil.rmtree(os.path.dirname(bait))
    DaemonClient(sb.info.address, sb.info.token).close()  # the real socket, back in its place
    sb.client.ping()


@pytest.mark.parametrize("box", BOXES, indirect=True)
def test_device_nodes_cannot_be_made(box):
    out = sh(box, "mknod /tmp/mem c 1 1; echo rc=$?; head -c 1 /tmp/mem; echo rc=$?")
    assert "Operation not permitted" in out and "rc=0" not in out


def test_the_host_image_shows_only_what_any_user_may_read(boxes):
    """``host`` is a read-only view of this machine: root inside has no say over the
    host's files, so a 0600 file in a 0700 directory, a 0640 file of root and
    /etc/shadow stay closed, and the directory cannot be listed."""
    with host_secrets() as paths:
        out = sh(boxes["host"], read_each(paths) + "ls %s; echo rc=$?"
                 % os.path.dirname(paths[0]))
    assert "root:" not in out and "hunter2" not in out and "rc=0" not in out
    assert out.count("Permission denied") == len(paths) + 1, out


@pytest.mark.parametrize("box", ("host", "docker"), indirect=True)
def test_new_user_namespaces_are_refused(box):
    out = sh(box, "unshare -U -r id; echo rc=$?; unshare -m true; echo rc=$?")
    assert "rc=0" not in out


@pytest.mark.parametrize("box", ("host", "docker"), indirect=True)
def test_host_processes_cannot_be_signalled_or_traced(box):
    """No pid of the host is visible inside; the sandbox's root (a range id) would
    have no right over host root's processes even if it could name them."""
    me = os.getpid()
    out = sh(box, "kill -0 %d; echo rc=$?; kill -9 -1; echo rc=$?" % me)
    assert "rc=0\n" not in out.split("kill -9")[0] and os.getpid() == me
    assert "No such process" in out


@pytest.mark.parametrize("box", ("busybox", "docker"), indirect=True)
def test_the_token_is_not_in_the_daemons_environment(box):
    """Nor in its command line, nor (a container's) in a file inside or in what the
    engine keeps of the container."""
    sb = box
    assert sb.info.token.encode() not in open("/proc/%d/environ" % daemon_pid(sb), "rb").read()
    out = sh(sb, "cat /proc/1/environ; echo; cat /proc/1/cmdline; ls -a /run/sandman; "
                 "cat /run/sandman/* 2>/dev/null")
    assert sb.info.token not in out
    if sb.kind == "docker":
        from sandman_ray.providers.docker.engine import engine_client
        engine = engine_client(sb.info.details["engine"])
        assert sb.info.token not in repr(engine.api.inspect_container(
            sb.info.details["container"]))


# ---------------------------------------------------------------- limits by default
def test_pool_defaults_stop_a_disk_filler_a_fork_bomb_and_a_memory_hog(provider,
                                                                       busybox_rootfs):
    """A spec that asks for no limits still gets the pool's: filling the disk ends in
    ENOSPC, a fork bomb in EAGAIN, a memory hog in a kill, each seen by the command,
    while a neighbour in the same pool and the host's disk notice nothing."""
    import ray
    import sandman_ray as sandman
    from conftest import LOCAL_CACHE, LOCAL_STATE, unique_pool
    pool = unique_pool(sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE),
                       "limits", default_pids=64, default_memory="96Mi", default_disk="32Mi")
    image = "dir:%s" % busybox_rootfs
    host_free = shutil.disk_usage("/tmp").free
    try:
        with sandman.sandbox(image, pool=pool) as hog, \
                sandman.sandbox(image, pool=pool) as neighbour:
            disk = ray.get(hog.exec.remote("dd if=/dev/zero of=/tmp/fill bs=1M count=100"))
            assert disk.exit_code != 0 and b"No space left on device" in disk.stderr
            assert abs(shutil.disk_usage("/tmp").free - host_free) < 16 * 2 ** 20
            bomb = ray.get(hog.exec.remote(
                "for i in $(seq 100); do sleep 30 >/dev/null 2>&1 & done; echo done",
                timeout=30))
            assert b"can't fork" in bomb.stdout + bomb.stderr or \
                b"Resource temporarily unavailable" in bomb.stdout + bomb.stderr
            ray.get(hog.exec.remote("kill -9 -1 2>/dev/null; true"))
            memory = ray.get(hog.exec.remote(
                "dd if=/dev/zero of=/dev/null bs=200M count=1; echo rc=$?", timeout=60))
            assert memory.stdout.strip() in (b"rc=137", b"rc=1")  # killed, or refused
            # a kill is the OOM killer's, and the result says so (the sh survived it)
            assert memory.oom_killed == (memory.stdout.strip() == b"rc=137")
            assert not ray.get(hog.exec.remote("true")).oom_killed
            assert ray.get(neighbour.exec.remote("echo fine")).stdout == b"fine\n"
            assert ray.get(hog.exec.remote("echo still answering")).exit_code == 0
    finally:
        sandman.shutdown_pool(pool)


def test_a_containers_limits_stop_a_fork_bomb_and_a_memory_hog(docker_provider, docker_box):
    """The pool's default pids and memory limits, as a DockerProvider container gets
    them: the fork bomb meets EAGAIN, the hog a kill, and the neighbour notices nothing.
    (Its disk is limited only where the engine's storage has quotas: SECURITY.md.)"""
    from sandman_ray.spec import SandboxSpec
    with Sandbox(docker_provider, SandboxSpec(image=DOCKER_IMAGE, pids=64,
                                              memory="96Mi")) as hog:
        bomb = hog.client.exec(["/bin/sh", "-c", "for i in $(seq 100); do sleep 30 "
                                ">/dev/null 2>&1 & done; echo done"], timeout=30)
        assert b"can't fork" in bomb.stdout + bomb.stderr or \
            b"Resource temporarily unavailable" in bomb.stdout + bomb.stderr
        sh(hog, "kill -9 -1 2>/dev/null; true")
        memory = hog.client.exec(["/bin/sh", "-c", "dd if=/dev/zero of=/dev/null bs=200M count=1;"
                                  " echo rc=$?"], timeout=60)
        assert memory.stdout.strip() in (b"rc=137", b"rc=1")  # killed, or refused
        assert memory.oom_killed == (memory.stdout.strip() == b"rc=137")
        assert sh(docker_box, "echo fine") == "fine\n"
        assert hog.client.exec("echo still answering").exit_code == 0


def test_the_specs_environment_never_reaches_the_host_side_of_the_launch(provider,
                                                                          busybox_rootfs,
                                                                          tmp_path):
    """An image's or a spec's PATH and LD_PRELOAD apply inside the sandbox only: the
    launch runs as host root until it enters the sandbox's user namespace, and a
    ``mount`` or ``nsenter`` found on a PATH the tenant chose would run as host root."""
    from sandman_ray.spec import SandboxSpec
    trap = tmp_path / "bin"
    trap.mkdir()
    marker = tmp_path / "ran-as-host-root"
    for name in ("mount", "nsenter", "unshare", "bwrap", "prlimit", "sh"):
        (trap / name).write_text("#!/bin/sh\ntouch %s\nexit 1\n" % marker)
        (trap / name).chmod(0o755)
    os.chmod(tmp_path, 0o755)
    spec = SandboxSpec(image="dir:%s" % busybox_rootfs,
                       env={"PATH": "%s:/bin:/usr/bin" % trap, "LD_PRELOAD": "/nonexistent.so"})
    with Sandbox(provider, spec) as sb:
        assert sh(sb, "echo $PATH").startswith(str(trap))  # the sandbox's own PATH
    assert not marker.exists()


# what an image's config may set that the daemon's loader, libc or interpreter would act on
LOADER_VARIABLES = {"LD_PRELOAD": "/usr/lib/libsandman-mark.so", "LD_LIBRARY_PATH": "/usr/lib",
                    "LD_AUDIT": "/usr/lib/libsandman-mark.so",
                    "GLIBC_TUNABLES": "glibc.malloc.check=3", "MALLOC_ARENA_MAX": "1",
                    "GCONV_PATH": "/tmp", "PYTHONPATH": "/tmp", "PYTHONSTARTUP": "/tmp/x.py"}


@pytest.fixture(scope="module")
def preloading_image(busybox_rootfs, tmp_path_factory):
    """An image whose config preloads one of its own libraries (a shared object with no
    dependency, so any process's loader maps it) and sets libc's and Python's
    variables: an OCI layout, and its rootfs (for an engine's import)."""
    from sandman_ray.image_builders import write_oci_layout
    where = tmp_path_factory.mktemp("preload")
    (where / "mark.c").write_text("static void mark(void) __attribute__((constructor));\n"
                                  "static void mark(void) {}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", "-o", str(where / "mark.so"),
                    str(where / "mark.c")], check=True)
    env = ["PATH=/bin"] + ["%s=%s" % kv for kv in sorted(LOADER_VARIABLES.items())]
    layers = [{"usr/lib/libsandman-mark.so": (where / "mark.so").read_bytes()}]
    rootfs = where / "rootfs"
    shutil.copytree(busybox_rootfs, rootfs, symlinks=True)
    os.makedirs(rootfs / "usr" / "lib", exist_ok=True)
    shutil.copy(where / "mark.so", rootfs / "usr" / "lib" / "libsandman-mark.so")
    return {"oci": "oci:%s:v1" % write_oci_layout(busybox_rootfs, where / "oci", "v1",
                                                  {"Env": env}, layers),
            "rootfs": rootfs, "env": env}


@pytest.fixture
def preloading_box(request, preloading_image):
    """A sandbox of the preloading image at the level the test names: a LocalProvider
    sandbox under bubblewrap or gVisor, or a DockerProvider container."""
    from conftest import LOCAL_CACHE, LOCAL_STATE, run, shared_ray
    from sandman_ray.providers.local import LocalProvider
    shared_ray()
    level = request.param
    if level == "docker":
        reference = "localhost/sandman-escape/preload:1"
        request.getfixturevalue("engine").import_rootfs(
            preloading_image["rootfs"], reference,
            changes=["ENV %s" % entry for entry in preloading_image["env"]])
        with Sandbox(request.getfixturevalue("docker_provider"), reference) as sb:
            sb.kind = level
            yield sb
        return
    if level == "gvisor" and shutil.which("runsc") is None:
        pytest.fail("runsc is missing: make test installs it (apt-get install runsc)")
    provider = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                             isolation=level).bind("preload-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(provider, preloading_image["oci"]) as sb:
            sb.kind = level
            yield sb
    finally:
        run(provider.shutdown())


@pytest.mark.parametrize("preloading_box", ["namespaces", "gvisor", "docker"], indirect=True)
def test_an_images_loader_variables_reach_its_commands_never_the_daemon(preloading_box):
    """PID 1 holds the lease's token and the agent's: an image's LD_PRELOAD (or any
    loader, libc or Python variable) must not load the image's code into it. The
    daemon starts with PATH alone (an engine gives it the image's variables, each set
    empty); its commands get the image's environment whole."""
    sb = preloading_box
    seen = sh(sb, "tr '\\0' '\\n' < /proc/1/environ; echo ---; "
                  "grep -c libsandman-mark /proc/1/maps; echo ---; env")
    daemon_env, maps, commands = seen.split("---\n")
    for key, value in LOADER_VARIABLES.items():
        assert "%s=%s" % (key, value) in commands.split("\n")
    if sb.kind == "gvisor":  # PID 1 as gVisor's kernel shows it inside
        assert maps.strip() == "0"
    else:  # as the host sees PID 1 (inside, its maps and environ are not readable)
        pid = daemon_pid(sb)
        with open("/proc/%d/environ" % pid, "rb") as fh:
            daemon_env = fh.read().decode().replace("\0", "\n")
        with open("/proc/%d/maps" % pid) as fh:
            assert "libsandman-mark" not in fh.read()
    # PATH alone, what the launcher adds (bwrap's PWD, the OCI runtime's HOME, an
    # engine's HOSTNAME, TERM and container), and an engine's image variables, empty
    kept = {"PATH", "PWD", "HOME", "HOSTNAME", "TERM", "container"}
    assert all(e.partition("=")[0] in kept or e.endswith("=")
               for e in daemon_env.split()), daemon_env


def test_a_snapshot_copies_what_a_sandbox_left_without_following_it(provider):
    """A hostile sandbox leaves, for its snapshot to copy: a link to the host's
    /etc/shadow, a link out of the layer, a FIFO, a setuid copy of a shell. The copy
    follows nothing (links stay links, read in a fork they resolve in the fork's own
    root), blocks on nothing, and what it wrote on the host's disk only host root may
    reach."""
    from conftest import run
    shadow = open("/etc/shadow", "rb").read()
    with Sandbox(provider, "builtin:debian") as sb:
        out = sh(sb, "ln -s /etc/shadow /root/shadow && ln -s ../../../../../../ /root/up && "
                     "mkfifo /root/fifo && cp /bin/dash /root/suid && chmod 4755 /root/suid && "
                     "echo left")
        assert "left" in out
        name = "hostile-%s" % uuid.uuid4().hex[:6]
        snap = run(provider.snapshot(sb.id, name))
    layer = os.path.join(provider.snapshot_root, sb.info.node_id[:16], provider.pool, name,
                         "layer")
    assert os.readlink(os.path.join(layer, "root", "shadow")) == "/etc/shadow"
    assert stat.S_ISFIFO(os.lstat(os.path.join(layer, "root", "fifo")).st_mode)
    suid = os.path.join(layer, "root", "suid")
    assert os.stat(suid).st_mode & stat.S_ISUID and os.stat(suid).st_uid == 0
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        "stat", suid], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    with Sandbox(provider, snap.image) as fork:
        seen = fork.client.exec(["cat", "/root/shadow"]).stdout
        assert seen and seen != shadow  # the image's own shadow file, not the host's
        assert sh(fork, "ls /root/up/ | grep -c sandman-ray || true").strip() == "0"
        # run by a user other than root inside, the setuid copy is not root (nosuid)
        assert sh(fork, "setpriv --reuid 1000 --regid 1000 --clear-groups /root/suid -c "
                        "'id -u'").strip() == "1000"
    assert open("/etc/shadow", "rb").read() == shadow


def test_a_snapshot_costs_what_the_layer_holds_and_stops_at_its_budget(provider):
    """A sparse terabyte and hard links cost a snapshot what they hold on the
    sandbox's tmpfs, not what they claim; a layer past the pool's snapshot budget, or
    deeper than the copy walks, is refused, and nothing of it is left."""
    from conftest import run
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local import LocalProvider
    with Sandbox(provider, "builtin:debian") as sb:
        sh(sb, "truncate -s 1T /root/sparse && head -c 4000000 /dev/urandom > /root/a && "
               "ln /root/a /root/b")
        snap = run(provider.snapshot(sb.id, "sparse-%s" % uuid.uuid4().hex[:6]))
    assert 4_000_000 <= snap.size_bytes < 5_000_000, snap
    with Sandbox(provider, snap.image) as fork:
        assert sh(fork, "stat -c '%s %h' /root/sparse /root/b") == "1099511627776 1\n4000000 2\n"
    small = LocalProvider(state_root=provider.state_root, cache_root=provider.cache_root,
                          snapshot_bytes=1_000_000).bind("budget-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(small, "builtin:debian") as sb:
            sh(sb, "head -c 3000000 /dev/urandom > /root/big")
            with pytest.raises(ProviderError, match="more than 1000000 bytes"):
                run(small.snapshot(sb.id, "too-big"))
            sh(sb, "rm /root/big; mkdir -p /root/$(yes d | head -300 | tr '\\n' /)")
            with pytest.raises(ProviderError, match="deeper than 256"):
                run(small.snapshot(sb.id, "too-deep"))
            assert run(small.snapshots()) == []
            store = os.path.join(small.snapshot_root, sb.info.node_id[:16], small.pool)
            assert os.listdir(store) == []
    finally:
        run(small.shutdown())


def test_a_file_swapped_for_a_fifo_under_the_copy_is_refused_not_waited_on(tmp_path):
    """The copy opens a file it found regular without blocking and checks it is still
    that file: a FIFO put in its place (a sandbox that was not frozen) fails the
    snapshot at once instead of hanging the agent's thread."""
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local.snapshots import Copy, _copy_file
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    looked = os.stat(tmp_path / "src" / "f")
    os.unlink(tmp_path / "src" / "f")
    os.mkfifo(tmp_path / "src" / "f")
    s_dir, d_dir = (os.open(tmp_path / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("src", "dst"))
    try:
        with pytest.raises(ProviderError, match="changed while it was copied"):
            _copy_file("f", s_dir, d_dir, looked, (0, 0), Copy(None))
    finally:
        os.close(s_dir)
        os.close(d_dir)


def test_the_snapshot_store_honours_no_setuid_bit_and_no_device(local_provider):
    """A snapshot keeps its files' bits, setuid-root copies of a tenant's included: the
    store is on a mount that honours neither setuid bits nor device nodes (the agent
    binds it so where its filesystem is not, as this disk's /tmp is not)."""
    from conftest import LOCAL_CACHE, LOCAL_STATE, run
    from sandman_ray.providers.local import LocalProvider
    root = tempfile.mkdtemp(prefix="sandman-store-", dir="/var/tmp")
    assert not os.statvfs(root).f_flag & os.ST_NOSUID  # the disk honours them
    p = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                      snapshot_root=root).bind("store-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(p, "builtin:debian"):
            flags = os.statvfs(root).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
    finally:
        run(p.shutdown())
        subprocess.run(["umount", root])
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("target", ["absolute", "relative", "layer/later"])
def test_a_snapshot_archive_may_link_only_to_its_own_files(tmp_path, target):
    """Archives pass between the pool's own agents; one crafted all the same may not
    make a hard link on the host to a host file, nor to a name it has not put there
    itself (yet), and nothing of it is left. The host file is the test's own 0600
    file: a link that got through would also take the member's mode and time, which
    the test sees (and no real file of the host pays for it)."""
    import io
    import tarfile
    from sandman_ray.providers.local.snapshots import SnapshotStore
    secret = tmp_path / "host" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"hunter2")
    secret.chmod(0o600)
    before = os.stat(secret)
    # a hard link's name is read from the directory the archive is unpacked in
    target = {"absolute": str(secret), "relative": "../../../host/secret"}.get(target, target)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("meta.json", b"{}"), ("layer/own", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        good = tarfile.TarInfo("layer/same")
        good.type, good.linkname = tarfile.LNKTYPE, "layer/own"
        tar.addfile(good)
        bad = tarfile.TarInfo("layer/stolen")
        bad.type, bad.linkname = tarfile.LNKTYPE, target
        tar.addfile(bad)
        later = tarfile.TarInfo("layer/later")
        later.size = 1
        tar.addfile(later, io.BytesIO(b"y"))
    store = SnapshotStore(tmp_path / "store", "pool")
    with pytest.raises(ValueError, match="'layer/stolen' links to .* not a file of the"):
        store.import_tar("crafted", buf.getvalue())
    assert not store.path("crafted").exists() and os.listdir(tmp_path / "store" / "pool") == []
    after = os.stat(secret)
    assert (after.st_mode, after.st_mtime_ns, after.st_nlink) == \
        (before.st_mode, before.st_mtime_ns, 1)
    honest = io.BytesIO()  # the same archive without the stolen link: a link of its own
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as src, \
            tarfile.open(fileobj=honest, mode="w") as tar:
        for member in src.getmembers():
            if member.name != "layer/stolen":
                tar.addfile(member, src.extractfile(member) if member.isreg() else None)
    store.import_tar("honest", honest.getvalue())
    layer = store.path("honest") / "layer"
    assert os.stat(layer / "same").st_ino == os.stat(layer / "own").st_ino
