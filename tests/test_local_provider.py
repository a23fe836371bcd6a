"""LocalProvider on a real local Ray: node agents, bwrap sandboxes from every image
kind, isolation, limits, reset, and nothing left behind."""

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import ray

from sandman_ray import DaemonClient, ProviderError
from sandman_ray.image_builders import write_docker_archive, write_oci_layout
from sandman_ray.providers.local import LocalProvider
from sandman_ray.spec import SandboxSpec
from conftest import LOCAL_CACHE as CACHE, LOCAL_STATE as STATE
from conftest import ROOT, TEST_IMAGE_ROOT, Sandbox, new_id, processes_matching, run


@pytest.fixture(scope="module")
def provider(local_provider):
    return local_provider


@pytest.fixture(scope="module")
def images(busybox_rootfs, tmp_path_factory):
    where = tmp_path_factory.mktemp("images")
    config = {"Env": ["FROM_IMAGE=yes", "PATH=/bin"], "WorkingDir": "/home"}
    layers = [{"opt/keep/a": b"1", "opt/gone/b": b"2", "etc/motd": b"old"},
              {"opt/gone/.wh..wh..opq": b"", "opt/gone/c": b"3", "etc/.wh.motd": b""}]
    oci = write_oci_layout(busybox_rootfs, where / "oci", "v1", config, layers)
    archive = write_docker_archive(busybox_rootfs, where / "image.tar", config, layers)
    return {"host": "host", "dir": "dir:%s" % busybox_rootfs, "oci": "oci:%s:v1" % oci,
            "docker-archive": "docker-archive:%s" % archive}


@pytest.mark.parametrize("kind", ["host", "dir", "oci", "docker-archive"])
def test_each_image_kind_answers_exec(provider, images, kind):
    with Sandbox(provider, images[kind]) as sb:
        assert sb.client.exec("echo hello").stdout == b"hello\n"
        if kind in ("oci", "docker-archive"):
            r = sb.client.exec("pwd; echo $FROM_IMAGE; ls /opt/keep; ls /opt/gone")
            assert r.text.split() == ["/home", "yes", "a", "c"]  # b: under an opaque dir
            assert sb.client.exec("ls /etc/motd").exit_code != 0  # whited out
            assert sb.info.details["unpacked_by"] in ("umoci", "skopeo+umoci")


def test_builtin_layer_applier_gives_the_same_tree(images, tmp_path):
    from sandman_ray.images import ImageCache
    tools = ImageCache(tmp_path / "tools", prefer_tools=True).prepare(images["oci"])
    builtin = ImageCache(tmp_path / "builtin", prefer_tools=False).prepare(images["oci"])
    assert builtin.unpacked_by == "sandman" and tools.digest == builtin.digest

    def tree(root):
        return sorted((str(p.relative_to(root)), p.is_symlink()) for p in root.rglob("*"))
    assert tree(tools.rootfs) == tree(builtin.rootfs)


def test_registry_reference_without_a_reachable_registry_fails_clearly(provider):
    with pytest.raises(ProviderError) as err:
        run(provider.create(new_id(), SandboxSpec(image="docker.io/library/busybox:latest"), {}))
    assert err.value.kind == "transient" and "unreachable" in str(err.value)


def test_bad_image_strings_fail_fatally_with_the_reason(provider):
    for image, words in (("oci:/no/such/layout", "not an OCI layout"),
                         ("dir:%s/no/such/dir" % TEST_IMAGE_ROOT, "no such directory"),
                         ("dir:/no/such/dir", "image_roots"),
                         ("docker-archive:/no/such.tar", "no such file")):
        with pytest.raises(ProviderError) as err:
            run(provider.create(new_id(), SandboxSpec(image=image), {}))
        assert err.value.kind == "fatal" and words in str(err.value)
    with pytest.raises(ValueError, match="not builtin:debian, host"):
        SandboxSpec(image="busybox")  # no registry host: refused before any work


