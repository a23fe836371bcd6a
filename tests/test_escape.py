"""The escape suite: attacks a hostile agent would try from inside a sandbox, through
the daemon a lease talks to, each asserted to fail with the host unchanged. SECURITY.md
lists every attack with what stops it.

Sandboxes are real: LocalProvider sandboxes (bwrap on a local Ray) of the default
image, the ``host`` image (a read-only view of this machine) and a busybox rootfs, each
in a user namespace of its own; the same under gVisor; and DockerProvider containers
of the busybox image on a Podman API service (runc) that this module starts."""

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import uuid

import pytest

from conftest import Sandbox, wait_until
from sandman_ray import ProtocolError

IMAGES = ("default", "host", "busybox")
BOXES = IMAGES + ("docker",)  # and a DockerProvider container of the busybox image
DOCKER_IMAGE = "localhost/sandman-escape/busybox:1"
DOCKER_WORK = "/tmp/sandman-ray-test/escape-docker"


@pytest.fixture(scope="module")
def provider(local_provider):
    return local_provider


@pytest.fixture(scope="module")
def engine(provider, busybox_rootfs):
    """A Podman API service of this module's own (runc), the busybox image imported."""
    with podman_with_busybox("podman", busybox_rootfs) as service:
        yield service


@contextlib.contextmanager
def podman_with_busybox(name: str, busybox_rootfs, runtime: str = "runc"):
    from sandman_ray.providers.docker.podman_service import PodmanService
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: make test installs it (apt-get install podman)")
    service = PodmanService(os.path.join(DOCKER_WORK, name), runtime=runtime).start()
    try:
        service.import_rootfs(busybox_rootfs, DOCKER_IMAGE)
        yield service
    finally:
        service.stop()


def new_docker_provider(engine):
    from conftest import LOCAL_CACHE
    from sandman_ray.providers.docker import DockerProvider
    return DockerProvider(base_url=engine.base_url, state_root=os.path.join(DOCKER_WORK, "state"),
                          cache_root=LOCAL_CACHE)


@pytest.fixture(scope="module")
def docker_provider(engine):
    from conftest import run
    provider = new_docker_provider(engine).bind("escape-%s" % uuid.uuid4().hex[:6])
    yield provider
    run(provider.shutdown())


@pytest.fixture(scope="module")
def boxes(provider, busybox_rootfs):
    """One sandbox of each image, shared by the attacks that do not spoil it: the
    default (builtin:debian), the host's files, a busybox rootfs."""
    from sandman_ray.spec import DEFAULT_IMAGE
    with Sandbox(provider, DEFAULT_IMAGE) as default, Sandbox(provider, "host") as host, \
            Sandbox(provider, "dir:%s" % busybox_rootfs) as busybox:
        yield {"default": default, "host": host, "busybox": busybox}


@pytest.fixture(scope="module")
def docker_box(docker_provider):
    with Sandbox(docker_provider, DOCKER_IMAGE) as sb:
        yield sb


@pytest.fixture
def box(request):
    """The shared sandbox named by the test's parameter, with ``kind`` set to it."""
    if request.param == "docker":
        sb = request.getfixturevalue("docker_box")
    else:
        sb = request.getfixturevalue("boxes")[request.param]
    sb.kind = request.param
    return sb


def busybox_like(sb) -> bool:
    return sb.kind in ("busybox", "docker")


def sh(sb, cmd: str) -> str:
    r = sb.client.exec(["/bin/sh", "-c", cmd])
    return (r.stdout + r.stderr).decode()


def daemon_pid(sb) -> int:
    """The host pid of the sandbox's daemon (PID 1 inside): its container's first
    process, or the descendant of its launch chain whose command line names sandmand."""
    if "container" in sb.info.details:
        from sandman_ray.providers.docker.engine import engine_client
        engine = engine_client(sb.info.details["engine"])
        return engine.api.inspect_container(sb.info.details["container"])["State"]["Pid"]
    from sandbox_pids import daemon_under
    return daemon_under(sb.info.details["pid"])


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


