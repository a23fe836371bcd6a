"""The escape-bench suite: every scenario of the public container-escape benchmark
(SandboxEscapeBench, arXiv 2603.02277: misconfiguration, privilege, runtime and kernel
escapes of Docker and Kubernetes sandboxes) and every known escape precondition, as a
scripted check that the precondition is absent, at every isolation level we offer:

    local           LocalProvider, builtin:debian (user namespace, seccomp, cgroups)
    local-network   the same with network=True (its own filtered network namespace)
    local-host      the host image (a read-only view of the host's files)
    local-gvisor    LocalProvider(isolation="gvisor")
    local-nobody    a LocalProvider agent that is not root (tests/unprivileged_agent.py)
    docker-runc     DockerProvider on a Podman service with runc
    docker-runsc    DockerProvider on a Podman service with runsc (gVisor)

Each level runs the static probe (tests/probes/escape_probe.c) once with every check,
and reads its /proc/self/status and mountinfo. Each check proves that its own
precondition ran: the same probe run on the host as root (the calibration) must reach
the kernel where the sandbox is refused, or get another answer than the sandbox; a check
whose door the host itself lacks (a kernel without modules, say) is proven by the
sandbox's refusal coming from its filter instead (an errno the host does not give).
SECURITY.md's escape-bench table lists every check here with its levels.

The benchmark's Kubernetes scenarios (CRI-O sysctl injection, kubectl cp, RBAC, kube-
proxy's route_localnet) need a control plane the sandbox can reach; no level here
gives a sandbox any (the network tests refuse every node and private address), and the
KubernetesProvider's pods are held by the cluster's own policies (SECURITY.md)."""

import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import Sandbox
from escape_kit import DOCKER_IMAGE, DOCKER_WORK, podman_with_busybox
from probe_kit import DOORS, on_host, probe_binary

LEVELS = ("local", "local-network", "local-host", "local-gvisor", "local-nobody",
          "docker-runc", "docker-runsc")
GVISOR = ("local-gvisor", "docker-runsc")
# the kernel calls each scenario needs (probe check names), besides what the scenario
# checks by itself below
CALLS = {
    "sys_admin_mount": ["mount", "fsopen", "open_tree", "pivot_root"],
    "new_namespaces": ["unshare_user", "unshare_mount", "unshare_net", "clone_newuser",
                       "clone3", "setns"],
    "kernel_module": ["init_module", "finit_module", "delete_module"],
    "shocker": ["open_by_handle_at"],
    "io_uring": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
    "packet_socket": ["af_packet", "af_packet_dgram"],
    "raw_socket": ["raw_ip", "raw_ip6"],
    "exotic_sockets": ["af_xdp", "af_vsock", "netlink_netfilter", "netlink_xfrm"],
    "bpf": ["bpf"],
    "perf_events": ["perf_event_open"],
    "userfaultfd": ["userfaultfd"],
    "keyring": ["keyctl", "add_key"],
    "kexec": ["kexec_load", "kexec_file_load"],
    "host_admin": ["swapon", "reboot", "acct", "syslog", "iopl", "clock_settime"],
}
# Capabilities whose presence is an escape precondition: SYS_ADMIN (mount, cgroups),
# SYS_MODULE, DAC_READ_SEARCH (shocker), NET_RAW (packet sockets), SYS_PTRACE (host
# processes), NET_ADMIN, SYS_RAWIO, SYS_BOOT, SYS_TIME, SYSLOG, MAC_ADMIN, PERFMON, BPF
DANGEROUS_CAPS = {"DAC_READ_SEARCH": 2, "NET_ADMIN": 12, "NET_RAW": 13, "SYS_MODULE": 16,
                  "SYS_RAWIO": 17, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "SYS_BOOT": 22,
                  "SYS_TIME": 25, "MAC_ADMIN": 33, "SYSLOG": 34, "PERFMON": 38, "BPF": 39}
# filesystems that hold the host's own storage: mounted writable, they are a host mount
DISK_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "vfat", "f2fs", "zfs", "9p", "virtiofs",
           "nfs", "nfs4", "cifs", "fuseblk"}
