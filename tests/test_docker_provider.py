"""DockerProvider against a real Podman API service (the Docker Engine API) started for
this module on a private socket and storage, with a real registry (Debian's
docker-registry) on loopback for pulls, on a real local Ray."""

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import ray

import sandman_ray as sandman
from sandman_ray import DaemonClient, ProviderError
from sandman_ray.image_builders import write_oci_layout
from sandman_ray.providers.base import POOL_LABEL
from sandman_ray.providers.docker import DockerProvider
from sandman_ray.providers.docker.engine import (
    engine_client, engine_error, list_containers, pull_error)
from sandman_ray.providers.docker.podman_service import PodmanError, PodmanService
from sandman_ray.spec import SandboxSpec
from conftest import (
    ROOT, exercise_handle, free_port, holding_driver, restart_keeps_specs, unique_pool,
    wait_until)

WORK = Path("/tmp/sandman-ray-test/docker")
STATE = str(WORK / "state")
CACHE = str(ROOT / ".cache" / "provider")
BUSYBOX = "localhost/sandman-test/busybox:1"
CONFIGURED = "localhost/sandman-test/configured:1"


class Registry:
    """Debian's docker-registry (the distribution registry) on loopback over HTTP, its
    access log kept so a test can count what was fetched."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.location = "127.0.0.1:%d" % self.port
        self.log_path = root / "registry.log"

    def start(self) -> "Registry":
        binary = shutil.which("docker-registry")
        if binary is None:
            pytest.skip("docker-registry is not installed (make test installs it)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(textwrap.dedent("""\
            version: 0.1
            log: {level: info, accesslog: {disabled: false}}
            storage: {filesystem: {rootdirectory: %s}, delete: {enabled: true}}
            http: {addr: "%s"}
        """ % (self.root / "data", self.location)))
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def answers():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_until(answers, timeout=20, what="the registry to listen")
        return self

    def blob_gets(self):
        """Digests of the blobs fetched with GET so far, one entry per fetch."""
        text = self.log_path.read_text(errors="replace")
        return re.findall(r'"GET /v2/[^ ]*/blobs/(sha256:[0-9a-f]{64}) HTTP[^"]*" 200', text)

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def registry():
    shutil.rmtree(WORK / "registry", ignore_errors=True)
    reg = Registry(WORK / "registry").start()
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def engine(registry, busybox_rootfs):
    """A Podman service with the busybox test images imported."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (make test installs it)")
    service = PodmanService(WORK / "podman", insecure_registries=[registry.location])
    try:
        service.start()
    except PodmanError as exc:
        pytest.skip("the Podman API service cannot start here: %s" % exc)
    try:
        service.import_rootfs(busybox_rootfs, BUSYBOX)
        service.import_rootfs(busybox_rootfs, CONFIGURED, changes=[
            "ENV FROM_IMAGE=yes", "WORKDIR /home", "USER nobody",
            'ENTRYPOINT ["/bin/false"]', 'CMD ["never"]'])
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def cluster(engine):
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-docker-tests")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def make_provider(engine, **kw):
    return DockerProvider(base_url=engine.base_url, state_root=STATE, cache_root=CACHE, **kw)


def make_pool(engine, **config):
    return unique_pool(make_provider(engine), "d", **config)


def containers(engine, pool):
    """What the engine itself runs for ``pool``, by label."""
    return list_containers(engine_client(engine.base_url), ["%s=%s" % (POOL_LABEL, pool)])


def run(coro):
    return asyncio.run(coro)


def test_sandbox_serves_exec_sessions_files_and_processes_then_is_removed(cluster, engine):
    pool = make_pool(engine, reuse="delete")
    try:
        with sandman.sandbox(BUSYBOX, pool=pool) as sb:
            exercise_handle(sb)
            info = ray.get(sb.info.remote())
            assert info["pid"] == 1 and info["os_release"]["ID"] == "busybox"
            assert len(containers(engine, pool)) == 1
        wait_until(lambda: containers(engine, pool) == [], timeout=10,
                   what="the released sandbox's container to be removed")
    finally:
        sandman.shutdown_pool(pool)