def test_the_host_image_shows_only_what_any_user_may_read(boxes, tmp_path_factory):
    """``host`` is a read-only view of this machine: root inside has no say over the
    host's files, so /etc/shadow and a 0600 file in a 0700 directory stay closed."""
    secret_dir = "/var/tmp/sandman-secret-%s" % uuid.uuid4().hex[:6]
    os.mkdir(secret_dir, 0o700)
    try:
        with open(os.path.join(secret_dir, "key"), "w") as fh:
            fh.write("hunter2")
        os.chmod(os.path.join(secret_dir, "key"), 0o600)
        out = sh(boxes["host"], "cat /etc/shadow; echo rc=$?; cat %s/key; echo rc=$?; "
                                "ls %s; echo rc=$?" % (secret_dir, secret_dir))
        assert "root:" not in out and "hunter2" not in out and "rc=0" not in out
        assert out.count("Permission denied") == 3
    finally:
        subprocess.run(["rm", "-rf", secret_dir])


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


# ---------------------------------------------------------------- leases that end
def lease_pool(provider=None, **config):
    """A pool of one sandbox, of ``provider`` (a new LocalProvider by default)."""
    import sandman_ray as sandman
    from conftest import LOCAL_CACHE, LOCAL_STATE, unique_pool
    provider = provider or sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE)
    return unique_pool(provider, "lease", max_sandboxes=1, **config)


def kept_copy(sb):
    """Another reference to the handle, as a rollout worker that was passed it keeps."""
    import cloudpickle
    return cloudpickle.loads(cloudpickle.dumps(sb))


def next_tenant_is_safe_from(old, image, pool, error=None):
    """Lend the pool's one sandbox to a new tenant, which writes a secret; the ended
    handle ``old`` can neither read it nor write beside it (each call raises
    ``error``, LeaseEnded by default)."""
    import ray
    import sandman_ray as sandman
    error = error or sandman.LeaseEnded
    with sandman.sandbox(image, pool=pool, timeout=60) as new:
        ray.get(new.write_file.remote("/tmp/secret", b"tenant B"))
        for call in (lambda: old.exec.remote("cat /tmp/secret"),
                     lambda: old.write_file.remote("/tmp/from-a", b"A was here"),
                     lambda: old.read_file.remote("/tmp/secret")):
            with pytest.raises(error):
                ray.get(call())
        assert ray.get(new.exec.remote("ls /tmp")).stdout == b"secret\n"
        assert ray.get(new.read_file.remote("/tmp/secret")) == b"tenant B"


@pytest.mark.parametrize("kind", ("local", "docker"))
def test_a_released_lease_cannot_reach_the_next_tenant(request, provider, busybox_rootfs, kind):
    import ray
    import sandman_ray as sandman
    if kind == "docker":
        image = DOCKER_IMAGE
        pool = lease_pool(new_docker_provider(request.getfixturevalue("engine")))
    else:
        image = "dir:%s" % busybox_rootfs
        pool = lease_pool()
    try:
        sb = sandman.acquire(image, pool=pool)
        copy = kept_copy(sb)
        ray.get(copy.exec.remote("true"))
        sandman.release(sb)
        with pytest.raises(sandman.LeaseEnded, match="released"):
            ray.get(copy.exec.remote("true"))
        next_tenant_is_safe_from(copy, image, pool)
    finally:
        sandman.shutdown_pool(pool)


@pytest.mark.parametrize("limit", [{"ttl_s": 1.0}, {"idle_timeout_s": 10.0}])
def test_a_lease_ended_by_ttl_or_idleness_cannot_reach_the_next_tenant(provider, busybox_rootfs,
                                                                       limit):
    import ray
    import sandman_ray as sandman
    from conftest import wait_until
    from sandman_ray.spec import SandboxSpec
    spec = SandboxSpec(image="dir:%s" % busybox_rootfs, **limit)
    pool = lease_pool()
    try:
        sb = sandman.acquire(spec, pool=pool)
        ray.get(sb.exec.remote("true"))
        leased = lambda: ray.get(sandman.get_pool(pool).status.remote())["states"]["leased"]
        wait_until(lambda: leased() == 0, timeout=30, what="the pool to end the lease")

        def refused() -> bool:  # the pool's word reaches the host within moments
            try:
                ray.get(sb.exec.remote("true"))  # before it, the sandbox is still unlent
                return False
            except sandman.LeaseEnded as exc:
                assert ("TTL" if "ttl_s" in limit else "idle") in str(exc)
                return True
        wait_until(refused, timeout=10, what="the handle to learn that its lease ended")
        next_tenant_is_safe_from(sb, spec.image, pool)  # a tenant whose lease lasts
    finally:
        sandman.shutdown_pool(pool)


