"""The system call policy of record (sandman_ray/providers/syscalls.py): every refused
call answers its errno in a real sandbox, a spec lifts a refusal only by naming its
capability, the engines' rendering keeps their allowlist, and SECURITY.md lists every
row. The attacks through these doors, at every level, are tests/test_escape_bench.py's."""

import errno
import json

import pytest

from conftest import ROOT, Sandbox
from escape_kit import provider  # noqa: F401 - a fixture: pytest finds it by name
from probe_kit import in_sandbox, on_host, raw_in_sandbox
from sandman_ray.providers import syscalls

# calls this host's kernel does not have at all: the host answers them as the filter
# does (ENOSYS), so only the filter's own errno elsewhere tells them apart
ABSENT_HERE = {"lookup_dcookie", "nfsservctl", "uselib", "_sysctl"}


def test_security_md_lists_every_row_of_the_policy():
    text = (ROOT / "SECURITY.md").read_text()
    section = text[text.index("## The system call policy"):text.index("## The escape-bench")]
    missing = [name for name in syscalls.every_call() if "`%s`" % name not in section]
    missing += [group for group, *_ in syscalls.SOCKET_RULES if group not in section]
    missing += [r.group for r in syscalls.REFUSALS if r.group not in section]
    missing += [name for name in syscalls.CAPABILITIES if "`%s`" % name not in section]
    assert missing == []


def test_every_refused_call_answers_its_errno_in_a_sandbox(provider):
    """Each number of the table, called with arguments of -1 inside a default sandbox,
    answers the table's errno; on the host the same calls reach the kernel (another
    errno) but for the few this kernel lacks."""
    calls = syscalls.every_call()
    numbers = {number: name for name, (number, _) in calls.items()}
    with Sandbox(provider, "builtin:debian") as sb:
        inside = raw_in_sandbox(sb.client, numbers)
    wanted = {number: errno.errorcode[refusal.errno] for number, refusal in calls.values()}
    assert inside == wanted
    host = dict(line.split() for line in on_host(["raw"] + [str(n) for n in numbers])
                .splitlines())
    same = {numbers[int(n)] for n, answer in host.items() if answer == inside[int(n)]}
    assert same <= ABSENT_HERE, same


def test_a_spec_lifts_a_refusal_only_by_naming_its_capability(provider):
    """IO_URING opens io_uring, NET_RAW raw and packet sockets (and keeps CAP_NET_RAW);
    neither opens anything else, and a default sandbox has neither."""
    from sandman_ray.spec import SandboxSpec
    checks = ["io_uring_setup", "af_packet", "raw_ip", "bpf", "af_vsock", "netlink_xfrm"]
    with Sandbox(provider, SandboxSpec(capabilities=["IO_URING", "NET_RAW"])) as sb:
        lifted = in_sandbox(sb.client, checks)
        status = sb.client.exec(["grep", "CapEff", "/proc/self/status"]).stdout.decode()
    with Sandbox(provider, SandboxSpec()) as sb:
        default = in_sandbox(sb.client, checks)
    assert [lifted[c].split()[0] for c in checks] == ["reached"] * 3 + ["refused"] * 3
    assert all(v.startswith("refused") for v in default.values()), default
    assert int(status.split()[1], 16) >> 13 & 1  # CAP_NET_RAW
    with pytest.raises(ValueError, match="'SYS_ADMIN' is not one of AIO, IO_URING, NET_RAW"):
        SandboxSpec(capabilities=["SYS_ADMIN"])


def test_the_engines_profile_keeps_its_allowlist_and_adds_the_refusals():
    """The DockerProvider's profile is Podman's own with the table's refusals added:
    what Podman allows and the table does not refuse stays allowed, and no refused call
    is left in an allow rule."""
    with open("/usr/share/containers/seccomp.json") as fh:
        base = json.load(fh)
    profile = syscalls.docker_profile(base)
    allowed = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r["args"]
               for n in r["names"]}
    for name in ("read", "write", "openat", "execve", "chroot", "ptrace", "memfd_create"):
        assert name in allowed or any(name in r["names"] for r in profile["syscalls"]
                                      if r["action"] == "SCMP_ACT_ALLOW")
    refused = set(syscalls.every_call())
    for rule in profile["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW":
            assert not refused & set(rule["names"]), rule
    assert profile["defaultAction"] == base["defaultAction"]
    for capability, call in (("IO_URING", "io_uring_setup"), ("AIO", "io_setup")):
        lifted = syscalls.docker_profile(base, frozenset({capability}))
        actions = {r["action"] for r in lifted["syscalls"] if call in r["names"]}
        assert actions == {"SCMP_ACT_ALLOW"}
        refused = {r["action"] for r in profile["syscalls"] if call in r["names"]}
        assert refused == {"SCMP_ACT_ERRNO"}