def test_sandbox_sees_only_its_own_processes_and_only_loopback(provider, images):
    with Sandbox(provider, images["dir"]) as sb:
        pids = [p for p in sb.client.exec("ls /proc").text.split() if p.isdigit()]
        assert "1" in pids and len(pids) <= 4  # the daemon, the shell, ls
        assert sb.client.info()["pid1"]
        interfaces = [line.split(":")[0].strip() for line in
                      sb.client.read_file("/proc/net/dev").decode().splitlines()[2:]]
        assert interfaces == ["lo"]


def test_network_true_gives_a_namespace_of_its_own_behind_slirp(provider, images):
    with Sandbox(provider, SandboxSpec(image=images["dir"], network=True)) as sb:
        interfaces = [line.split(":")[0].strip() for line in
                      sb.client.read_file("/proc/net/dev").decode().splitlines()[2:]]
        assert sorted(interfaces) == ["lo", "tap0"]
        assert "10.0.2.100" in sb.client.exec("ip -4 addr show tap0").text
        assert sb.client.read_file("/etc/resolv.conf") == b"nameserver 10.0.2.3\n"


def test_writes_stay_in_their_sandbox(provider, images, busybox_rootfs):
    with Sandbox(provider, images["dir"]) as a, Sandbox(provider, images["dir"]) as b:
        a.client.write_file("/etc/only-in-a", b"a")
        a.client.exec("rm /bin/vi")
        assert not (busybox_rootfs / "etc" / "only-in-a").exists()
        assert (busybox_rootfs / "bin" / "vi").is_symlink()
        assert b.client.exec("ls /etc/only-in-a").exit_code != 0
        assert b.client.exec("ls /bin/vi").exit_code == 0
    marker = "host-" + uuid.uuid4().hex
    with Sandbox(provider, "host") as h:
        h.client.write_file("/tmp/%s" % marker, b"x")
        assert h.client.exec("touch /etc/%s" % marker).exit_code != 0  # read-only view
        assert not os.path.exists("/tmp/%s" % marker)


def test_daemon_bundle_is_read_only_inside(provider, images):
    with Sandbox(provider, images["dir"]) as sb:
        r = sb.client.exec("touch /.sandman/x; echo > /.sandman/sandmand.pyz")
        assert r.exit_code != 0 and b"Read-only" in r.stderr


def test_runs_as_the_given_uid(provider, images):
    with Sandbox(provider, SandboxSpec(image=images["dir"], user="1000:1000")) as sb:
        assert sb.client.exec("id -u; id -g").text.split() == ["1000", "1000"]
        assert sb.client.exec("touch /etc/x").exit_code != 0
        assert sb.client.exec("touch /tmp/x").exit_code == 0
    from conftest import wait_until
    # the daemon dropped its privileges: it must still die with its sandbox
    wait_until(lambda: processes_matching("--user 1000:1000") == [],
               what="the unprivileged daemon to exit with its sandbox")


def test_fork_bomb_and_memory_hog_are_stopped_by_limits(provider, images):
    spec = SandboxSpec(image=images["dir"], memory="64Mi", pids=64, cpu=0.5)
    with Sandbox(provider, spec) as bomb, Sandbox(provider, images["dir"]) as bystander:
        assert set(bomb.client.info()["limits"]["applied"]) == {"memory", "pids", "cpu"}
        # the bomb's shell spins (no fork needed) until the timeout; a timed-out exec
        # answers once every process of its group is gone, so the next command can start
        r = bomb.client.exec("f() { f | f & }; f; while :; do :; done", timeout=5,
                             kill_grace_s=0.5)
        assert r.timed_out
        hog = bomb.client.exec("dd if=/dev/zero of=/dev/null bs=200M count=1; echo $?",
                               timeout=60)
        assert hog.stdout.strip() in (b"137", b"1")  # killed for memory, not finished
        assert bystander.client.exec("echo fine").stdout == b"fine\n"
        assert bomb.client.exec("echo still answering").exit_code == 0


def test_reset_drops_writes_and_processes(provider, images):
    with Sandbox(provider, images["dir"]) as sb:
        sb.client.write_file("/root/notes", b"episode 1")
        sb.client.spawn("sleep 81.5")
        sb.client.close()
        info = run(provider.reset(sb.id))
        sb.client = DaemonClient(info.address, info.token, default_timeout=60)
        assert sb.client.exec("ls /root/notes").exit_code != 0
        assert processes_matching("sleep 81.5") == []
        assert sb.client.exec("echo again").stdout == b"again\n"



