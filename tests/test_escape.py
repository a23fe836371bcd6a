"""The escape suite: attacks a hostile agent would try from inside a sandbox, through
the daemon a lease talks to, each asserted to fail with the host unchanged. SECURITY.md
lists every attack with what stops it. This module: users, files, devices, processes,
the token and the limits; ``test_escape_leases.py``: leases that end and the daemon's
door; ``test_escape_network.py``: the network, gVisor and an agent that is not root;
``test_escape_snapshots.py``: what a snapshot copies and what it costs.
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