def test_a_lease_ended_by_a_pool_restart_cannot_reach_the_next_tenant(provider, busybox_rootfs):
    """The pool dies with a lease whose record it had not yet written (as when it dies
    right after lending): the restarted pool starts that sandbox afresh before lending
    it, so the old handle's connections and token are worthless."""
    import ray
    import sandman_ray as sandman
    from ray.experimental import internal_kv
    from conftest import wait_until
    image = "dir:%s" % busybox_rootfs
    pool = lease_pool()
    try:
        sb = sandman.acquire(image, pool=pool)
        ray.get(sb.exec.remote("true"))
        for key in internal_kv._internal_kv_list("pool:%s:" % pool, namespace="sandman"):
            internal_kv._internal_kv_del(key, namespace="sandman")
        ray.kill(sandman.get_pool(pool), no_restart=False)
        wait_until(lambda: _settled(pool), timeout=60,
                   what="the restarted pool to start its sandbox afresh or delete it")
        with pytest.raises(sandman.SandboxLost):  # LeaseEnded, or the sandbox's restart
            ray.get(sb.exec.remote("true"))
        # the new pool never knew the lease: the old handle learns only that its
        # sandbox is gone (a new one, or the same one with a new token)
        next_tenant_is_safe_from(sb, image, pool, sandman.SandboxLost)
    finally:
        sandman.shutdown_pool(pool)


def _settled(pool) -> bool:
    """Whether the pool answers and each of its sandboxes is READY (started afresh)
    or deleted: none is still as the old pool left it."""
    import ray
    import sandman_ray as sandman
    try:
        ray.get(sandman.get_pool(pool).status.remote(), timeout=5)  # recovered by then
        listing = ray.get(sandman.get_pool(pool).list_sandboxes.remote(), timeout=5)
    except (ray.exceptions.RayError, TimeoutError):
        return False
    return all(entry["state"] == "ready" for entry in listing)


def test_a_release_by_a_caller_that_does_not_hold_the_lease_is_refused(provider,
                                                                        busybox_rootfs):
    """Whoever reads the pool's listing learns no lease id, and even with one, only
    the handle host that holds a lease may release it."""
    import ray
    import sandman_ray as sandman
    pool = lease_pool()
    try:
        sb = sandman.acquire("dir:%s" % busybox_rootfs, pool=pool)
        listing = ray.get(sandman.get_pool(pool).list_sandboxes.remote())
        assert sb.lease_id not in repr(listing)
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(sandman.get_pool(pool).release.remote(sb.lease_id))
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(sandman.get_pool(pool).release.remote(sb.lease_id, "sandman:sbx:thief"))
        assert ray.get(sb.exec.remote("echo still mine")).stdout == b"still mine\n"
        sandman.release(sb)
    finally:
        sandman.shutdown_pool(pool)


# ---------------------------------------------------------------- the daemon's door
def rss_kb(pid: int) -> int:
    with open("/proc/%d/status" % pid) as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_unauthenticated_frames_cannot_grow_the_daemon(daemon):
    """Thirty clients that never say hello each announce an 8 MiB frame and send it:
    the daemon refuses each at its header, stays under 1 MB more per connection, and
    answers an authenticated ping at once."""
    import struct
    from test_daemon_protocol import raw_socket, read_frame
    before = rss_kb(daemon.pid)
    body = b"\x81\xa2op\xa4ping" + b"\0" * (8 * 2 ** 20)
    socks = []
    for _ in range(30):
        sock = raw_socket(daemon, hello=False)
        try:
            sock.sendall(struct.pack(">I", len(body)) + body)
        except OSError:  # closed by the daemon while we sent: as it should
            pass
        socks.append(sock)
    for sock in socks:
        reply = read_frame(sock)
        assert reply is None or (reply["error"]["type"] == "ProtocolError"
                                 and "exceeds" in reply["error"]["message"])
        sock.close()
    assert rss_kb(daemon.pid) - before < 30 * 1024
    with daemon.client() as c:
        assert c.ping() is None


