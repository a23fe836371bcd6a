"""What code inside a LocalProvider sandbox cannot do, tried from inside real bwrap
sandboxes on a real local Ray: reach the host's processes (ptrace, /proc, signals),
see another sandbox, mount or make namespaces, write the daemon bundle, reach a host
port, read a host disk through a device node. Plus the daemon's own defences that the
provider relies on: owner-only sockets, no TCP listener, tokens compared in constant
time."""

import _operator
import hmac
import os
import socket
import stat
import uuid
from pathlib import Path

import pytest

from conftest import DAEMON, Sandbox

# CapEff bits a sandbox must not hold (linux/capability.h)
FORBIDDEN_CAPS = {"SYS_MODULE": 16, "SYS_RAWIO": 17, "SYS_PTRACE": 19, "SYS_ADMIN": 21,
                  "SYS_BOOT": 22, "NET_ADMIN": 12, "SYS_TIME": 25, "MAC_ADMIN": 33,
                  "BPF": 39, "PERFMON": 38, "DAC_READ_SEARCH": 2}
PTRACE_ATTACH = 16
SYSCALL = ("python3 -c 'import ctypes, os, sys; l = ctypes.CDLL(None, use_errno=True); "
           "r = l.syscall(%s); print(r, os.strerror(ctypes.get_errno()) if r < 0 else \"\")'")


@pytest.fixture(scope="module")
def provider(local_provider):
    return local_provider


@pytest.fixture(scope="module")
def host_box(provider):
    """A sandbox of the ``host`` image (it has python3 and util-linux), shared by the
    tests that only look."""
    with Sandbox(provider, "host") as sb:
        yield sb


def sh(sb, cmd: str) -> str:
    r = sb.client.exec(cmd)
    return (r.stdout + r.stderr).decode()


def test_host_processes_are_out_of_reach(host_box):
    me = os.getpid()
    inside = [p for p in host_box.client.exec("ls /proc").text.split() if p.isdigit()]
    assert str(me) not in inside and len(inside) <= 4  # the daemon, the shell, ls
    out = sh(host_box, "cat /proc/%d/cmdline; kill -0 %d; kill -0 %d" % (me, me, os.getppid()))
    assert "No such file" in out and out.count("No such process") == 2
    # ptrace (system call 101) of the test process: not even visible from inside
    assert "No such process" in sh(host_box, SYSCALL % ("101, %d, %d, 0, 0"
                                                        % (PTRACE_ATTACH, me)))


def test_capabilities_exclude_admin_ptrace_and_modules(host_box):
    status = dict(line.split(":\t") for line in
                  host_box.client.read_file("/proc/self/status").decode().splitlines()
                  if line.startswith("Cap") or line.startswith("NoNewPrivs"))
    # the daemon's own status; a command's is the same (the daemon starts it as is)
    command = sh(host_box, "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status")
    effective = int(status["CapEff"], 16)
    held = [name for name, bit in FORBIDDEN_CAPS.items() if effective >> bit & 1]
    assert held == []
    assert "CapEff:\t%s" % status["CapEff"] in command
    assert "NoNewPrivs:\t1" in command and "Seccomp:\t2" in command  # a filter is on


def test_mounts_and_new_namespaces_are_refused(host_box):
    out = sh(host_box, "mount -t tmpfs none /mnt; echo mount=$?; unshare -m true; "
                       "echo mountns=$?; unshare -U -r -m true; echo userns=$?; "
                       "mount -o remount,rw /usr; echo remount=$?")
    assert "mount=0" not in out and "mountns=0" not in out
    assert "userns=0" not in out and "remount=0" not in out
    # the kernel keyring is not namespaced: refused by the seccomp filter
    assert "Operation not permitted" in sh(host_box, SYSCALL % "250, 0, 0, 0, 0, 0")
    # threads still start (clone3 is refused, so the C library falls back to clone)
    assert sh(host_box, "python3 -c 'import threading; t = threading.Thread(target=print, "
                        "args=(\"ok\",)); t.start(); t.join()'") == "ok\n"


