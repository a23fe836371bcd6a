"""The escape suite (see test_escape.py): a sandbox's network reaches nothing of the
host or the cluster, gVisor's wall, and an agent that is not root."""

import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import uuid

import pytest

from conftest import Sandbox
from escape_kit import BOXES, DOCKER_IMAGE, DOCKER_WORK, daemon_pid, podman_with_busybox, sh
from escape_kit import host_secrets
from escape_kit import (  # noqa: F401 - fixtures: pytest finds them by name
    box, boxes, docker_box, docker_provider, engine, listener, provider)


# ---------------------------------------------------------------- the network
# "open" once a TCP connection was made: busybox's nc in the busybox image, python3 in
# the others (the Debian image has no nc); the addresses are tried at once (a dropped
# connection waits its 2 s) and told in the order given
CONNECT = ("busybox --list | grep -qx nc || echo no-nc; d=$(mktemp -d); "
           "for h in %s; do (if echo | busybox nc -w 2 $h %d >/dev/null 2>&1; then "
           "echo open > $d/$h; else echo closed > $d/$h; fi) & done; wait; "
           "for h in %s; do echo $(cat $d/$h) $h; done")
CONNECT_PY = ("python3 -c 'import socket, sys, threading\n"
              "seen = {}\n"
              "def probe(h):\n"
              "    s = socket.socket(); s.settimeout(2)\n"
              "    try: s.connect((h, int(sys.argv[1]))); seen[h] = \"open\"\n"
              "    except OSError: seen[h] = \"closed\"\n"
              "probes = [threading.Thread(target=probe, args=(h,)) for h in sys.argv[2:]]\n"
              "[t.start() for t in probes]; [t.join() for t in probes]\n"
              "for h in sys.argv[2:]: print(seen[h], h)' %d %s")


def connect(image: str, hosts, port: int) -> str:
    hosts = " ".join(hosts) if not isinstance(hosts, str) else hosts
    return CONNECT % (hosts, port, hosts) if image == "busybox" else CONNECT_PY % (port, hosts)


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
    if image == "fork":
        images["fork"] = request.getfixturevalue("boxes")["fork"].spec.image
    spec = SandboxSpec(image=images.get(image, location), network=True)
    shell = {"docker": "busybox", "fork": "default"}.get(image, image)
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
                                "nft", "list", "ruleset"], capture_output=True, text=True).stdout
        assert "ip daddr @refused counter packets" in rules and " drop" in rules
        assert "169.254.0.0/16" in rules and "10.0.0.0/8" in rules


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


def test_the_network_filter_refuses_the_clusters_other_nodes_too():
    """A public address of another Ray node (its GCS, its raylet) is as closed as this
    host's own; the spec's network_allow comes first and may open it."""
    from sandman_ray.providers.network import ruleset
    rules = ruleset(allow=("8.8.4.4/32",), neighbours=("8.8.8.8",)).splitlines()
    refused = [line for line in rules if "set refused" in line]
    assert len(refused) == 2 and all("8.8.8.8/32" in line for line in refused)
    netdev = rules.index("table netdev sandman {")
    for table in (rules[:netdev], rules[netdev:]):
        accept = table.index("    ip daddr @allowed accept")
        assert all(accept < i for i, line in enumerate(table) if "@refused" in line)


# ---------------------------------------------------------------- an agent that is not root
NOBODY = 65534


def run_as_nobody(work: str, port: int, targets, probe: str = "", checks=(),
                  secrets=()) -> dict:
    """tests/unprivileged_agent.py run as nobody, its JSON. The interpreter, the
    virtualenv's packages and the checkout stay where root put them (perhaps under a
    0700 home): a private mount namespace binds them read-only where nobody may read
    them, and nobody runs the same code from there. ``probe``: the escape probe (a
    file nobody may read) to run with ``checks`` in a sandbox, and nothing else;
    ``secrets``: host files for a host-image sandbox to try to read."""
    import json
    import site
    import sys
    from conftest import ROOT
    python = os.path.realpath(sys.executable)
    base = os.path.realpath(sys.base_prefix)
    mnt = tempfile.mkdtemp(prefix="sandman-nobody-")
    os.chmod(mnt, 0o755)
    try:
        for sub in ("python", "site", "repo", "pkgs"):
            os.makedirs(os.path.join(mnt, sub))
        os.symlink(os.path.join(mnt, "repo", "sandman_ray"),
                   os.path.join(mnt, "pkgs", "sandman_ray"))
        script = ("mount --bind -o ro %s %s/python && mount --bind -o ro %s %s/site && "
                  "mount --bind -o ro %s %s/repo && exec setpriv --reuid %d --regid %d "
                  "--clear-groups env -i HOME=%s PATH=/usr/sbin:/usr/bin:/sbin:/bin "
                  "SANDMAN_PROBE=%s SANDMAN_PROBE_CHECKS=%s SANDMAN_SECRETS=%s "
                  "PYTHONHOME=%s/python PYTHONPATH=%s/pkgs:%s/site:%s/repo/tests %s/python/%s "
                  "%s/repo/tests/unprivileged_agent.py %s %d %s" % (
                      base, mnt, site.getsitepackages()[0], mnt, ROOT, mnt, NOBODY, NOBODY,
                      work, probe, shlex.quote(" ".join(checks)),
                      shlex.quote(" ".join(secrets)), mnt, mnt, mnt, mnt, mnt,
                      os.path.relpath(python, base), mnt, work, port, " ".join(targets)))
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
        with host_secrets() as secrets:
            out = run_as_nobody(work, port, node_addresses(), secrets=secrets)
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
    assert "root:" not in out["shadow"] and "rc=0" not in out["shadow"]
    assert out["shadow"].count("Permission denied") == len(secrets), out["shadow"]
    assert "rc=0" not in out["kill_host"]
    assert "network_error" not in out, out.get("network_error")
    assert "open" not in out["network"] and out["network"].count("closed") == \
        2 + len(node_addresses()), out["network"]
    assert "rc=0" not in out["lift_filter"]
    assert len(accepted) == before