def test_connections_that_never_say_hello_are_capped(daemon):
    from test_daemon_protocol import raw_socket, read_frame
    from sandman_ray.daemon.sandmand import MAX_UNAUTHENTICATED
    waiting = [raw_socket(daemon, hello=False) for _ in range(MAX_UNAUTHENTICATED)]
    try:
        extra = raw_socket(daemon, hello=False)
        reply = read_frame(extra)
        assert reply["error"]["type"] == "LimitExceeded" and "hello" in reply["error"]["message"]
        extra.close()
        waiting.pop().close()  # one of the waiting ones leaves: a new client gets in

        def gets_in():
            try:
                with daemon.client() as c:
                    return c.ping() is None
            except ProtocolError:  # the daemon has not yet seen the close
                return False
        wait_until(gets_in, what="a client to get in once a waiting one left")
    finally:
        for sock in waiting:
            sock.close()


def test_uploads_belong_to_their_connection_and_end_with_it(daemon, tmp_path):
    """64 uploads begun on connections that then closed used to block put_archive until
    a reset and keep their spool files: now they end with their connections, and no
    other connection can write into one."""
    import io
    import tarfile
    from sandman_ray import DaemonError
    fds_before = len(os.listdir("/proc/%d/fd" % daemon.pid))
    for _ in range(70):
        with daemon.client() as c:
            upload = c._call("tar_put_begin", {"path": str(tmp_path / "up")})["upload"]
    with daemon.client() as owner, daemon.client() as other:
        upload = owner._call("tar_put_begin", {"path": str(tmp_path / "up")})["upload"]
        with pytest.raises(DaemonError, match="UploadNotFound"):
            other._call("tar_put_data", {"upload": upload, "data": b"x"})
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("f")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"ok"))
        other.put_archive(str(tmp_path / "up2"), buf.getvalue())
    assert (tmp_path / "up2" / "f").read_bytes() == b"ok"
    wait_until(lambda: len(os.listdir("/proc/%d/fd" % daemon.pid)) <= fds_before,
               what="the daemon to close the connections' spool files")


def test_a_listing_larger_than_a_frame_is_truncated_not_refused(daemon, tmp_path):
    """20,000 symlinks with 4 KiB targets made an 81 MB reply that no client takes: the
    listing now stops at what fits, and says so."""
    where = tmp_path / "links"
    where.mkdir()
    target = "t" * 4000
    for i in range(20000):
        os.symlink(target, where / ("l%05d" % i))
    with daemon.client() as c:
        listing = c.list_dir(str(where))
        assert listing.truncated and 0 < len(listing) < 20000
        assert all(e.target == target for e in listing)
        first = c.list_dir(str(where), limit=5)
        assert first.truncated and len(first) == 5


def test_names_that_are_not_utf8_come_back_as_bytes(daemon, tmp_path):
    (tmp_path / "plain").write_text("x")
    with open(os.path.join(os.fsencode(tmp_path), b"bad-\xff\xfe"), "w") as fh:
        fh.write("x")
    with daemon.client() as c:
        names = [e.name for e in c.list_dir(str(tmp_path))]
    assert "plain" in names and b"bad-\xff\xfe" in names


# ---------------------------------------------------------------- the network
@pytest.fixture(scope="module")
def listener():
    """A TCP server on every address of this host (loopback and the node's own, where
    Ray's GCS listens too): what a sandbox with network must not reach."""
    import socket
    import threading
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(64)
    accepted = []

    def serve():
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.sendall(b"host secret\n")
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], accepted
    server.close()


# "open" once a TCP connection was made: busybox's nc in the busybox image, python3 in
# the others (the Debian image has no nc)
CONNECT = ("busybox --list | grep -qx nc || echo no-nc; "
           "for h in %s; do if echo | busybox nc -w 2 $h %d >/dev/null 2>&1; then "
           "echo open $h; else echo closed $h; fi; done")
CONNECT_PY = ("python3 -c 'import socket, sys\n"
              "for h in sys.argv[2:]:\n"
              "    s = socket.socket(); s.settimeout(2)\n"
              "    try: s.connect((h, int(sys.argv[1]))); print(\"open\", h)\n"
              "    except OSError: print(\"closed\", h)' %d %s")