# the sandbox's own daemon's socket, where it is a file (gVisor, containers)
OWN_SOCKETS = {"local-gvisor": {"/run/sandman/sock"}, "docker-runc": {"/run/sandman/sock"},
               "docker-runsc": {"/run/sandman/sock"}}
# writable host files each level has by design (SECURITY.md): a container's socket
# directory and the engine's files of the container
OWN_WRITABLE = {"docker-runc": {"/run/sandman", "/etc/hosts", "/etc/hostname",
                                "/etc/resolv.conf", "/run/.containerenv"}}
# under gVisor every file comes through its gofer (9p): the root is the container's own
# layer, /dev/shm the engine's tmpfs of the container
OWN_WRITABLE["docker-runsc"] = OWN_WRITABLE["docker-runc"] | {"/", "/dev/shm"}
OWN_WRITABLE["local-gvisor"] = {"/run/sandman"}  # a 1 MiB tmpfs of the chain's, on the host


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    """What only the host has: a process with a unique command line, a file in the
    host's /tmp, an engine's control socket (a Podman service's), a TCP listener."""
    import socket
    tag = uuid.uuid4().hex[:10]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                             "sandman-mark-%s" % tag])
    marker = "/tmp/sandman-mark-%s" % tag
    with open(marker, "w") as fh:
        fh.write("host only\n")
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(16)
    server.setblocking(False)
    yield {"tag": tag, "file": marker, "port": server.getsockname()[1], "server": server}
    server.close()
    os.unlink(marker)
    proc.kill()
    proc.wait()


def checks_for(marks, engine_dir: str = "/") -> list:
    """Every probe check, with the host's marks as arguments."""
    every = sorted({c for calls in CALLS.values() for c in calls})
    return every + ["find_sockets=%s" % engine_dir, "proc_cmdline=sandman-mark-%s" % marks["tag"],
                    "proc_root=%s" % marks["file"], "write=/proc/sys/kernel/core_pattern",
                    "write=/proc/sys/vm/drop_caches", "write=/.sandman/bin/python3",
                    "connect=127.0.0.1:%d" % marks["port"]] + [
        "connect=%s:%d" % (a, marks["port"]) for a in node_addresses()]


def node_addresses():
    from sandman_ray.providers.network import host_addresses
    return [a for a in host_addresses() if not a.startswith("127.")]


class Seen:
    """What one level showed: the probe's verdicts (repeated checks such as ``write=``
    and ``connect=`` come as lists), a process's /proc/self/status and mountinfo."""

    def __init__(self, level, text, status, mountinfo, release_agents=""):
        self.level, self.status, self.mountinfo = level, status, mountinfo
        self.release_agents = release_agents
        self.lines = [line.split(None, 2) for line in text.splitlines()
                      if line and not line.startswith("#")]
        self.sockets = [line.split(None, 2)[2] for line in text.splitlines()
                        if line.startswith("# connectable ")]

    def verdicts(self, check: str) -> list:
        return [rest for name, *rest in self.lines if name == check]

    def verdict(self, check: str) -> str:
        (found,) = self.verdicts(check)
        return " ".join(found)


def look(level, client, marks) -> Seen:
    """Run every check in a sandbox of ``level`` through its daemon's client."""
    probe = probe_binary().read_bytes()
    client.write_file("/tmp/.sandman-probe", probe, mode=0o755)
    r = client.exec(["/tmp/.sandman-probe"] + checks_for(marks), timeout=120)
    assert r.exit_code == 0, r
    status = client.exec(["/bin/sh", "-c", "cat /proc/self/status"]).stdout.decode()
    mountinfo = client.exec(["/bin/sh", "-c", "cat /proc/self/mountinfo"]).stdout.decode()
    agents = client.exec(["/bin/sh", "-c", "ls /sys/fs/cgroup/*/release_agent "
                                           "/sys/fs/cgroup/release_agent 2>/dev/null; true"])
    return Seen(level, r.stdout.decode(), status, mountinfo, agents.stdout.decode())