def test_a_device_node_of_the_host_disk_cannot_be_made(host_box):
    """Root inside is root of a user namespace: the kernel refuses it device nodes (and
    every writable filesystem in the sandbox is mounted nodev besides)."""
    dev = os.stat("/").st_dev
    node = "/tmp/disk-%s" % uuid.uuid4().hex[:6]
    out = sh(host_box, "mknod %s b %d %d; echo made=$?; head -c 512 %s > /dev/null; "
                       "echo read=$?" % (node, os.major(dev), os.minor(dev), node))
    assert "made=1" in out and "Operation not permitted" in out and "read=0" not in out


def test_the_daemon_bundle_and_host_directories_are_read_only(host_box):
    out = sh(host_box, "touch /.sandman/x; echo bundle=$?; touch /usr/x; echo usr=$?; "
                       "touch /etc/x; echo etc=$?")
    assert "bundle=1" in out and "usr=1" in out and "etc=1" in out
    assert out.count("Read-only file system") == 3


def test_no_host_port_is_reachable_by_default(host_box):
    listeners = []
    for address in ("127.0.0.1", _host_address()):
        if address is None:
            continue
        server = socket.socket()
        server.bind((address, 0))
        server.listen()
        listeners.append(server)
    try:
        for server in listeners:
            address, port = server.getsockname()
            out = sh(host_box, "python3 -c 'import socket; s = socket.socket(); "
                               "s.settimeout(3); print(s.connect_ex((\"%s\", %d)))'"
                     % (address, port))
            assert out.strip() not in ("0", "11"), (address, out)  # refused or unreachable
    finally:
        for server in listeners:
            server.close()


def _host_address():
    """This host's address on its default route, or None without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent
        address = probe.getsockname()[0]
        return None if address.startswith("127.") else address
    except OSError:
        return None
    finally:
        probe.close()


def test_sandboxes_cannot_see_each_other(provider, busybox_rootfs):
    marker = "secret-" + uuid.uuid4().hex[:8]
    image = "dir:%s" % busybox_rootfs
    with Sandbox(provider, image) as a, Sandbox(provider, image) as b:
        b.client.write_file("/tmp/%s" % marker, marker.encode())
        b.client.spawn(["sleep", "300"], env={"MARK": marker})
        # the marker as a pattern that does not match the command's own arguments
        pattern = marker[:7] + "[" + marker[7] + "]" + marker[8:]
        look = ("cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' "
                "| grep -c '%s'; find / -path /proc -prune -o -name '%s*' -print"
                % (pattern, pattern))
        assert sh(b, look).split() == ["1", "/tmp/" + marker]  # the look finds them in b
        assert sh(a, look).split() == ["0"]
        # the other sandbox's socket and state are not in this one's tree
        other = os.path.dirname(b.info.address.split(":", 1)[1])
        assert "No such file" in sh(a, "ls %s" % other)


def test_daemon_sockets_are_owner_only_and_nothing_listens_on_tcp(host_box):
    path = host_box.info.address.split(":", 1)[1]
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    tcp = host_box.client.read_file("/proc/net/tcp").decode().splitlines()[1:]
    tcp6 = host_box.client.read_file("/proc/net/tcp6").decode().splitlines()[1:]
    assert [line for line in tcp + tcp6 if line.split()[3] == "0A"] == []  # 0A: LISTEN


def test_tokens_are_compared_in_constant_time():
    """The daemon compares tokens with the standard library's constant-time compare (a
    timing test would measure only noise here), and nowhere with ``==``."""
    from sandman_ray.daemon.sandmand import connection
    assert Path(connection.__file__).parent == DAEMON  # the package the sandboxes run
    assert connection._tokens_equal in (hmac.compare_digest, _operator._compare_digest)
    text = Path(connection.__file__).read_text()
    assert "_tokens_equal(given, self.daemon.token.encode())" in text  # the lease's
    assert "_tokens_equal(given, admin.encode())" in text  # the launcher's (renew)
    source = "".join(path.read_text() for path in sorted(DAEMON.rglob("*.py")))
    assert [line for line in source.splitlines()
            if "token" in line and ("==" in line or "!=" in line)] == []