def connect(image: str, hosts, port: int) -> str:
    hosts = " ".join(hosts) if not isinstance(hosts, str) else hosts
    return CONNECT % (hosts, port) if image == "busybox" else CONNECT_PY % (port, hosts)


def node_addresses():
    from sandman_ray.providers.network import host_addresses
    return [a for a in host_addresses() if not a.startswith("127.")]


def provider_and_image(request, kind: str, busybox_rootfs):
    """A LocalProvider and the busybox rootfs, or a DockerProvider and its busybox image."""
    if kind == "docker":
        return request.getfixturevalue("docker_provider"), DOCKER_IMAGE
    return request.getfixturevalue("provider"), "dir:%s" % busybox_rootfs


@pytest.mark.parametrize("image", BOXES)
def test_a_sandbox_with_network_reaches_nothing_of_the_host(request, busybox_rootfs,
                                                            listener, image):
    """Through slirp's gateway (the host's loopback), the host's loopback itself, and
    every address of this node (Ray's GCS port among them): all refused, and the
    host's server saw no connection."""
    import ray
    from sandman_ray.spec import SandboxSpec
    port, accepted = listener
    where, location = provider_and_image(request, image, busybox_rootfs)  # Ray is up after
    gcs_port = int(ray.get_runtime_context().gcs_address.rpartition(":")[2])
    targets = ["10.0.2.2", "127.0.0.1"] + node_addresses()
    images = {"default": SandboxSpec().image, "host": "host"}
    spec = SandboxSpec(image=images.get(image, location), network=True)
    shell = "busybox" if image == "docker" else image
    before = len(accepted)
    with Sandbox(where, spec) as sb:
        out = sh(sb, connect(shell, targets, port))
        assert "no-nc" not in out and "open" not in out, out
        assert out.count("closed") == len(targets), out
        out = sh(sb, connect(shell, node_addresses(), gcs_port))
        assert "open" not in out, out
    assert len(accepted) == before


@pytest.mark.parametrize("kind", ("local", "docker"))
def test_network_allow_opens_exactly_what_it_names(request, busybox_rootfs, listener, kind):
    """The same path works once the spec allows the node's address: the filter, not a
    broken stack, is what refuses the rest."""
    from sandman_ray.spec import SandboxSpec
    port, accepted = listener
    node = node_addresses()[0]
    where, image = provider_and_image(request, kind, busybox_rootfs)
    spec = SandboxSpec(image=image, network=True, network_allow=[node])
    before = len(accepted)
    with Sandbox(where, spec) as sb:
        r = sb.client.exec(["/bin/sh", "-c", "busybox nc -w 2 %s %d </dev/null" % (node, port)])
        assert r.stdout == b"host secret\n"
        assert "closed" in sh(sb, connect("busybox", "10.0.2.2", port))
    assert len(accepted) == before + 1


@pytest.mark.parametrize("kind", ("local", "docker"))
def test_root_inside_cannot_lift_the_network_filter(request, busybox_rootfs, kind):
    from sandman_ray.spec import SandboxSpec
    where, image = provider_and_image(request, kind, busybox_rootfs)
    with Sandbox(where, SandboxSpec(image=image, network=True)) as sb:
        out = sh(sb, "ip addr add 10.0.2.50/24 dev tap0; echo rc=$?; ip link set tap0 down; "
                     "echo rc=$?; ip route del default; echo rc=$?; "
                     "busybox iptables -F; echo rc=$?")
        assert "rc=0" not in out and "Operation not permitted" in out
        rules = subprocess.run(["nsenter", "--net=/proc/%d/ns/net" % daemon_pid(sb),
                                "iptables-legacy-save"], capture_output=True, text=True).stdout
        assert "-A OUTPUT -d 169.254.0.0/16 -j REJECT" in rules
        assert "-A OUTPUT -d 10.0.0.0/8 -j REJECT" in rules


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


