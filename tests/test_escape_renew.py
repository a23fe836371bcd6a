"""The escape suite (see test_escape.py) against a sandbox renewed in place: a reset
that keeps the sandbox's namespaces and daemon (providers/local/renew.py) must leave
the next tenant nothing of the last one, and nothing of the skeleton the generations
live in may be changed or reveal another generation."""

import time

import pytest

from conftest import Sandbox, run
from escape_kit import provider  # noqa: F401 - a fixture: pytest finds it by name
from sandman_ray import AuthError, DaemonClient, DaemonError
from sandman_ray.spec import DEFAULT_IMAGE

# Tenant A's leftovers, of every kind a renew must remove: files in the writable layer
# (new ones and a changed file of the image), in /dev/shm, a SysV shared memory
# segment, message queue and semaphore set, a POSIX message queue, and processes: one
# in the background, one that left its process group and session, one that forks
# without end.
PLANT = r"""
echo A > /tmp/a; echo A > /root/a; echo A >> /etc/hostname; echo A > /dev/shm/a
ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null
python3 -c '
import ctypes, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
assert rt.mq_open(b"/tenant-a", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0, ctypes.get_errno()'
"""
# started as background processes (an exec's own end stops what it started)
PROCESSES = ("sleep 1000", "setsid sh -c 'exec sleep 1000'",
             "sh -c 'while :; do sleep 1000 & sleep 0.01; done'")
LOOK = r"""
echo files $(ls -A /tmp | grep -c .) $(ls -A /dev/shm | grep -c .) \
    $(ls -A /root | grep -c '^a$') $(grep -c A /etc/hostname)
echo ipc $(ipcs -m | grep -c '^0x') $(ipcs -q | grep -c '^0x') $(ipcs -s | grep -c '^0x')
python3 -c '
import ctypes, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
print("mq", rt.mq_open(b"/tenant-a", os.O_RDWR, 0, None) >= 0)'
echo sleeping $(cat /proc/[0-9]*/comm 2>/dev/null | grep -c sleep)
"""
ESCAPE = r"""
import os
os.makedirs("/tmp/jail", exist_ok=True)
outside = os.open("/", os.O_RDONLY)
os.chroot("/tmp/jail")  # the classic way out: chroot below, then climb from the old root
os.fchdir(outside)
for _ in range(64):
    os.chdir("..")
os.chroot(".")
gens = sorted(os.listdir("/.gens"))
print("gens", gens, [sorted(os.listdir("/.gens/" + g)) != [] for g in gens])
print("top", sorted(os.listdir("/")))
try:
    open("/planted", "w")
    print("wrote the skeleton")
except OSError as exc:
    print("skeleton", exc.errno)
"""


def _renewed(sb):
    """Reset ``sb`` through its provider; the new token's client. The daemon lives on
    (a renew, not a new start): its uptime goes on."""
    before = sb.client.info()["uptime_s"]
    sb.info = run(sb.provider.reset(sb.id))
    sb.client.close()
    sb.client = DaemonClient(sb.info.address, sb.info.token, default_timeout=60)
    assert sb.client.info()["uptime_s"] > before, "the sandbox was started afresh"
    return sb.client


def test_a_renewed_sandbox_keeps_nothing_of_the_last_tenant(provider):
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        old = sb.info.token
        planted = sb.client.exec(["/bin/sh", "-c", PLANT])
        assert planted.exit_code == 0, planted.stderr
        for cmd in PROCESSES:
            sb.client.spawn(["/bin/sh", "-c", cmd])
        time.sleep(0.3)
        seen = sb.client.exec(["/bin/sh", "-c", LOOK]).stdout.decode().splitlines()
        assert seen[:3] == ["files 1 1 1 1", "ipc 1 1 1", "mq True"], seen
        assert int(seen[3].split()[1]) >= 2, seen  # the lone sleep and the forker's
        time.sleep(0.5)  # its next layer is made
        client = _renewed(sb)
        after = client.exec(["/bin/sh", "-c", LOOK]).stdout.decode().splitlines()
        # (the image's /tmp and /dev/shm are empty, its hostname has no A)
        assert after == ["files 0 0 0 0", "ipc 0 0 0", "mq False", "sleeping 0"], after
        with pytest.raises((AuthError, ConnectionError, OSError)):
            DaemonClient(sb.info.address, old).exec("true")


def test_a_tenant_that_leaves_its_chroot_finds_only_a_read_only_skeleton(provider):
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        assert sb.client.exec("echo A > /tmp/secret-a").exit_code == 0
        time.sleep(0.5)
        client = _renewed(sb)
        out = client.exec(["python3", "-c", ESCAPE])
        text = out.stdout.decode()
        assert out.exit_code == 0, out.stderr
        # one slot holds this generation, the other nothing: the last tenant's is gone
        assert "gens ['a', 'b'] [False, True]" in text or \
            "gens ['a', 'b'] [True, False]" in text, text
        assert "top ['.gens', '.sandman', 'dev', 'proc']" in text, text
        assert "skeleton 30" in text, text  # EROFS
        assert "secret-a" not in client.exec("ls -R /tmp").stdout.decode()


def test_renew_is_the_launchers_op_and_its_token_is_nowhere_inside(provider):
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        with pytest.raises(DaemonError, match="AuthError"):
            sb.client.renew("quiet")  # the lease's token may not
        assert sb.client.exec("true").exit_code == 0  # and nothing was stopped
        seen = sb.client.exec(["/bin/sh", "-c", "cat /proc/1/cmdline /proc/1/environ; "
                               "ls -l /proc/1/fd 2>&1"]).stdout
        assert b"admin-token-fd" in seen  # named as a descriptor, its value in no file
        # the daemon is undumpable: its descriptors and memory are closed to the tenant
        assert b"Permission denied" in seen or b"cannot access" in seen


