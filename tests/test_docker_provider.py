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
from sandman_ray import DaemonClient, NotSupported, ProviderError
from sandman_ray.image_builders import write_oci_layout
from sandman_ray.providers.base import POOL_LABEL
from sandman_ray.providers.docker import DockerProvider
from sandman_ray.providers.docker.engine import (
    engine_client, engine_error, list_containers, pull_error, snapshot_images,
    snapshot_reference)
from sandman_ray.providers.docker.podman_service import PodmanError, PodmanService
from sandman_ray.spec import SandboxSpec
from conftest import (
    RAY_NAMESPACE, ROOT, exercise_handle, free_port, holding_driver, restart_keeps_specs,
    shared_ray, unique_pool, wait_until)

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
    yield shared_ray()


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
        # a snapshot starts as its base did: the image's variables (its container held
        # them empty, for the daemon), not the spec's
        run(provider.snapshot("s2", "env"))
        forked = run(provider.create("s3", SandboxSpec(
            image="snapshot:%s/env" % provider.pool), {}))
        client = DaemonClient(forked.address, forked.token)
        assert client.exec("echo $FROM_IMAGE ${A:-unset}").text.split() == ["yes", "unset"]
        client.close()
    finally:
        deleted = run(provider.shutdown())
    assert deleted == 3


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
        proc = holding_driver(cluster, RAY_NAMESPACE, pool, BUSYBOX, 5)
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


# ---- snapshots and pauses

def _client(info):
    return DaemonClient(info.address, info.token)


def test_a_snapshot_carries_the_sandbox_s_files_to_new_sandboxes_then_is_deleted(cluster, engine):
    provider = make_provider(engine).bind("snap-" + uuid.uuid4().hex[:6])
    api = engine_client(engine.base_url)
    try:
        first = run(provider.create("s1", SandboxSpec(image=BUSYBOX), {}))
        client = _client(first)
        setup = ("mkdir -p /work && echo made-here > /work/file && chown 1000:1000 /work/file"
                 " && echo root-owned > /root/notes && rm /bin/vi && echo ok")
        assert client.exec(setup).text.strip() == "ok"
        client.spawn("sleep 1000")  # a process: not part of any snapshot
        snap = run(provider.snapshot("s1", "first"))
        assert snap.image == snapshot_reference(provider.pool, "first")
        assert (snap.name, snap.base, snap.source, snap.node_id) == (
            "first", BUSYBOX, "s1", first.node_id)
        assert 0 < snap.size_bytes < 10 ** 6 and snap.created_at > 0
        # the captured sandbox runs on, its files still its own
        assert client.exec("stat -c '%u %g' /work/file; echo more >> /root/notes && echo w"
                           ).text.split() == ["1000", "1000", "w"]
        client.close()

        again = run(provider.create("s2", SandboxSpec(image=snap.image), {}))
        # the form every provider takes names the same image
        by_name = SandboxSpec(image="snapshot:%s/first" % provider.pool)
        named = run(provider.create("s3", by_name, {}))
        for info in (again, named):
            assert info.node_id == first.node_id and info.details["image"] == snap.image
            client = _client(info)
            out = client.exec("cat /work/file; stat -c '%u %g' /work/file; cat /root/notes;"
                              " echo appended >> /root/notes && echo writable;"
                              " test -e /bin/vi || echo no-vi; ps -o args | grep -c '[s]leep 1000'")
            assert out.text.split() == ["made-here", "1000", "1000", "root-owned", "writable",
                                        "no-vi", "0"], out
            assert client.info()["pid"] == 1  # our daemon again, with its own token
            client.close()

        # nothing of the daemon's bind mounts is in the image, and it starts as its base
        # created, waited for, then read: a followed log stream of a container that exits at
        # once can stay open forever on the engine's compatible API
        lister = api.containers.create(snap.image, entrypoint=["/bin/ls", "-A", "/.sandman",
                                                                "/run/sandman"],
                                       network_mode="none")
        try:
            lister.start()
            assert lister.wait(timeout=60)["StatusCode"] == 0
            bare = lister.logs(stdout=True, stderr=True)
        finally:
            lister.remove(force=True)
        assert bare.split() == [b"/.sandman:", b"/run/sandman:"], bare
        config, base = (api.api.inspect_image(i)["Config"] for i in (snap.image, BUSYBOX))
        assert [config.get(k) or None for k in ("Entrypoint", "Cmd", "User")] == \
            [base.get(k) or None for k in ("Entrypoint", "Cmd", "User")]

        listed = {s.name: s for s in run(provider.snapshots())}
        assert listed == {"first": snap}
        with pytest.raises(ProviderError, match="has a snapshot of that name") as err:
            run(provider.snapshot("s2", "first"))
        assert err.value.kind == "fatal"
        with pytest.raises(ProviderError, match="still run from it.*sandbox s[23]") as err:
            run(provider.delete_snapshot("first"))
        assert err.value.kind == "fatal"
        run(provider.delete("s2"))
        run(provider.delete("s3"))
        run(provider.delete_snapshot("first"))
        run(provider.delete_snapshot("first"))  # gone already: not an error
        assert run(provider.snapshots()) == []
        assert not api.api.images(filters={"reference": snap.image})
        with pytest.raises(ProviderError, match="no such snapshot"):
            run(provider.create("s4", SandboxSpec(image=snap.image), {}))
    finally:
        run(provider.shutdown())