# ---------------------------------------------------------------- under gVisor
@pytest.fixture(scope="module")
def gvisor_box(local_provider):
    """A builtin:debian sandbox of LocalProvider(isolation="gvisor") on the same Ray."""
    import sandman_ray as sandman
    from conftest import LOCAL_CACHE, LOCAL_STATE, run
    from sandman_ray.spec import DEFAULT_IMAGE
    if shutil.which("runsc") is None:
        pytest.fail("runsc is missing: make test installs it (apt-get install runsc)")
    provider = sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                                     isolation="gvisor").bind("gvisor-%s" % uuid.uuid4().hex[:6])
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        yield sb, provider
    run(provider.shutdown())


def test_gvisor_runs_the_same_daemon_under_its_own_kernel(gvisor_box):
    sb, _ = gvisor_box
    assert sb.info.details["isolation"] == "gvisor"
    assert sh(sb, "uname -r").strip() != os.uname().release  # gVisor's, not the host's
    assert sb.client.exec("python3 -c 'print(6 * 7)'").stdout == b"42\n"
    sb.client.run("cd /tmp && export A=1")
    assert sb.client.run("echo $A $(pwd)").stdout == b"1 /tmp\n"
    sb.client.write_file("/root/x", b"data")
    assert sb.client.read_file("/root/x") == b"data"


def test_under_gvisor_the_host_kernel_and_files_are_out_of_reach(gvisor_box):
    """/proc/sys, the host's processes and the image on the host's disk: the attacks
    land in gVisor's kernel and in the sandbox's memory, never on the host."""
    from sandman_ray.images import ImageCache
    from conftest import LOCAL_CACHE
    sb, _ = gvisor_box
    before = open("/proc/sys/kernel/core_pattern").read()
    me = os.getpid()
    out = sh(sb, "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern; echo rc=$?; "
                 "kill -0 %d; echo rc=$?; echo pwned > /etc/passwd; echo wrote=$?; "
                 "mknod /tmp/mem c 1 1 && head -c 1 /tmp/mem; echo rc=$?" % me)
    assert "rc=0" not in out and "wrote=0" in out, out
    assert open("/proc/sys/kernel/core_pattern").read() == before
    rootfs = ImageCache(os.path.join(LOCAL_CACHE, "images")).prepare("builtin:debian").rootfs
    assert b"pwned" not in (rootfs / "etc" / "passwd").read_bytes()


def test_under_gvisor_the_one_host_directory_cannot_fill_the_hosts_disk(gvisor_box):
    """/run/sandman, where the daemon's socket is a host socket, is the only directory
    the sandbox writes on the host's side: a 1 MiB tmpfs of the chain's own."""
    sb, _ = gvisor_box
    free = shutil.disk_usage("/tmp").free
    out = sh(sb, "dd if=/dev/zero of=/run/sandman/fill bs=1M count=64 2>&1; echo rc=$?; "
                 "rm -f /run/sandman/fill")
    assert "No space left on device" in out and "rc=0" not in out, out
    assert abs(shutil.disk_usage("/tmp").free - free) < 16 * 2 ** 20
    assert sb.client.exec("echo fine").stdout == b"fine\n"


def test_under_gvisor_a_sandbox_with_network_reaches_nothing_of_the_host(gvisor_box, listener):
    """gVisor's sandbox calls the host's sockets of its own filtered namespace
    (runsc --network=host there), so the same filter holds: the host's loopback, slirp's
    gateway and the node's addresses are refused, and ``network_allow`` opens exactly
    the address it names."""
    from sandman_ray.spec import DEFAULT_IMAGE, SandboxSpec
    _, provider = gvisor_box
    port, accepted = listener
    before = len(accepted)
    targets = ["10.0.2.2", "127.0.0.1"] + node_addresses()
    with Sandbox(provider, SandboxSpec(image=DEFAULT_IMAGE, network=True)) as sb:
        assert sb.info.details["isolation"] == "gvisor"
        out = sh(sb, connect("default", targets, port))
        assert "open" not in out and out.count("closed") == len(targets), out
    assert len(accepted) == before
    node = node_addresses()[0]
    with Sandbox(provider, SandboxSpec(image=DEFAULT_IMAGE, network=True,
                                       network_allow=[node])) as sb:
        out = sh(sb, connect("default", [node, "10.0.2.2"], port))
        assert out == "open %s\nclosed 10.0.2.2\n" % node, out
    assert len(accepted) == before + 1