def host_seen(marks, engine_dir: str) -> Seen:
    """The probe on the host as root (the calibration), with a live engine's socket
    directory to search."""
    text = on_host(checks_for(marks, engine_dir))
    with open("/proc/self/status") as fh:
        status = fh.read()
    with open("/proc/self/mountinfo") as fh:
        mountinfo = fh.read()
    return Seen("host", text, status, mountinfo,
                "\n".join(p for p in ("/sys/fs/cgroup/memory/release_agent",
                                      "/sys/fs/cgroup/release_agent") if os.path.exists(p)))


@pytest.fixture(scope="module")
def calibration(levels):
    return levels["host"]


@pytest.fixture(scope="module")
def levels(local_provider, busybox_rootfs, marks):
    """Every level's Seen, each from a real sandbox (the Podman services are this
    module's own), and the host's ("host"), taken while an engine's socket is live."""
    import sandman_ray as sandman
    from conftest import LOCAL_CACHE, LOCAL_STATE, run
    from sandman_ray.spec import DEFAULT_IMAGE, SandboxSpec
    from sandman_ray.providers.docker import DockerProvider
    out = {}
    for level, spec in (("local", SandboxSpec()), ("local-network", SandboxSpec(network=True)),
                        ("local-host", SandboxSpec(image="host"))):
        with Sandbox(local_provider, spec) as sb:
            out[level] = look(level, sb.client, marks)
    gvisor = sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                                   isolation="gvisor").bind("bench-gv-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(gvisor, DEFAULT_IMAGE) as sb:
            out["local-gvisor"] = look("local-gvisor", sb.client, marks)
    finally:
        run(gvisor.shutdown())
    for runtime in ("runc", "runsc"):
        with podman_with_busybox("bench-" + runtime, busybox_rootfs, runtime) as service:
            docker = DockerProvider(base_url=service.base_url,
                                    runtime="runsc" if runtime == "runsc" else None,
                                    state_root=os.path.join(DOCKER_WORK, "bench-" + runtime),
                                    cache_root=LOCAL_CACHE).bind("bench-%s" % runtime)
            try:
                with Sandbox(docker, DOCKER_IMAGE) as sb:
                    out["docker-" + runtime] = look("docker-" + runtime, sb.client, marks)
                if runtime == "runc":
                    out["host"] = host_seen(marks, os.path.dirname(str(service.socket_path)))
            finally:
                run(docker.shutdown())
    out["local-nobody"] = nobody_level(marks)
    return out


def nobody_level(marks) -> Seen:
    """The probe in a sandbox of an agent that runs as nobody."""
    from test_escape_network import NOBODY, run_as_nobody
    work = "/tmp/sandman-ray-test/nobody-bench-%s" % uuid.uuid4().hex[:6]
    os.makedirs(work, mode=0o700)
    os.chown(work, NOBODY, NOBODY)
    probe = os.path.join(work, "probe")
    shutil.copy(probe_binary(), probe)
    os.chmod(probe, 0o755)
    try:
        out = run_as_nobody(work, marks["port"], [], probe=probe,
                            checks=checks_for(marks))
    finally:
        subprocess.run(["rm", "-rf", work])
    report = out["probe"]
    return Seen("local-nobody", report["text"], report["status"], report["mountinfo"],
                report["release_agents"])


def proven(level: Seen, host: Seen, check: str, inside: str) -> bool:
    """Whether a refused check shows the level's wall: the host reaches the call, or
    answers it otherwise (the refusal is the sandbox's own)."""
    there = host.verdict(check)
    return there.startswith("reached") or there != inside


def assert_refused(levels, calibration, level: str, checks) -> None:
    seen = levels[level]
    for check in checks:
        inside = seen.verdict(check)
        assert inside.split()[0] == "refused" and inside.split()[1] in DOORS, \
            "%s: %s %s" % (level, check, inside)
        assert proven(seen, calibration, check, inside), \
            "%s: %s proves nothing: the host answers it as the sandbox does (%s)" \
            % (level, check, inside)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scenario", sorted(CALLS))
def test_the_kernel_doors_of_known_escapes_are_shut(levels, calibration, level, scenario):
    """io_uring, packet, raw and exotic sockets, eBPF, perf events, userfaultfd, the
    keyring, kexec, module loading, file handles (shocker), the mount API and new
    namespaces (the privileged, sys_admin, sys_module, dac_read_search, bpf_privesc,
    packet_socket and cgroup_release_agent scenarios need one of these)."""
    assert_refused(levels, calibration, level, CALLS[scenario])


def caps(status: str, field: str) -> int:
    match = re.search(r"^%s:\s*([0-9a-f]+)$" % field, status, re.M)
    assert match, "no %s in the status: %r" % (field, status[:300])
    return int(match.group(1), 16)


@pytest.mark.parametrize("level", LEVELS)
def test_no_dangerous_capability_and_a_filter_privileged(levels, calibration, level):
    """The 'privileged', 'sys_admin', 'sys_module', 'dac_read_search' and 'pid_namespace'
    (SYS_PTRACE) scenarios start from a capability: none of them is held, effective or
    in the bounding set, and the process runs under a seccomp filter with
    no_new_privs. The host's root holds them all (the check can tell)."""
    seen = levels[level]
    held = {name for name, bit in DANGEROUS_CAPS.items()
            if (caps(seen.status, "CapEff") | caps(seen.status, "CapBnd")) >> bit & 1}
    assert held == set(), "%s holds %s" % (level, sorted(held))
    assert all(caps(calibration.status, "CapEff") >> bit & 1 for bit in DANGEROUS_CAPS.values())
    if level not in GVISOR:  # gVisor's status has no such fields; its probe says it
        assert re.search(r"^Seccomp:\s*2$", seen.status, re.M), seen.status
        assert re.search(r"^NoNewPrivs:\s*1$", seen.status, re.M), seen.status


@pytest.mark.parametrize("level", LEVELS)
def test_no_engine_socket_is_reachable_docker_socket(levels, calibration, level):
    """'docker_socket': no unix socket in the sandbox's files accepts a connection (an
    engine's, Ray's) but its own daemon's. The same search on the host finds the
    Podman service's socket."""
    seen = levels[level]
    assert set(seen.sockets) <= OWN_SOCKETS.get(level, set()), "%s: %s" % (level, seen.sockets)
    assert len(seen.sockets) < 3  # the probe names the first three
    assert seen.verdict("find_sockets").endswith("-of-%d" % max(1, len(seen.sockets))) or \
        not seen.sockets
    assert calibration.verdict("find_sockets").startswith("reached") and calibration.sockets


@pytest.mark.parametrize("level", LEVELS)
def test_no_host_process_is_visible_pid_namespace(levels, calibration, level):
    """'pid_namespace': a process of the host is not in the sandbox's /proc (whose scan
    sees the sandbox's own processes); on the host the scan finds it."""
    verdict = levels[level].verdict("proc_cmdline")
    assert verdict.startswith("refused 0-of-") and not verdict.endswith("-of-0"), verdict
    assert calibration.verdict("proc_cmdline").startswith("reached")


@pytest.mark.parametrize("level", LEVELS)
def test_no_host_path_through_proc_root(levels, calibration, level):
    """Host paths through /proc/<pid>/root: a file only the host has is not reached
    through any process's root the sandbox can see."""
    verdict = levels[level].verdict("proc_root")
    assert verdict.startswith("refused 0-of-"), verdict
    assert calibration.verdict("proc_root").startswith("reached")


@pytest.mark.parametrize("level", LEVELS)
def test_no_host_listener_is_reachable_host_network(levels, calibration, level, marks):
    """A host network namespace (or a route to the host, 'k8s_route_localnet'): the
    host's loopback and every address of the node, where a listener waits, cannot be
    reached; from the host they can, and the listener saw nothing from a sandbox."""
    for verdict in levels[level].verdicts("connect"):
        assert verdict != ["reached", "ok"], level
    assert all(v == ["reached", "ok"] for v in calibration.verdicts("connect"))


@pytest.mark.parametrize("level", LEVELS)
def test_no_writable_host_storage_hostpath(levels, calibration, level):
    """'hostpath_etc' and writable host mounts: no mount of the host's storage is
    writable but what the level has by design (a container's socket directory); the
    host's own root is one (the parser can tell)."""
    def writable(mountinfo):
        out = set()
        for line in mountinfo.splitlines():
            fields = line.split()
            if " - " not in line or len(fields) < 6:
                continue
            fstype = fields[fields.index("-") + 1]
            if "rw" in fields[5].split(",") and fstype in DISK_FS:
                out.add(fields[4])
        return out
    found = writable(levels[level].mountinfo)
    assert found <= OWN_WRITABLE.get(level, set()), "%s: %s" % (level, sorted(found))
    assert levels[level].mountinfo.strip(), level
    assert "/" in writable(calibration.mountinfo)


@pytest.mark.parametrize("level", LEVELS)
def test_proc_sys_and_release_agent_cannot_be_written(levels, calibration, level):
    """'cgroup_release_agent' and /proc/sys writes (core_pattern, the benchmark's
    classic): sysctls cannot be opened for writing, no cgroup release_agent is there to
    write (and cgroupfs cannot be mounted: the mount check above); the bundle the host
    runs the daemon from is read-only ('runc_overwrite' overwrote the runtime's
    binary). On the host each opens."""
    for verdict in levels[level].verdicts("write"):
        assert verdict[0] == "refused" or verdict[1] in ("EROFS", "ETXTBSY", "ENOENT"), \
            "%s: %s" % (level, verdict)
    assert levels[level].release_agents.strip() == "", level
    host = calibration.verdicts("write")
    assert host[0] == ["reached", "ok"] and host[1] == ["reached", "ok"]
    assert calibration.release_agents.strip()


def test_the_host_kernel_and_runtimes_are_outside_the_benchmarks_cve_ranges():
    """The benchmark's kernel scenarios (dirty_cow CVE-2016-5195, bpf_privesc
    CVE-2017-16995, packet_socket CVE-2017-7308, dirty_pipe CVE-2022-0847,
    cgroup_release_agent CVE-2022-0492) need an old kernel; its runtime ones
    (runc_overwrite CVE-2019-5736, k8s_runc CVE-2024-21626) an old runc. The
    LocalProvider runs no runc; the DockerProvider's Podman runs the host's."""
    release = os.uname().release
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", release).groups())
    assert (major, minor) >= (5, 17), "kernel %s is within a benchmark CVE's range" % release
    out = subprocess.run(["runc", "--version"], capture_output=True, text=True).stdout
    version = re.search(r"runc version (\d+)\.(\d+)\.(\d+)", out)
    assert version, out
    if tuple(int(x) for x in version.groups()) < (1, 1, 12):
        # a distribution's runc with the fixes backported (Debian 12: 1.1.5+ds1-1+deb12u1)
        changelog = subprocess.run(["zcat", "/usr/share/doc/runc/changelog.Debian.gz"],
                                   capture_output=True, text=True).stdout
        assert "CVE-2024-21626" in changelog, "runc %s lacks the fix of CVE-2024-21626" % out
    assert tuple(int(x) for x in version.groups()) >= (1, 0, 0), out  # CVE-2019-5736


def test_every_check_is_in_security_md():
    """SECURITY.md's escape-bench table names every check of this module."""
    from conftest import ROOT
    text = (ROOT / "SECURITY.md").read_text()
    section = text[text.index("## The escape-bench suite"):]
    names = set(CALLS) | {"privileged", "docker_socket", "pid_namespace", "proc_root",
                          "host_network", "hostpath", "proc_sys_release_agent",
                          "kernel_cves"}
    missing = [n for n in sorted(names) if "`%s`" % n not in section]
    assert missing == []