def test_a_gvisor_launch_deletes_only_a_container_that_was_left(tmp_path):
    """A launch runs ``runsc delete`` only where the sandbox's runsc root holds a
    predecessor's state: never for a new sandbox, always after one that left some."""
    from sandman_ray.providers.local.gvisor import GvisorProcess
    sandbox = GvisorProcess.__new__(GvisorProcess)
    sandbox.state_dir, sandbox.sandbox_id, ran = tmp_path, "s-gv", []
    sandbox._runsc = lambda *args: ran.append(args)
    sandbox._delete_predecessor()  # no runsc root yet
    (tmp_path / "runsc").mkdir()
    sandbox._delete_predecessor()  # an empty one: runsc's own delete emptied it
    assert ran == []
    (tmp_path / "runsc" / "s-gv.state").write_text("{}")
    sandbox._delete_predecessor()
    assert ran == [("delete", "--force", "s-gv")]


def test_a_gvisor_sandbox_reset_drops_writes_and_processes(busybox_rootfs):
    """Under gVisor a reset starts the sandbox afresh: a new runsc, and nothing of the
    last lease's files or processes (its runsc state removed first, when it left any)."""
    from conftest import shared_ray
    if shutil.which("runsc") is None:
        pytest.fail("runsc is missing: make test installs it (apt-get install runsc)")
    shared_ray()
    gvisor = LocalProvider(state_root=STATE, cache_root=CACHE, isolation="gvisor").bind(
        "test-gv-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(gvisor, "dir:%s" % busybox_rootfs) as sb:
            before = sb.info.details["pid"]
            for episode in ("1", "2"):
                sb.client.write_file("/root/notes", episode.encode())
                sb.client.spawn("sleep 81.5")
                sb.client.close()
                info = run(gvisor.reset(sb.id))
                sb.client = DaemonClient(info.address, info.token, default_timeout=60)
                assert info.details["pid"] != before
                before = info.details["pid"]
                assert sb.client.exec("ls /root/notes").exit_code != 0
                assert "81.5" not in sb.client.exec("ps").text
    finally:
        run(gvisor.shutdown())


def test_resets_of_one_sandbox_at_once_run_one_after_the_other(provider, images):
    """Four resets of one sandbox asked at the same moment (a caller that retries while
    its first reset is under way) each complete, one after another: the sandbox comes
    back once from each, the last token answers, and none of them finds it half-renewed."""
    with Sandbox(provider, images["dir"]) as sb:
        sb.client.close()

        async def four():
            return await asyncio.gather(*[provider.reset(sb.id) for _ in range(4)])
        infos = run(four())
        assert len({info.token for info in infos}) == 4
        tokens = [info.token for info in infos]
        answering = []
        for token in tokens:
            try:
                client = DaemonClient(infos[0].address, token, default_timeout=10)
                answering.append(client.exec("echo up").stdout == b"up\n")
                client.close()
            except Exception:  # noqa: BLE001 - a token a later reset replaced
                answering.append(False)
        assert answering.count(True) == 1, answering
        sb.client = DaemonClient(infos[answering.index(True)].address,
                                 tokens[answering.index(True)], default_timeout=60)
def test_delete_kills_what_is_left_in_the_sandbox_cgroup(provider, images):
    """A process still in the sandbox's cgroup when bwrap is gone (as a daemon whose
    bwrap died first once was) is killed when the sandbox is removed. A sandbox without
    limits has such a group too."""
    stray = subprocess.Popen(["sleep", "83.5"])
    try:
        with Sandbox(provider, SandboxSpec(image=images["dir"])) as sb:
            groups = list(Path("/sys/fs/cgroup/pids/sandman").glob("*/%s" % sb.id))
            assert len(groups) == 1, "the sandbox has a pids cgroup"
            (groups[0] / "cgroup.procs").write_text(str(stray.pid))
        assert stray.wait(10) == -9
        assert not groups[0].exists()
    finally:
        stray.kill()
        stray.wait()


def test_leftovers_sees_a_process_that_outlived_its_bwrap(images):
    """``leftovers`` finds sandbox processes by their cgroup, not only by command line:
    a process left in a sandbox's group after its bwrap died (the daemon runs as PID 1
    of its namespace and names no host path) is seen, and the agent's shutdown kills it."""
    import signal
    from sandman_ray.providers.local import leftovers
    pool = "strays-" + uuid.uuid4().hex[:6]
    p = LocalProvider(state_root=STATE, cache_root=CACHE).bind(pool)
    stray = subprocess.Popen(["sleep", "84.5"])
    try:
        info = run(p.create(new_id(), SandboxSpec(image=images["dir"]), {}))
        groups = list(Path("/sys/fs/cgroup/pids/sandman").glob("%s-*/%s" % (pool, info.sandbox_id)))
        assert len(groups) == 1
        (groups[0] / "cgroup.procs").write_text(str(stray.pid))
        os.kill(info.details["pid"], signal.SIGKILL)  # bwrap goes; the stray stays
        left = leftovers(pool, STATE)
        assert stray.pid in left["processes"] and len(left["cgroups"]) >= 1
        run(p.shutdown())
        assert stray.wait(10) == -9
        assert leftovers(pool, STATE) == {"processes": [], "directories": [], "cgroups": []}
    finally:
        stray.kill()
        stray.wait()
        run(p.shutdown())


def test_create_is_idempotent_under_retries(provider, images):
    sandbox_id = new_id()

    async def twice():
        spec = SandboxSpec(image=images["dir"])
        return await asyncio.gather(provider.create(sandbox_id, spec, {}),
                                    provider.create(sandbox_id, spec, {}))
    first, second = run(twice())
    assert first.address == second.address and first.token == second.token
    assert [i.sandbox_id for i in run(provider.list())].count(sandbox_id) == 1
    run(provider.delete(sandbox_id))
    run(provider.delete(sandbox_id))  # deleting twice is not an error


@pytest.mark.parametrize("head_start", [0, 2, 30])
def test_a_delete_during_its_create_returns_only_once_nothing_of_it_is_left(
        provider, images, head_start):
    """Whether the delete reaches the agent before, with or after its create (sent
    ``head_start`` ms after it), the sandbox is gone when the delete returns (a
    snapshot's delete follows at once)."""
    sandbox_id = new_id()

    async def race():
        creating = asyncio.ensure_future(
            provider.create(sandbox_id, SandboxSpec(image=images["dir"]), {}))
        while sandbox_id not in provider._creating:  # until it is sent to the agent
            await asyncio.sleep(0.001)
        await asyncio.sleep(head_start / 1000)
        await provider.delete(sandbox_id)
        ended = creating.done()  # else it could still make the sandbox after the delete
        left = [i.sandbox_id for i in await provider.list()]
        return ended, left, (await asyncio.gather(creating, return_exceptions=True))[0]
    ended, left, outcome = run(race())
    assert ended and sandbox_id not in left
    assert isinstance(outcome, ProviderError) and "deleted while" in str(outcome), outcome
    assert sandbox_id not in [i.sandbox_id for i in run(provider.list())]


def test_a_sandbox_with_many_sessions_gets_no_more_cpu_than_its_neighbour(provider, images):
    """Every command a sandbox runs is a session of its own; were each session a
    scheduling group of its own (the kernel's autogroups, outside any cpu cgroup),
    eight busy commands would take eight times the CPU of a neighbour's one. Each
    sandbox is one group: on one CPU, the two sandboxes share it about evenly."""
    busy = "taskset -c 0 sh -c 'while :; do :; done'"
    cpu_ticks = "awk '{s += $14 + $15} END {print s}' /proc/[0-9]*/stat"
    with Sandbox(provider, images["dir"]) as many, Sandbox(provider, images["dir"]) as one:
        for _ in range(8):
            many.client.spawn(["sh", "-c", busy])
        one.client.spawn(["sh", "-c", busy])
        before = [int(sb.client.exec(["sh", "-c", cpu_ticks]).stdout) for sb in (many, one)]
        time.sleep(3)  # the window the CPU is measured over
        after = [int(sb.client.exec(["sh", "-c", cpu_ticks]).stdout) for sb in (many, one)]
    used_many, used_one = (a - b for a, b in zip(after, before))
    assert used_one >= 0.6 * used_many, (used_many, used_one)


def test_list_filters_by_label(provider, images):
    with Sandbox(provider, images["dir"]) as sb:
        mine = run(provider.list({"sandman.sandbox": sb.id}))
        assert [i.sandbox_id for i in mine] == [sb.id]
        assert mine[0].labels["test"] == "yes" and mine[0].node_id
        assert run(provider.list({"test": "no-such-value"})) == []


def test_sandboxes_die_with_their_agent_and_its_janitor_cleans_up(images):
    from sandman_ray.providers.nodes import NAMESPACE, agent_name
    p = LocalProvider(state_root=STATE, cache_root=CACHE).bind("agent-death")
    sandbox_id = new_id()
    info = run(p.create(sandbox_id, SandboxSpec(image=images["dir"]), {}))
    bwrap_pid = info.details["pid"]
    state = Path(info.address[len("unix:"):]).parent.parent
    agent = ray.get_actor(agent_name("agent-death", info.node_id), namespace=NAMESPACE)
    ray.kill(agent)
    from conftest import wait_until
    wait_until(lambda: not os.path.exists("/proc/%d" % bwrap_pid)
               or open("/proc/%d/stat" % bwrap_pid).read().split()[2] == "Z",
               what="the sandbox to die with its agent")
    # the agent's janitor outlives it (Ray kills a dead worker's children, not the
    # janitor) and removes what its sandboxes left
    wait_until(lambda: not state.exists(), what="the janitor to remove the dead agent's state")
    p2 = LocalProvider(state_root=STATE, cache_root=CACHE).bind("agent-death")
    run(p2.create(new_id(), SandboxSpec(image=images["dir"]), {}))
    run(p2.shutdown())


def test_ray_shutdown_leaves_no_process_mount_or_state(busybox_rootfs, tmp_path):
    """A driver of its own (a fresh local Ray) creates sandboxes and shuts Ray down."""
    state = tmp_path / "state"
    script = textwrap.dedent("""
        import asyncio, ray
        from sandman_ray.providers.local import LocalProvider
        from sandman_ray.spec import SandboxSpec
        ray.init(address="local", num_cpus=1, include_dashboard=False)
        p = LocalProvider(state_root=%r, cache_root=%r).bind("shutdown-test")
        async def main():
            infos = await asyncio.gather(*[p.create("s%%d" %% i, SandboxSpec(image=%r, memory="64Mi"), {})
                                           for i in range(5)])
            print(" ".join(str(i.details["pid"]) for i in infos), flush=True)
        asyncio.run(main())
        ray.shutdown()
    """ % (str(state), CACHE, "dir:%s" % busybox_rootfs))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 5
    from conftest import wait_until
    wait_until(lambda: not any(os.path.exists("/proc/%d/cmdline" % p)
                               and open("/proc/%d/cmdline" % p, "rb").read() for p in pids),
               what="every sandbox process to exit")
    assert processes_matching(str(state)) == []
    mounts = [m for m in (Path("/proc") / p / "mountinfo" for p in os.listdir("/proc")
                          if p.isdigit()) if _mentions(m, str(state))]
    assert mounts == []
    # the agent's janitor removes the state once the agent is gone
    wait_until(lambda: list(state.rglob("*")) == [], what="the janitor to remove the state")
    cgroups = [g for g in Path("/sys/fs/cgroup/memory/sandman").glob("shutdown-test-*")]
    assert cgroups == []


def _mentions(path, text):
    try:
        return text in path.read_text()
    except OSError:
        return False


@pytest.mark.slow
def test_debian_minbase_image_without_python(provider, tmp_path_factory):
    """The slow tier: a real distribution rootfs made by debootstrap (~20 s, cached)."""
    from sandman_ray.image_builders import build_debian_rootfs
    rootfs = build_debian_rootfs(ROOT / ".cache" / "images" / "debian-bookworm")
    with Sandbox(provider, "dir:%s" % rootfs) as sb:
        assert sb.client.exec("cat /etc/debian_version").text.startswith("12")
        assert sb.client.exec("command -v python3 || echo none").text.strip() == "none"
        sb.client.run("cd /var && export X=deb")
        assert sb.client.run("echo $X $(pwd) $BASH_VERSION").text.split()[:2] == ["deb", "/var"]
        assert sb.client.exec(["dpkg-query", "-W", "-f=${Package}\\n", "bash"]).text == "bash\n"


def test_image_user_by_name_and_unknown_names(provider, busybox_rootfs, tmp_path):
    oci = write_oci_layout(busybox_rootfs, tmp_path / "oci-user", "v1", {"User": "nobody"})
    with Sandbox(provider, "oci:%s:v1" % oci) as sb:
        assert sb.client.exec("id -u; id -g").text.split() == ["65534", "65534"]
    # numeric ids need no entry in the image; an unknown name is refused
    with Sandbox(provider, SandboxSpec(image="dir:%s" % busybox_rootfs, user="4242:4242")) as sb:
        assert sb.client.exec("id -u").text.strip() == "4242"
    bad = write_oci_layout(busybox_rootfs, tmp_path / "oci-bad", "v1", {"User": "ghost"})
    with pytest.raises(ProviderError, match="no passwd entry for 'ghost'") as err:
        run(provider.create(new_id(), SandboxSpec(image="oci:%s:v1" % bad), {}))
    assert err.value.kind == "fatal"


def _held_ranges() -> int:
    """How many uid ranges of this host some agent holds (their lock files locked)."""
    import fcntl
    from sandman_ray.providers.local.agent import RANGE_LOCKS
    held = 0
    for entry in os.scandir(RANGE_LOCKS):
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held += 1
        finally:
            os.close(fd)
    return held


def _left_by(provider) -> dict:
    """What the provider's agents keep on this host: sandbox state directories and
    sandbox cgroups (each a directory per sandbox), and the uid ranges held."""
    from sandman_ray.providers.local.agent import agent_groups
    states = [p for p in Path(STATE, provider.pool).glob("*/*/*") if p.is_dir()]
    groups = [p for g in agent_groups(provider.pool) for p in Path(g).iterdir() if p.is_dir()]
    return {"state": sorted(p.name for p in states), "cgroups": len(groups),
            "ranges": _held_ranges()}


@pytest.mark.parametrize("config", [{"Env": ["A=x\x00y"]}, {"User": 5}, {"WorkingDir": []}],
                         ids=["env-with-nul", "user-not-a-string", "workdir-not-a-string"])
def test_a_failed_launch_leaves_nothing_whatever_failed(provider, busybox_rootfs, tmp_path,
                                                        config):
    """An image whose config breaks the launch (not with a provider error of its own) is
    refused as fatal every time, and each try leaves no uid range, cgroup or state
    directory behind: a dataset with such an image must not use up the node's ranges."""
    oci = write_oci_layout(busybox_rootfs, tmp_path / "oci", "v1", config)
    spec = SandboxSpec(image="oci:%s:v1" % oci)
    with pytest.raises(ProviderError):  # the first try may claim the agent's first range
        run(provider.create(new_id(), spec, {}))
    before = _left_by(provider)
    for _ in range(3):
        with pytest.raises(ProviderError) as err:
            run(provider.create(new_id(), spec, {}))
        assert err.value.kind == "fatal"
    assert _left_by(provider) == before


def test_an_image_is_unpacked_once_under_concurrent_requests(busybox_rootfs, tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    from sandman_ray.images import ImageCache
    oci = write_oci_layout(busybox_rootfs, tmp_path / "oci", "v1")
    caches = [ImageCache(tmp_path / "cache") for _ in range(8)]  # as 8 agents' threads
    with ThreadPoolExecutor(8) as pool:
        prepared = list(pool.map(lambda c: c.prepare("oci:%s:v1" % oci), caches))
    assert len({p.rootfs for p in prepared}) == 1
    entries = [e.name for e in (tmp_path / "cache").iterdir()
               if not e.name.endswith((".lock", ".use"))]
    assert entries == [prepared[0].digest.replace(":", "-")]