def _started_afresh(sb):
    """Reset ``sb``; the new token's client, asserting the daemon started again (its
    uptime began anew): what a renew that finds the sandbox changed falls back to."""
    time.sleep(1.5)  # an uptime that a new daemon's cannot reach
    before = sb.client.info()["uptime_s"]
    sb.info = run(sb.provider.reset(sb.id))
    sb.client.close()
    sb.client = DaemonClient(sb.info.address, sb.info.token, default_timeout=60)
    assert sb.client.info()["uptime_s"] < before, "the sandbox was renewed as it was"
    return sb.client


def test_what_a_tenant_sets_on_the_daemon_is_not_carried_to_the_next(provider):
    """Root inside may lower PID 1's limits or priority (its uid matches), and the
    daemon's later children would inherit them: such a sandbox is started afresh."""
    look = ["/bin/sh", "-c", "ulimit -n; nice"]
    for attack in ("prlimit --pid 1 --nofile=64:64", "renice -n 19 -p 1"):
        with Sandbox(provider, DEFAULT_IMAGE) as sb:
            first = sb.client.exec(look).stdout.split()
            done = sb.client.exec(["/bin/sh", "-c", attack])
            assert done.exit_code == 0, done.stderr
            assert sb.client.exec(look).stdout.split() != first  # it took
            client = _started_afresh(sb)
            assert client.exec(look).stdout.split() == first


# What else root inside may set on PID 1 that the daemon's children inherit, and how a
# new command sees it: CPU affinity, scheduling policy, I/O priority. (Its OOM score and
# autogroup are /proc/1 files, which the undumpable daemon's are not the tenant's to
# write; the daemon compares them too.)
ATTRIBUTES = (
    ("taskset -p 1 1", "taskset -p $$"),
    ("chrt -i -p 0 1", "chrt -p $$"),
    ("ionice -c 3 -p 1", "ionice -p $$"),
)


@pytest.mark.parametrize("attack,look", ATTRIBUTES)
def test_no_process_attribute_of_the_daemon_carries_to_the_next_tenant(provider, attack, look):
    """Tenant A pins PID 1 to one CPU, makes it SCHED_IDLE or idle for I/O: A's later
    commands inherit it; tenant B's must not (the daemon compares every attribute it
    started with, and the sandbox starts afresh). Before, B's commands ran pinned."""
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        first = sb.client.exec(["/bin/sh", "-c", look]).stdout.split()
        done = sb.client.exec(["/bin/sh", "-c", attack])
        assert done.exit_code == 0, done.stderr
        assert sb.client.exec(["/bin/sh", "-c", look]).stdout.split() != first  # it took
        client = _started_afresh(sb)
        assert client.exec(["/bin/sh", "-c", look]).stdout.split()[-1:] == first[-1:]


# sched_setattr (314) and sched_getattr (315) on x86_64, with struct sched_attr: size,
# policy, flags, nice, priority, runtime, deadline, period, util_min, util_max
SCHED = r"""
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
ATTR = struct.Struct("<IIQiIQQQII")
def get(pid):
    buf = ctypes.create_string_buffer(ATTR.size)
    assert libc.syscall(315, pid, buf, ATTR.size, 0) == 0, ctypes.get_errno()
    return list(ATTR.unpack(buf.raw))
if sys.argv[1] == "set":  # PID 1 as it is (a fair task), with a time slice of its own
    attr = get(1)
    attr[5] = 57000000
    assert libc.syscall(314, 1, ctypes.create_string_buffer(ATTR.pack(*attr)), 0) == 0, \
        ctypes.get_errno()
print(*get(0))
"""


def test_a_scheduler_slice_set_on_the_daemon_is_not_carried_to_the_next_tenant(provider):
    """sched_setattr gives a fair task a time slice of its own (EEVDF keeps it in
    sched_runtime) without any capability: tenant A sets 57 ms on PID 1, and A's later
    commands inherit it; tenant B's, after a reset, must not (the daemon compares each
    thread's whole sched_getattr struct, and the sandbox starts afresh). Before, the
    renew compared nice, policy and priority only, and B's commands ran with A's
    slice. Renewing in place is the default LocalProvider sandbox's alone (a rootfs
    image, no network, its own range): the other levels start afresh at every reset."""
    look = ["python3", "-c", SCHED, "look"]
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        first = sb.client.exec(look).stdout.split()
        assert first[5] != b"57000000", first
        done = sb.client.exec(["python3", "-c", SCHED, "set"])
        assert done.exit_code == 0, done.stderr
        assert sb.client.exec(look).stdout.split()[5] == b"57000000"  # it took
        client = _started_afresh(sb)
        assert client.exec(look).stdout.split() == first


def test_archives_look_up_no_owner_names_in_the_tenants_files(provider):
    """A user or group lookup in the daemon would load the NSS modules the sandbox's
    own /etc/nsswitch.conf names, from its own files, into the process that outlives
    its tenants: archives carry numeric owners only."""
    import io
    import tarfile
    with Sandbox(provider, DEFAULT_IMAGE) as sb:
        assert sb.client.exec(["/bin/sh", "-c", "mkdir -p /tmp/t && echo x > /tmp/t/f && "
                                               "chown 1:1 /tmp/t/f"]).exit_code == 0
        with tarfile.open(fileobj=io.BytesIO(sb.client.get_archive("/tmp/t"))) as tar:
            owners = {(m.uname, m.gname, m.uid) for m in tar.getmembers()}
        assert ("", "", 1) in owners and all(not u and not g for u, g, _ in owners), owners
