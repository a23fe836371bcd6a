"""The node's shared tables (SECURITY.md, "The node's shared tables"): one sandbox that
fills a table the whole node shares (native AIO contexts, open files, pids) leaves its
neighbours and the host theirs, and the page cache sandboxes of one image share does
not say which pages a neighbour read. Each attack runs at the levels where it applies:

    local           LocalProvider, builtin:debian (user namespace, seccomp, cgroups)
    local-network   the same with network=True
    local-gvisor    LocalProvider(isolation="gvisor"): its kernel's tables are its own;
                    what it may ask of the host's is the policy's (EPERM) and its rlimits
    docker          DockerProvider (Podman, runc), a busybox container: no Python, so the
                    escape probe makes its calls (AIO and the page cache: the policy's
                    refusals; its open files and pids are the engine's limits)

Filling the host's real open-file and pid tables would harm the machine (fs.file-max is
in the billions once the agent raised it): those tests check the budget's arithmetic on
the node as the agent left it, and fill the sandbox's own share until the kernel stops
it, while a neighbour and the host go on."""

import os
import subprocess
import sys
import uuid

import pytest

from conftest import LOCAL_CACHE, LOCAL_STATE, Sandbox, run, wait_until
from escape_kit import (  # noqa: F401 - fixtures: pytest finds them by name
    DOCKER_IMAGE, docker_provider, engine, provider)
from probe_kit import raw_in_sandbox
from sandman_ray.errors import ProviderError
from sandman_ray.providers.local import host_tables
from sandman_ray.providers.local.host_tables import HOST_ROOM, PoolNeeds
from sandman_ray.spec import DEFAULT_IMAGE, DEFAULT_NOFILE, SandboxSpec

LEVELS = ("local", "local-network", "local-gvisor", "docker")
NR = {"io_setup": 206, "io_destroy": 207, "mincore": 27, "cachestat": 451}


@pytest.fixture(scope="module")
def gvisor_provider():
    from sandman_ray.providers.local import LocalProvider
    provider = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                             isolation="gvisor").bind("tables-gv-%s" % uuid.uuid4().hex[:6])
    yield provider
    run(provider.shutdown())


def level_sandbox(request, level: str, **spec) -> Sandbox:
    """A sandbox of ``level`` (not yet entered) with ``spec``'s fields."""
    if level == "docker":
        return Sandbox(request.getfixturevalue("docker_provider"),
                       SandboxSpec(image=DOCKER_IMAGE, **spec))
    if level == "local-gvisor":
        return Sandbox(request.getfixturevalue("gvisor_provider"), SandboxSpec(**spec))
    return Sandbox(request.getfixturevalue("provider"),
                   SandboxSpec(network=level == "local-network", **spec))


def python(sb, code: str, *args) -> str:
    done = sb.client.exec(["python3", "-c", code] + [str(a) for a in args], timeout=60)
    assert done.exit_code == 0, done
    return done.stdout.decode()


def held(sb, path: str) -> str:
    """What a background process of ``sb`` wrote to ``path`` once it holds its share,
    read by the daemon itself (the sandbox may have no process to spare for a cat)."""
    from sandman_ray.errors import DaemonError

    def report():
        try:
            return sb.client.read_file(path).decode()
        except DaemonError:  # not there yet
            return None
    return wait_until(report, timeout=60, what="the sandbox's process to report %s" % path)