def test_image_env_workdir_and_user_are_honoured_and_its_entrypoint_not_run(cluster, engine):
    provider = make_provider(engine).bind("cfg-" + uuid.uuid4().hex[:6])
    info = run(provider.create("s1", SandboxSpec(image=CONFIGURED), {}))
    try:
        client = DaemonClient(info.address, info.token)
        assert client.exec("id -u; pwd; echo $FROM_IMAGE").text.split() == ["65534", "/home", "yes"]
        # ours is PID 1 (the image's entrypoint would have exited at once)
        assert client.info()["pid"] == 1
        client.close()
        spec = SandboxSpec(image=CONFIGURED, user="4242:4242", workdir="/tmp", env={"A": "b"})
        other = run(provider.create("s2", spec, {}))
        client = DaemonClient(other.address, other.token)
        assert client.exec("id -u; pwd; echo $A $FROM_IMAGE").text.split() == [
            "4242", "/tmp", "b", "yes"]
        client.close()
    finally:
        deleted = run(provider.shutdown())
    assert deleted == 2


def test_no_network_and_limits_from_the_spec(cluster, engine):
    provider = make_provider(engine).bind("lim-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=BUSYBOX, cpu=0.5, memory="128Mi", pids=50)
    try:
        info = run(provider.create("s1", spec, {}))
        client = DaemonClient(info.address, info.token)
        devices = client.exec("cat /proc/net/dev").text
        assert "lo:" in devices and "eth0" not in devices
        cgroup = client.info()["limits"]["cgroup"]
        assert cgroup["memory_max"] == str(128 * 2 ** 20)
        assert cgroup["pids_max"] == "50"
        assert cgroup["cpu_quota_us"] == "50000"
        client.close()
    finally:
        run(provider.shutdown())


def test_tcp_transport_with_a_network(cluster, engine):
    provider = make_provider(engine, transport="tcp").bind("tcp-" + uuid.uuid4().hex[:6])
    try:
        with pytest.raises(ProviderError, match="needs SandboxSpec\\(network=True\\)") as err:
            run(provider.create("s0", SandboxSpec(image=BUSYBOX), {}))
        assert err.value.kind == "fatal"
        info = run(provider.create("s1", SandboxSpec(image=BUSYBOX, network=True), {}))
        assert info.address.startswith("tcp:")
        client = DaemonClient(info.address, info.token)
        assert client.exec("cat /proc/net/dev").text.count("tap0") == 1  # slirp4netns
        client.close()
        with pytest.raises(sandman.AuthError):
            DaemonClient(info.address, "0" * 32).ping()
    finally:
        run(provider.shutdown())


def test_reset_starts_a_fresh_container_and_create_is_idempotent(cluster, engine):
    provider = make_provider(engine).bind("rst-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=BUSYBOX)
    try:
        first, again = run(_twice(provider, "s1", spec))
        assert first.details["container"] == again.details["container"]
        later = run(provider.create("s1", spec, {}))  # a retry after the first finished
        assert (later.details["container"], later.token) == (first.details["container"],
                                                             first.token)
        # any user on the host may connect (the token guards it); nothing else is
        # in the directory the sandbox can write to
        sock = Path(first.address[len("unix:"):])
        assert os.stat(sock).st_mode & 0o777 == 0o666
        assert os.listdir(sock.parent) == ["sock"]
        client = DaemonClient(first.address, first.token)
        client.exec("echo dirty > /tmp/mark")
        client.close()
        fresh = run(provider.reset("s1"))
        assert fresh.details["container"] != first.details["container"]
        client = DaemonClient(fresh.address, fresh.token)
        assert client.exec("cat /tmp/mark").exit_code != 0
        client.close()
        assert len(run(provider.list())) == 1
    finally:
        run(provider.shutdown())


def test_a_restarted_pool_keeps_each_container_s_whole_spec(cluster, engine):
    pool = make_pool(engine)
    try:
        restart_keeps_specs(pool, sandman.SandboxSpec(image=BUSYBOX, cpu=1, memory="256Mi", env={"SPEC_CHECK": "kept"},
                               ttl_s=600, labels={"team": "rl"}))
    finally:
        sandman.shutdown_pool(pool)


def test_delete_during_create_leaves_no_container(cluster, engine):
    provider = make_provider(engine).bind("race-" + uuid.uuid4().hex[:6])

    async def race():
        creating = asyncio.ensure_future(provider.create("s1", SandboxSpec(image=BUSYBOX), {}))
        while "s1" not in provider._where:  # until the create is sent to the agent; the
            await asyncio.sleep(0.005)      # delete, sent after it, then runs after it starts
        await provider.delete("s1")
        return await asyncio.gather(creating, return_exceptions=True)
    try:
        outcome, = run(race())
        assert isinstance(outcome, ProviderError), outcome
        assert "deleted while it was being created" in str(outcome)
        assert containers(engine, provider.pool) == []
    finally:
        run(provider.shutdown())


async def _twice(provider, sandbox_id, spec):
    return await asyncio.gather(provider.create(sandbox_id, spec, {}),
                                provider.create(sandbox_id, spec, {}))


def test_bad_images_fail_fatally_saying_why(cluster, engine, registry):
    provider = make_provider(engine).bind("bad-" + uuid.uuid4().hex[:6])
    cases = [("dir:/tmp", "runs images its engine has or can pull"),
             ("%s/sandman/absent:1" % registry.location, "does not exist in its registry"),
             ("127.0.0.1:%d/sandman/absent:1" % free_port(), "is unreachable")]
    try:
        for image, reason in cases:
            with pytest.raises(ProviderError, match=reason) as err:
                run(provider.create("s-" + uuid.uuid4().hex[:6], SandboxSpec(image=image), {}))
            assert err.value.kind == "fatal", image
        assert run(provider.list()) == []
    finally:
        run(provider.shutdown())


def test_engine_errors_are_classified_for_pacing():
    import docker.errors
    import requests

    def api_error(code, text="x"):
        response = requests.Response()
        response.status_code = code
        return docker.errors.APIError(text, response=response, explanation=text)
    assert engine_error(api_error(429), "create").kind == "throttled"
    assert engine_error(api_error(500), "create").kind == "transient"
    assert engine_error(api_error(503), "create").kind == "transient"
    assert engine_error(api_error(400, "bad memory"), "create").kind == "fatal"
    assert "bad memory" in str(engine_error(api_error(400, "bad memory"), "create"))
    assert engine_error(requests.exceptions.ConnectionError("refused"), "x").kind == "transient"
    assert engine_error(requests.exceptions.ReadTimeout("slow"), "x").kind == "transient"
    assert pull_error("a/b", api_error(500, "unauthorized: authentication required")).kind == "fatal"
    denied = "requested access to the resource is denied"
    assert "credentials" in str(pull_error("a/b", api_error(500, denied)))
    assert pull_error("a/b", api_error(500, "toomanyrequests: slow down")).kind == "throttled"
    # a port or a digest that contains 401 is not an HTTP status
    refused = "dial tcp 127.0.0.1:34015: connect: connection refused"
    assert "unreachable" in str(pull_error("a/b", api_error(500, refused)))
    assert pull_error("a/b", requests.exceptions.ConnectionError("engine down")).kind == "transient"
    with pytest.raises(ValueError, match="transport"):
        DockerProvider(transport="ssh")


def test_engine_that_refuses_is_transient_and_a_missing_one_fatal(cluster):
    where = Path("/tmp/sandman-ray-test")
    where.mkdir(parents=True, exist_ok=True)
    refusing = socket.socket(socket.AF_UNIX)  # bound, never listening: connections refused
    path = where / ("refusing-%s.sock" % uuid.uuid4().hex[:6])
    refusing.bind(str(path))
    try:
        for url, kind, reason in [("unix://%s" % path, "transient", "unreachable or busy"),
                                  ("unix://%s/absent.sock" % where, "fatal", "no container engine")]:
            provider = DockerProvider(base_url=url, state_root=STATE, cache_root=CACHE).bind(
                "gone-" + uuid.uuid4().hex[:6])
            with pytest.raises(ProviderError, match=reason) as err:
                run(provider.create("s1", SandboxSpec(image=BUSYBOX), {}))
            assert err.value.kind == kind
            with pytest.raises(ProviderError, match=reason):
                run(provider.shutdown())  # says it could not clean up, stops the agent anyway
    finally:
        refusing.close()
        path.unlink()


def test_cold_image_burst_pulls_once_and_serves_every_acquire(cluster, engine, registry,
                                                              busybox_rootfs, tmp_path):
    """30 concurrent acquires of an image the engine has never seen."""
    marker = uuid.uuid4().hex
    layout = write_oci_layout(busybox_rootfs, tmp_path / "oci", "cold",
                              extra_layers=[{"etc/cold-marker": marker.encode()}])
    image = "%s/sandman/cold-%s:1" % (registry.location, marker[:8])
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", "oci:%s:cold" % layout,
                    "docker://" + image], check=True, capture_output=True, timeout=120)
    before = len(registry.blob_gets())
    pool = make_pool(engine, max_starting=32)
    try:
        async def burst():
            handles = await asyncio.gather(*[sandman.acquire_async(image, pool=pool, timeout=120)
                                             for _ in range(30)])
            outputs = await asyncio.gather(*[h.exec.remote("cat /etc/cold-marker")
                                             for h in handles])
            await asyncio.gather(*[sandman.release_async(h) for h in handles])
            return outputs
        outputs = run(burst())
        assert [o.stdout.decode() for o in outputs] == [marker] * 30
        fetched = registry.blob_gets()[before:]
        assert fetched and len(fetched) == len(set(fetched)), fetched  # every blob once
        from sandman_ray.providers.nodes import NAMESPACE, agent_name
        agent = ray.get_actor(agent_name(pool, ray.get_runtime_context().get_node_id(),
                                         "docker-agent"), namespace=NAMESPACE)
        assert ray.get(agent.engine_stats.remote())["pulls"] == 1
        status = ray.get(sandman.get_pool(pool).status.remote())
        assert status["stats"]["create_failures"] == 0
    finally:
        sandman.shutdown_pool(pool)
    assert containers(engine, pool) == []