def test_gvisor_refuses_the_host_image_and_says_why(gvisor_box):
    from sandman_ray.errors import ProviderError
    from conftest import new_id, run
    _, provider = gvisor_box
    with pytest.raises(ProviderError, match="under gVisor a sandbox needs an image"):
        run(provider.create(new_id(), __import__("sandman_ray").SandboxSpec(image="host"), {}))


@pytest.fixture(scope="module")
def gvisor_container(provider, busybox_rootfs):
    """A DockerProvider container of the busybox image under gVisor: a Podman service of
    its own whose runtime is runsc (PodmanService(runtime="runsc"))."""
    from conftest import LOCAL_CACHE, run
    from sandman_ray.providers.docker import DockerProvider
    with podman_with_busybox("podman-runsc", busybox_rootfs, runtime="runsc") as service:
        gvisor = DockerProvider(base_url=service.base_url, runtime="runsc",
                                state_root=os.path.join(DOCKER_WORK, "state-runsc"),
                                cache_root=LOCAL_CACHE).bind("runsc-%s" % uuid.uuid4().hex[:6])
        try:
            with Sandbox(gvisor, DOCKER_IMAGE) as sb:
                yield sb, gvisor
        finally:
            run(gvisor.shutdown())


def test_a_container_under_gvisor_runs_the_daemon_under_its_own_kernel(gvisor_container):
    sb, _ = gvisor_container
    assert sb.info.details["runtime"] == "runsc"
    assert sh(sb, "uname -r").strip() != os.uname().release
    before = open("/proc/sys/kernel/core_pattern").read()
    out = sh(sb, "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern; echo rc=$?; "
                 "kill -0 %d; echo rc=$?; mknod /tmp/mem c 1 1 && head -c 1 /tmp/mem; "
                 "echo rc=$?" % os.getpid())
    assert "rc=0" not in out, out
    assert open("/proc/sys/kernel/core_pattern").read() == before
    sb.client.write_file("/root/x", b"data")
    assert sb.client.read_file("/root/x") == b"data"


def test_a_container_under_gvisor_with_network_is_refused_and_says_why(gvisor_container):
    from sandman_ray.errors import ProviderError
    from sandman_ray.spec import SandboxSpec
    from conftest import new_id, run
    _, gvisor = gvisor_container
    with pytest.raises(ProviderError, match="under gVisor through Podman a container has no "
                                            "network"):
        run(gvisor.create(new_id(), SandboxSpec(image=DOCKER_IMAGE, network=True), {}))


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


def test_a_sparse_terabyte_cannot_fill_the_readers_memory(daemon, tmp_path):
    """A file that costs its sandbox nothing (sparse) but would cost whoever reads it a
    terabyte: read_file and get_archive stop at max_bytes with a clear error."""
    from sandman_ray import ResultTooLarge
    huge = tmp_path / "out.txt"
    with open(huge, "wb") as fh:
        fh.truncate(1 << 40)
    with daemon.client() as c:
        with pytest.raises(ResultTooLarge, match="max_bytes"):
            c.read_file(str(huge), max_bytes=64 << 20)
        (tmp_path / "small").write_bytes(b"x" * 100)
        assert c.read_file(str(tmp_path / "small"), max_bytes=100) == b"x" * 100
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "f").write_bytes(b"y" * (3 << 20))
        with pytest.raises(ResultTooLarge, match="max_bytes"):
            c.get_archive(str(tmp_path / "d"), max_bytes=1 << 20)


def test_the_network_filter_refuses_the_clusters_other_nodes_too():
    """A public address of another Ray node (its GCS, its raylet) is as closed as this
    host's own; the spec's network_allow comes first and may open it."""
    from sandman_ray.providers.network import ruleset
    rules = ruleset(allow=("198.51.100.9/32",), neighbours=("203.0.113.7",)).splitlines()
    assert "-A OUTPUT -d 203.0.113.7/32 -j REJECT" in rules
    assert rules.index("-A OUTPUT -d 198.51.100.9/32 -j ACCEPT") < rules.index(
        "-A OUTPUT -d 203.0.113.7/32 -j REJECT")


# ---------------------------------------------------------------- an agent that is not root
NOBODY = 65534