def io_setup(events: int) -> int:
    """io_setup(events) on the host, in this process; 0 or the errno (the context is
    destroyed at once)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ctx = ctypes.c_ulong(0)
    if libc.syscall(NR["io_setup"], events, ctypes.byref(ctx)) != 0:
        return ctypes.get_errno()
    libc.syscall(NR["io_destroy"], ctx)
    return 0


def read_sys(setting: str) -> int:
    return host_tables.read(setting)


# ---- native AIO contexts: fs.aio-max-nr

# io_setup(N) as a background process that keeps its context; it writes the answer
AIO_HOLD = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
ctx = ctypes.c_ulong(0)
answer = libc.syscall(206, int(sys.argv[1]), ctypes.byref(ctx))
with open(sys.argv[2], "w") as fh:
    fh.write("%d %d\n" % (answer, 0 if answer == 0 else ctypes.get_errno()))
time.sleep(600)
"""
AIO_ONE = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ctx = ctypes.c_ulong(0)
answer = libc.syscall(206, 1, ctypes.byref(ctx))
print(answer, 0 if answer == 0 else ctypes.get_errno())
"""


@pytest.mark.parametrize("level", LEVELS)
def test_one_sandbox_cannot_take_the_nodes_aio_contexts(request, provider, level):
    """Before, one io_setup(65536) in a sandbox took the node's whole fs.aio-max-nr and
    every other sandbox's and host root's io_setup(1) got EAGAIN. Native AIO is refused
    (ENOSYS, a kernel without it; EPERM in gVisor's kernel) while the attacker holds its
    process open; the node's count of contexts does not move, the host's io_setup still
    works, and so does a neighbour's that asked for AIO by name."""
    import errno
    limit = read_sys("fs.aio-max-nr")
    before = read_sys("fs.aio-nr")
    with level_sandbox(request, level) as attacker:
        if level == "docker":  # busybox: the probe makes the call
            answer = raw_in_sandbox(attacker.client, [NR["io_setup"], NR["io_destroy"]])
            assert answer == {NR["io_setup"]: "ENOSYS", NR["io_destroy"]: "ENOSYS"}, answer
        else:
            attacker.client.spawn(["python3", "-c", AIO_HOLD, str(limit), "/tmp/aio"])
            refused = errno.EPERM if level == "local-gvisor" else errno.ENOSYS
            assert held(attacker, "/tmp/aio").split() == ["-1", str(refused)]
        assert read_sys("fs.aio-nr") == before
        assert io_setup(1) == 0
        with Sandbox(provider, SandboxSpec(capabilities=["AIO"])) as neighbour:
            assert python(neighbour, AIO_ONE).split() == ["0", "0"]


# ---- open files: fs.file-max

# Forks ``n`` processes; each raises its soft limit to the hard one, opens eventfds
# until the kernel refuses, and holds them. The parent writes "hard raise-refused
# count errno" per process, once all hold theirs.
FILES_HOLD = r"""
import os, resource, sys, time
n, path = int(sys.argv[1]), sys.argv[2]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
    raised = "raised"
except (ValueError, OSError):
    raised = "refused"
readers = []
for _ in range(n):
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        fds = []
        try:
            while True:
                fds.append(os.eventfd(0))
        except OSError as exc:
            os.write(w, b"%d %s %d %d\n" % (hard, raised.encode(), len(fds), exc.errno))
        time.sleep(600)
    os.close(w)
    readers.append(r)
lines = b"".join(os.read(r, 100) for r in readers)
with open(path + ".part", "wb") as fh:
    fh.write(lines)
os.rename(path + ".part", path)
time.sleep(600)
"""
OPEN_SOME = "import os; fds = [os.eventfd(0) for _ in range(1000)]; print(len(fds))"


def test_the_nodes_open_file_table_holds_the_pools_worst_case_beside_the_host(provider):
    """The agent that serves these sandboxes checked, at its start, that the node's
    fs.file-max holds max_sandboxes x pids x nofile of its pool (a provider without a
    pool: PoolConfig's defaults) beside the host's room, raising it where it fell short,
    and that no process may have more than fs.nr_open. Before, nothing did: one sandbox
    reached fs.file-max 2.46 M."""
    run(provider.warm_up())  # the agent of this node runs
    needs = PoolNeeds.of(None)
    assert read_sys("fs.file-max") >= needs.files() + HOST_ROOM["fs.file-max"]
    assert read_sys("fs.nr_open") >= needs.nofile == DEFAULT_NOFILE


@pytest.mark.parametrize("level", ("local", "local-network", "local-gvisor"))
def test_a_sandbox_that_opens_files_until_refused_leaves_the_node_its_files(request,
                                                                            provider, level):
    """Eight processes of one sandbox each open eventfds until the kernel refuses: each
    stops at its own limit (EMFILE at the spec's nofile, 4,096 by default, which root
    inside cannot raise), not at the node's table (before: the agent's 20,000 each,
    until ENFILE for every process of the host but root's). Meanwhile a neighbour opens
    a thousand, and so does a process of the host that is not root."""
    import errno
    # (a gVisor sandbox's pids are its sentry's host threads and stub processes: 64
    # would not hold eight processes of its own)
    pids = 1024 if level == "local-gvisor" else 64
    with level_sandbox(request, level, pids=pids) as attacker:
        attacker.client.spawn(["python3", "-c", FILES_HOLD, "8", "/tmp/files"])
        reports = [line.split() for line in held(attacker, "/tmp/files").splitlines()]
        assert len(reports) == 8, reports
        for hard, raised, count, code in reports:
            assert (int(hard), raised, int(code)) == (DEFAULT_NOFILE, "refused", errno.EMFILE)
            assert DEFAULT_NOFILE - 16 <= int(count) < DEFAULT_NOFILE
        with Sandbox(provider, SandboxSpec()) as neighbour:
            assert python(neighbour, OPEN_SOME).split() == ["1000"]
        host = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                               "--clear-groups", sys.executable, "-c", OPEN_SOME],
                              capture_output=True, text=True, timeout=60)
        assert host.stdout.split() == ["1000"], host.stderr