def test_sigkilled_driver_leaves_no_container(cluster, engine):
    pool = make_pool(engine, reuse="delete")
    try:
        proc = holding_driver(cluster, "sandman-docker-tests", pool, BUSYBOX, 5)
        assert len(containers(engine, pool)) == 5
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        wait_until(lambda: ray.get(sandman.get_pool(pool).status.remote())["states"]["leased"] == 0,
                   timeout=10, what="the watchdog to reclaim the dead driver's leases")
        reclaimed = time.monotonic()
        wait_until(lambda: containers(engine, pool) == [], timeout=5,
                   what="every container of the dead driver to be removed")
        print("reclaimed %.2f s after the kill, containers gone %.2f s later"
              % (reclaimed - killed, time.monotonic() - reclaimed))
    finally:
        sandman.shutdown_pool(pool)


def test_a_dead_agent_leaves_no_container(cluster, engine):
    from sandman_ray.providers.nodes import NAMESPACE, agent_name
    provider = make_provider(engine).bind("die-" + uuid.uuid4().hex[:6])
    async def three():
        return await asyncio.gather(*[provider.create("s%d" % i, SandboxSpec(image=BUSYBOX), {})
                                      for i in range(3)])
    infos = run(three())
    assert len(containers(engine, provider.pool)) == 3
    ray.kill(ray.get_actor(agent_name(provider.pool, infos[0].node_id, "docker-agent"),
                           namespace=NAMESPACE))
    wait_until(lambda: containers(engine, provider.pool) == [], timeout=30,
               what="the agent's janitor to remove its containers")
    wait_until(lambda: not any(Path(STATE, provider.pool).rglob("*sock")), timeout=10,
               what="the janitor to remove the dead agent's sockets and tokens")
    assert not any(Path(STATE, provider.pool).rglob("token"))