def test_a_snapshot_of_a_snapshot_s_sandbox_keeps_the_first_base_and_shutdown_removes_both(
        cluster, engine):
    provider = make_provider(engine).bind("snap2-" + uuid.uuid4().hex[:6])
    api = engine_client(engine.base_url)
    try:
        spec = SandboxSpec(image=CONFIGURED, user="4242:4242", workdir="/tmp")
        info = run(provider.create("s1", spec, {}))
        with _client(info) as client:
            client.write_file("/tmp/one", b"1")
        one = run(provider.snapshot("s1", "one"))
        # the image starts as CONFIGURED does, not as the spec's user in its workdir
        config, base = (api.api.inspect_image(i)["Config"] for i in (one.image, CONFIGURED))
        keys = ("Entrypoint", "Cmd", "User", "WorkingDir")
        assert [config.get(k) for k in keys] == [base.get(k) for k in keys] == [
            ["/bin/false"], ["never"], "nobody", "/home"]
        info = run(provider.create("s2", SandboxSpec(image=one.image), {}))
        with _client(info) as client:
            client.write_file("/tmp/two", b"2")
        two = run(provider.snapshot("s2", "two"))
        assert (two.base, two.source) == (CONFIGURED, "s2")
        assert two.size_bytes >= one.size_bytes  # it counts the layer below it too
        info = run(provider.create("s3", SandboxSpec(image=two.image), {}))
        with _client(info) as client:
            assert client.exec("cat /tmp/one /tmp/two; echo; id -u; pwd").text.split() == [
                "12", "65534", "/home"]
        for bad in ("", "-lead", "a/b", "x" * 129):
            with pytest.raises(ProviderError, match="snapshot name"):
                run(provider.snapshot("s3", bad))
        assert sorted(s.name for s in run(provider.snapshots())) == ["one", "two"]
    finally:
        assert run(provider.shutdown()) == 3
    assert snapshot_images(api, provider.pool) == []


def test_a_snapshot_under_gvisor_is_not_supported(cluster, engine):
    """Measured with Podman and runsc: a commit of a gVisor container holds none of the
    files made inside (they live in gVisor's memory-backed overlay), so the agent
    refuses before it looks for the sandbox."""
    provider = make_provider(engine, runtime="runsc").bind("gv-" + uuid.uuid4().hex[:6])
    node = ray.get_runtime_context().get_node_id()
    try:
        with pytest.raises(NotSupported, match="s1 as 'x': under gVisor.*commit does not see"):
            run(provider._on_agent(node, "snapshot", "s1", "x"))
    finally:
        run(provider.shutdown())


def _cpu_ticks(client, pid):
    """utime + stime of ``pid`` in the sandbox, in clock ticks, from its /proc stat."""
    stat = client.exec("cat /proc/%d/stat" % pid).text
    fields = stat.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def test_pause_stops_a_busy_loop_and_resume_lets_it_run_on(cluster, engine):
    provider = make_provider(engine).bind("pause-" + uuid.uuid4().hex[:6])
    api = engine_client(engine.base_url)
    try:
        info = run(provider.create("s1", SandboxSpec(image=BUSYBOX), {}))
        client = _client(info)
        pid = client.spawn("while :; do :; done")
        before = _cpu_ticks(client, pid)
        run(provider.pause("s1"))
        run(provider.pause("s1"))  # paused already: stays paused
        run(provider.snapshot("s1", "while-paused"))  # leaves a paused sandbox paused
        assert api.api.inspect_container(info.details["container"])["State"]["Paused"]
        time.sleep(1.0)  # a window for CPU time to accumulate, were the loop not frozen
        run(provider.resume("s1"))
        run(provider.resume("s1"))  # running already: stays running
        paused = _cpu_ticks(client, pid) - before
        start = _cpu_ticks(client, pid)
        time.sleep(1.0)  # the same window, running
        running = _cpu_ticks(client, pid) - start
        # ~100 ticks a second for a loop that has a core; the paused window counts only
        # the engine's pause and unpause calls around it
        assert running > 20 and paused < running / 2, (paused, running)
        status = client.proc_status(pid)
        assert status.running and status.pid == pid
        client.close()
        print("cpu ticks of a busy loop over 1 s: %d paused, %d running" % (paused, running))
        # a sandbox whose container went away underneath
        gone = run(provider.create("s2", SandboxSpec(image=BUSYBOX), {}))
        remove_underneath(api, gone.details["container"])
        with pytest.raises(ProviderError, match="pause sandbox s2: no such sandbox") as err:
            run(provider.pause("s2"))
        assert err.value.kind == "fatal"
    finally:
        run(provider.shutdown())


def remove_underneath(api, container: str) -> None:
    """Remove a container behind the provider's back. Podman 4.3 sometimes refuses to
    remove one that started a moment ago (its shm mount still busy: "device or resource
    busy"): ask again until it is gone."""
    import docker

    def removed():
        try:
            api.api.remove_container(container, force=True)
        except docker.errors.NotFound:
            return True
        except docker.errors.APIError as exc:
            if "resource busy" not in str(exc):
                raise
            return False
        return True
    wait_until(removed, timeout=30, what="podman to remove container %s" % container)