# ---- pids: kernel.pid_max and kernel.threads-max

# Forks until the kernel refuses; the children wait. Writes "count errno".
FORK_HOLD = r"""
import os, sys, time
count = 0
while count < 10000:
    try:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
    except OSError as exc:
        code = exc.errno
        break
    count += 1
with open(sys.argv[1] + ".part", "w") as fh:
    fh.write("%d %d\n" % (count, code))
os.rename(sys.argv[1] + ".part", sys.argv[1])
time.sleep(600)
"""
FORK_SOME = r"""
import os
pids = [os.fork() or os._exit(0) for _ in range(32)]
print(sum(os.waitpid(p, 0)[1] == 0 for p in pids))
"""


def test_the_nodes_pid_tables_hold_the_pools_worst_case_beside_the_host(provider):
    """The agent checked, at its start, that kernel.pid_max and kernel.threads-max hold
    max_sandboxes x pids of its pool beside the host's room, raising them where they fell
    short (here pid_max was 32,768: eight sandboxes of 4,096 took it all)."""
    run(provider.warm_up())
    needs = PoolNeeds.of(None)
    for setting in ("kernel.pid_max", "kernel.threads-max"):
        assert read_sys(setting) >= needs.tasks() + HOST_ROOM[setting], setting


@pytest.mark.parametrize("level", ("local", "local-network"))
def test_a_sandbox_that_forks_until_refused_leaves_the_node_its_pids(request, provider, level):
    """A sandbox forks until the kernel refuses, at its pids limit (EAGAIN), and holds
    them; a neighbour still forks 32 processes, and so does the host. (Under gVisor a
    sandbox's tasks are its own kernel's, no host pid each; a container's pids are the
    engine's pids limit.)"""
    import errno
    with level_sandbox(request, level, pids=64) as attacker:
        attacker.client.spawn(["python3", "-c", FORK_HOLD, "/tmp/forks"])
        count, code = held(attacker, "/tmp/forks").split()
        assert int(code) == errno.EAGAIN and 32 < int(count) < 64, (count, code)
        with Sandbox(provider, SandboxSpec(pids=64)) as neighbour:
            assert python(neighbour, FORK_SOME).split() == ["32"]
        host = subprocess.run([sys.executable, "-c", FORK_SOME], capture_output=True,
                              text=True, timeout=60)
        assert host.stdout.split() == ["32"], host.stderr


# ---- the agent's check, on a node of given numbers


def fake_node(tmp_path, **values):
    """A /proc/sys of ``values`` (setting -> number) for host_tables to read and raise."""
    defaults = {"kernel.pid_max": 32768, "kernel.threads-max": 192735,
                "fs.file-max": 2466246, "fs.nr_open": 1048576, "fs.file-nr": "1000 0 2466246"}
    defaults.update(values)
    for setting, value in defaults.items():
        path = tmp_path / setting.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("%s\n" % value)
    return tmp_path