@pytest.mark.slow
def test_debian_image_without_python_through_the_public_api(cluster, engine):
    """A debootstrap minbase rootfs (~20 s, cached) imported as an image."""
    from sandman_ray.image_builders import build_debian_rootfs
    rootfs = build_debian_rootfs(ROOT / ".cache" / "images" / "debian-bookworm")
    image = "localhost/sandman-test/debian:12"
    engine.import_rootfs(rootfs, image)
    pool = make_pool(engine, reuse="delete")
    try:
        with sandman.sandbox(image, pool=pool) as sb:
            assert ray.get(sb.exec.remote("cat /etc/debian_version")).stdout.startswith(b"12")
            none = ray.get(sb.exec.remote("command -v python3 python || echo none"))
            assert none.stdout.strip() == b"none"
            ray.get(sb.run.remote("cd /var && export X=deb && f() { echo fn; }"))
            out = ray.get(sb.run.remote("echo $X $(pwd) $(f) ${BASH_VERSION%%.*}")).stdout.split()
            assert out == [b"deb", b"/var", b"fn", b"5"]
            ray.get(sb.write_file.remote("/srv/app/main.sh", b"echo from file\n", mode=0o755))
            assert ray.get(sb.exec.remote(["/bin/bash", "/srv/app/main.sh"])).stdout == b"from file\n"
            assert [e.name for e in ray.get(sb.list_dir.remote("/srv/app"))] == ["main.sh"]
            pid = ray.get(sb.spawn.remote("for i in 1 2 3; do echo line$i; done"))
            assert ray.get(sb.proc_wait.remote(pid, timeout=10)).exit_code == 0
            assert ray.get(sb.proc_output.remote(pid)).data == b"line1\nline2\nline3\n"
            assert len(containers(engine, pool)) == 1
        wait_until(lambda: containers(engine, pool) == [], timeout=10,
                   what="the released Debian container to be removed")
    finally:
        sandman.shutdown_pool(pool)