def run_as_nobody(work: str, port: int, targets) -> dict:
    """tests/unprivileged_agent.py run as nobody, its JSON. The interpreter, the
    virtualenv's packages and the checkout stay where root put them (perhaps under a
    0700 home): a private mount namespace binds them read-only where nobody may read
    them, and nobody runs the same code from there."""
    import json
    import site
    import sys
    from conftest import ROOT
    python = os.path.realpath(sys.executable)
    base = os.path.realpath(sys.base_prefix)
    mnt = tempfile.mkdtemp(prefix="sandman-nobody-")
    os.chmod(mnt, 0o755)
    try:
        for sub in ("python", "site", "repo", "pkgs/sandman_ray"):
            os.makedirs(os.path.join(mnt, sub))
        for entry in os.listdir(ROOT / "sandman_ray"):  # the package as installed maps it
            os.symlink(os.path.join(mnt, "repo", "sandman_ray", entry),
                       os.path.join(mnt, "pkgs", "sandman_ray", entry))
        os.symlink(os.path.join(mnt, "repo", "daemon"),
                   os.path.join(mnt, "pkgs", "sandman_ray", "daemon"))
        script = ("mount --bind -o ro %s %s/python && mount --bind -o ro %s %s/site && "
                  "mount --bind -o ro %s %s/repo && exec setpriv --reuid %d --regid %d "
                  "--clear-groups env -i HOME=%s PATH=/usr/sbin:/usr/bin:/sbin:/bin "
                  "PYTHONHOME=%s/python PYTHONPATH=%s/pkgs:%s/site:%s/repo/tests %s/python/%s "
                  "%s/repo/tests/unprivileged_agent.py %s %d %s" % (
                      base, mnt, site.getsitepackages()[0], mnt, ROOT, mnt, NOBODY, NOBODY,
                      work, mnt, mnt, mnt, mnt, mnt, os.path.relpath(python, base), mnt, work,
                      port, " ".join(targets)))
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(mnt)


def test_an_agent_that_is_not_root_holds_its_sandboxes_too(listener):
    """A LocalProvider agent run as nobody cannot map a range of ids: each sandbox is a
    user namespace of the agent's uid alone. The attacks fail there as well: root
    inside is nobody on the host, /proc/sys stays read-only, no device nodes and no
    nested namespaces, the disk and process limits hold, the host's secrets stay
    closed, and with network=True the filter refuses the host and cannot be lifted.
    /dev/net/tun, which slirp4netns opens as the agent's user, is 0600 on some hosts
    (Debian's udev makes it 0666): the test makes it 0666 while it runs, and puts the
    mode back."""
    port, accepted = listener
    work = "/tmp/sandman-ray-test/nobody-%s" % uuid.uuid4().hex[:6]
    os.makedirs(work, mode=0o700)
    os.chown(work, NOBODY, NOBODY)
    tun_mode = stat.S_IMODE(os.stat("/dev/net/tun").st_mode)
    before = len(accepted)
    try:
        os.chmod("/dev/net/tun", 0o666)
        out = run_as_nobody(work, port, node_addresses())
    finally:
        os.chmod("/dev/net/tun", tun_mode)
        subprocess.run(["rm", "-rf", work])
    assert out["agent_uid"] == NOBODY
    assert out["daemon_ids"] == [[str(NOBODY)] * 4] * 2 and out["id"] == "0\n0\n"
    assert "rc=0" not in out["proc_sys"] and "Read-only file system" in out["proc_sys"]
    assert "made" in out["setuid"] and out["setuid_on_host"][0] == NOBODY
    assert "rc=0" not in out["mknod"] and "Operation not permitted" in out["mknod"]
    assert "rc=0" not in out["unshare"]
    assert "No space left on device" in out["disk"]
    assert out["forks"] == "forked\n"  # 80 other processes of the uid do not count
    assert "can't fork" in out["fork_bomb"] or "Resource temporarily" in out["fork_bomb"]
    assert out["still"] == "still answering\n"
    assert "root:" not in out["shadow"] and "Permission denied" in out["shadow"]
    assert "rc=0" not in out["kill_host"]
    assert "network_error" not in out, out.get("network_error")
    assert "open" not in out["network"] and out["network"].count("closed") == \
        2 + len(node_addresses()), out["network"]
    assert "rc=0" not in out["lift_filter"]
    assert len(accepted) == before