def test_the_agent_raises_what_falls_short_once_and_names_it(tmp_path, caplog):
    root = fake_node(tmp_path)
    needs = PoolNeeds(256, 4096, 4096)
    raised = host_tables.hold(needs, "p", root=root, lock=tmp_path / "lock", may_raise=True)
    assert set(raised) == {"kernel.pid_max", "kernel.threads-max", "fs.file-max"}
    assert host_tables.read("kernel.pid_max", root) >= 256 * 4096 + 32768
    assert host_tables.read("fs.file-max", root) >= 256 * 4096 * 4096 + (1 << 20)
    assert "raised the node's kernel.pid_max from 32768" in caplog.text
    assert host_tables.hold(needs, "p", root=root, lock=tmp_path / "lock",
                            may_raise=True) == {}  # the next agent finds it raised


def test_the_agent_refuses_a_pool_the_node_cannot_hold(tmp_path):
    root = fake_node(tmp_path)
    with pytest.raises(ProviderError, match=r"kernel.pid_max is 32768; the pool's sandboxes "
                                            r"may hold max_sandboxes 2000 x default_pids 4096"
                                            r" = 8192000 .* more than the kernel allows "
                                            r"\(4194304\)") as caught:
        host_tables.hold(PoolNeeds(2000, 4096, 64), "p", root=root, lock=tmp_path / "lock",
                         may_raise=True)
    assert caught.value.kind == "fatal"
    with pytest.raises(ProviderError, match=r"the agent is not root and may not raise it: "
                                            r"set kernel.pid_max = 1081344"):
        host_tables.hold(PoolNeeds(256, 4096, 64), "p", root=root, may_raise=False)
    with pytest.raises(ProviderError, match=r"default_nofile 4096 is more than the node's "
                                            r"fs.nr_open \(1024\)"):
        host_tables.hold(PoolNeeds(1, 1, 4096), "p", root=fake_node(tmp_path, **{
            "fs.nr_open": 1024}), may_raise=False)
    assert host_tables.read("kernel.pid_max", root) == 32768  # nothing was written


# ---- the page cache of an image

# mincore over a mapping of an image's file, and cachestat of the file: each call's
# answer and errno
PAGE_CACHE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.open(os.path.realpath("/usr/bin/python3"), os.O_RDONLY)
size = os.fstat(fd).st_size
os.read(fd, 4096)  # its first page is cached now, for whoever may ask
addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
vec = ctypes.create_string_buffer((size + 4095) // 4096)
answer = libc.syscall(27, ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
print("mincore", answer, 0 if answer == 0 else ctypes.get_errno())
span, stat = (ctypes.c_uint64 * 2)(0, size), (ctypes.c_uint64 * 5)()
answer = libc.syscall(451, fd, span, stat, 0)
print("cachestat", answer, 0 if answer == 0 else ctypes.get_errno())
"""


@pytest.mark.parametrize("level", LEVELS)
def test_no_sandbox_sees_which_pages_of_the_image_a_neighbour_read(request, level):
    """Each sandbox owns the image's files through its idmapped mount, so the kernel
    would answer mincore and cachestat for the page cache that every sandbox of the
    image shares: which pages a neighbour read. Both are refused (ENOSYS, a kernel
    without them; EPERM in gVisor's kernel). Before, both answered. (Eviction by
    fadvise and the time of one's own reads stay: SECURITY.md says so.)"""
    import errno
    with level_sandbox(request, level) as sb:
        if level == "docker":
            answer = raw_in_sandbox(sb.client, [NR["mincore"], NR["cachestat"]])
            assert answer == {NR["mincore"]: "ENOSYS", NR["cachestat"]: "ENOSYS"}, answer
            return
        # (gVisor's kernel has no cachestat of its own: ENOSYS before the filter)
        refused = errno.EPERM if level == "local-gvisor" else errno.ENOSYS
        assert python(sb, PAGE_CACHE).splitlines() == ["mincore -1 %d" % refused,
                                                       "cachestat -1 %d" % errno.ENOSYS]
