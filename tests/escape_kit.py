"""What the escape suite's modules share: the sandboxes they attack (LocalProvider
sandboxes of the default image, the ``host`` image and a busybox rootfs, each in a user
namespace of its own; DockerProvider containers of the busybox image on a Podman API
service that the module using them starts) and small helpers."""

import contextlib
import os
import shutil
import uuid

import pytest

from conftest import Sandbox

# "fork": a sandbox started from a snapshot of a default-image sandbox that wrote and
# deleted files (its overlay stacks the snapshot's layer over the image)
IMAGES = ("default", "host", "busybox", "fork")
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
    default (builtin:debian), the host's files, a busybox rootfs, and a fork: a sandbox
    started from a snapshot of another default one."""
    from sandman_ray.spec import DEFAULT_IMAGE
    with Sandbox(provider, DEFAULT_IMAGE) as default, Sandbox(provider, "host") as host, \
            Sandbox(provider, "dir:%s" % busybox_rootfs) as busybox, \
            Sandbox(provider, fork_image(provider)) as fork:
        yield {"default": default, "host": host, "busybox": busybox, "fork": fork}


def fork_image(provider) -> str:
    """A snapshot of a default-image sandbox that made, changed and deleted files (the
    snapshot's layer holds files, a whiteout and an opaque directory); its image."""
    from conftest import run
    from sandman_ray.spec import DEFAULT_IMAGE
    with Sandbox(provider, DEFAULT_IMAGE) as parent:
        sh(parent, "mkdir -p /work && echo parent > /work/file && rm /etc/hostname && "
                   "rm -r /etc/default && mkdir /etc/default && echo new > /etc/default/x")
        name = "escape-%s" % uuid.uuid4().hex[:6]
        return run(provider.snapshot(parent.id, name)).image


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


@contextlib.contextmanager
def host_secrets():
    """Files of host root that no other user may read, for a sandbox to try: a 0600
    file in a 0700 directory and a 0640 file (as /etc/shadow is on Debian) in /var/tmp,
    which a ``host`` image shows. /etc/shadow joins them only where nobody on the host
    cannot read it (a host whose own mode opens it proves nothing of a sandbox)."""
    import subprocess
    tag = uuid.uuid4().hex[:6]
    secret_dir = "/var/tmp/sandman-secret-%s" % tag
    shadow_like = "/var/tmp/sandman-shadow-%s" % tag
    os.mkdir(secret_dir, 0o700)
    try:
        for path, mode in ((os.path.join(secret_dir, "key"), 0o600), (shadow_like, 0o640)):
            with open(path, "w") as fh:
                fh.write("root:hunter2\n")
            os.chmod(path, mode)
        paths = [os.path.join(secret_dir, "key"), shadow_like]
        probe = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                                "--clear-groups", "cat", "/etc/shadow"], capture_output=True)
        assert probe.returncode != 0 or b"root:" in probe.stdout, probe  # it did run
        if probe.returncode != 0:
            paths.append("/etc/shadow")
        yield paths
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shadow_like)


def read_each(paths) -> str:
    """The shell that reads each of ``paths`` and says its exit status."""
    return "".join("cat %s; echo rc=$?; " % path for path in paths)


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
