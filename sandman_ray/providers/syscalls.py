"""The system call policy of record: what no sandbox may ask of the host's kernel.

Every LocalProvider sandbox runs under a seccomp filter built from this table
(``providers/local/seccomp.py`` assembles it into BPF), and every DockerProvider
container under the engine's own profile with the same refusals added
(``docker_profile``). SECURITY.md's table is this table; ``tests/test_syscall_policy.py``
checks that it lists every row, and runs every refused call in a real sandbox.

The refusals close the kernel surface that container engines' default profiles close,
that task images do not use, and that public container escapes start from: io_uring,
packet and raw sockets, exotic socket families, eBPF, perf events, userfaultfd, module
loading, kexec, file handles (the "shocker" escape), the keyring, the mount API,
namespaces, a few obsolete calls; and what reaches a table of the whole node that no
limit holds per sandbox (native AIO's contexts) or the page cache sandboxes of one image
share (mincore, cachestat). A spec may lift a refusal only by naming the
capability it needs (``SandboxSpec.capabilities``); nothing else lifts them.

Refused calls fail with the errno a kernel without the feature, or a process without
the privilege, would see, so that programs fall back as they would there: ENOSYS for
io_uring, native AIO, page cache residency and obsolete calls (libuv and liburing then
use their thread pools, libaio's users theirs), EPERM for
privileged calls, EAFNOSUPPORT for a refused socket family, EPROTONOSUPPORT for a
refused protocol.
"""

import errno
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

# what a spec may ask for by name (the capabilities that lift a refusal below), and
# what each lifts: checked where a spec is made
from sandman_ray.spec import CAPABILITIES  # noqa: F401

# What root inside a sandbox keeps, in every provider: the default set of container
# engines but NET_RAW, which a spec must ask for. Gone, among others: SYS_ADMIN (mount),
# SYS_PTRACE, SYS_MODULE, DAC_READ_SEARCH, NET_ADMIN, NET_RAW, SYS_TIME, SYS_RAWIO.
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "SETGID",
                        "SETUID", "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT",
                        "KILL", "AUDIT_WRITE")



@dataclass(frozen=True)
class Refusal:
    """A group of system calls refused for one reason.

    group: the name SECURITY.md's table uses.
    calls: name -> x86_64 number.
    why: what the group would open to the code inside.
    errno: what a refused call returns.
    unless: the capability (CAPABILITIES) that lifts the refusal, if any.
    """

    group: str
    calls: Dict[str, int]
    why: str
    errno: int = errno.EPERM
    unless: Optional[str] = None


REFUSALS: Tuple[Refusal, ...] = (
    Refusal("io_uring", {"io_uring_setup": 425, "io_uring_enter": 426,
                         "io_uring_register": 427},
            "a second system call interface, source of a long run of kernel escapes; "
            "refused by Docker's default profile and Podman's, absent from gVisor's",
            errno.ENOSYS, unless="IO_URING"),
    # One io_setup(65536) in a sandbox took the node's whole fs.aio-max-nr (65536 here):
    # every other sandbox's and host root's io_setup(1) then got EAGAIN. ENOSYS is a
    # kernel built without AIO (CONFIG_AIO=n): glibc's POSIX aio (aio_read) never calls
    # these (it runs threads), libaio hands io_setup's -ENOSYS to its caller, and
    # InnoDB then simulates AIO with threads as on such a kernel (a program without a
    # fallback says AIO is missing); CPython calls none.
    Refusal("native AIO", {"io_setup": 206, "io_destroy": 207, "io_getevents": 208,
                           "io_submit": 209, "io_cancel": 210, "io_pgetevents": 333},
            "its contexts are one table of the whole node (fs.aio-max-nr) that no limit "
            "holds per sandbox: one io_setup of 65536 events left every other sandbox and "
            "the host none",
            errno.ENOSYS, unless="AIO"),
    # With the image's files idmapped to each sandbox's range, every sandbox owns them,
    # and the kernel then answers mincore and cachestat for their shared page cache:
    # which pages of the image a neighbour read. ENOSYS is a kernel without them
    # (cachestat came in 6.5; mincore is absent without an MMU), which a program that
    # probes with them (vmtouch, fincore, a database warming its cache) reports and
    # works on without; glibc only wraps mincore and CPython calls neither (Debian 12's
    # libc.so.6 and python3.11 import no mincore).
    Refusal("page cache residency", {"mincore": 27, "cachestat": 451},
            "the image's page cache is shared by every sandbox of the image, whose "
            "files each sandbox owns through its idmapped mount: residency shows which "
            "pages a neighbour read",
            errno.ENOSYS),
    Refusal("eBPF", {"bpf": 321},
            "programs loaded into the kernel: verifier bugs are escapes"),
    Refusal("perf events", {"perf_event_open": 298},
            "the host's performance counters and a large, often-exploited subsystem"),
    Refusal("userfaultfd", {"userfaultfd": 323},
            "lets an exploit stall the kernel mid-copy to win a race"),
    Refusal("kexec", {"kexec_load": 246, "kexec_file_load": 320},
            "loading a new kernel"),
    Refusal("kernel modules", {"init_module": 175, "finit_module": 313,
                               "delete_module": 176, "query_module": 178,
                               "create_module": 174, "get_kernel_syms": 177},
            "code loaded into the host's kernel"),
    Refusal("file handles", {"open_by_handle_at": 304},
            "opens any inode of a mounted filesystem by number, past every path and "
            "mount (the 'shocker' escape; making a handle, name_to_handle_at, is harmless "
            "and allowed)"),
    Refusal("keyring", {"add_key": 248, "request_key": 249, "keyctl": 250},
            "the kernel keyring is not namespaced: keys of the host and of other "
            "sandboxes"),
    Refusal("mounts", {"mount": 165, "umount2": 166, "pivot_root": 155, "fsopen": 430,
                       "fsconfig": 431, "fsmount": 432, "fspick": 433, "open_tree": 428,
                       "move_mount": 429, "mount_setattr": 442},
            "filesystems the kernel parses, and the way out of a mount namespace"),
    Refusal("namespaces", {"setns": 308},
            "joining another namespace (clone and unshare with namespace flags are "
            "refused too, clone3 answers ENOSYS so that the C library falls back to "
            "clone, whose flags the filter reads)"),
    Refusal("swap, reboot, accounting, quotas", {"swapon": 167, "swapoff": 168,
                                                  "reboot": 169, "acct": 163,
                                                  "quotactl": 179, "quotactl_fd": 443},
            "host-wide administration"),
    Refusal("kernel log", {"syslog": 103}, "the host kernel's messages (addresses, "
                                           "other tenants' activity)"),
    Refusal("port I/O", {"iopl": 172, "ioperm": 173}, "the machine's I/O ports"),
    Refusal("clock", {"clock_settime": 227, "settimeofday": 164, "clock_adjtime": 305},
            "the host's clock is shared by every sandbox"),
    Refusal("terminal hangup", {"vhangup": 153}, "hangs up terminals"),
    Refusal("fanotify", {"fanotify_init": 300}, "watches of whole filesystems"),
    Refusal("NUMA placement", {"mbind": 237, "set_mempolicy": 238, "migrate_pages": 256,
                               "move_pages": 279, "set_mempolicy_home_node": 450},
            "moves other processes' memory; Docker gives these only with CAP_SYS_NICE"),
    Refusal("other processes' files", {"kcmp": 312, "pidfd_getfd": 438,
                                       "process_madvise": 440},
            "reads other processes' descriptors and memory advice; Docker gives these "
            "only with CAP_SYS_PTRACE"),
    Refusal("pipes into memory", {"vmsplice": 278},
            "maps pipe pages into memory (refused by Podman's profile)"),
    Refusal("obsolete", {"lookup_dcookie": 212, "nfsservctl": 180, "uselib": 134,
                         "ustat": 136, "sysfs": 139, "_sysctl": 156},
            "calls no task image needs, some removed from the kernel", errno.ENOSYS),
)

# clone and unshare with any of these flags are refused: no new namespace of any kind
# (linux/sched.h: NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET)
NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000
CLONE, UNSHARE, CLONE3 = 56, 272, 435
# personality(2): what Docker's profile allows (the default, UNAME26, READ_IMPLIES_EXEC
# variants and the query); ADDR_NO_RANDOMIZE and the rest are refused
PERSONALITY = 135
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# Sockets: an allowlist. Families: unix, IPv4, IPv6 and netlink; everything else
# (packet, XDP, vsock (which reaches the hypervisor from a VM), ALG, TIPC, RDS, CAN,
# Bluetooth ...) answers EAFNOSUPPORT. Netlink: routes (ip, getifaddrs) and socket
# diagnostics (ss) only: netfilter, xfrm, audit, generic netlink and the rest answer
# EPROTONOSUPPORT. IPv4 and IPv6: stream and datagram sockets of TCP, UDP and ICMP
# (unprivileged ping); raw sockets (EPERM, as without CAP_NET_RAW) and SCTP, MPTCP and
# other protocols (EPROTONOSUPPORT) are refused.
SOCKET, SOCKETPAIR = 41, 53
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
NETLINK_ROUTE, NETLINK_SOCK_DIAG = 0, 4
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW = 1, 2, 3
SOCK_TYPE_MASK = 0xF  # the rest of the type argument is SOCK_NONBLOCK | SOCK_CLOEXEC
INET_PROTOCOLS = (0, 1, 6, 17, 58)  # default, ICMP, TCP, UDP, ICMPv6
NETLINK_PROTOCOLS = (NETLINK_ROUTE, NETLINK_SOCK_DIAG)
SOCKET_RULES = (
    ("socket families", "AF_PACKET, AF_XDP, AF_VSOCK, AF_ALG and every family but unix, "
     "IPv4, IPv6 and netlink: raw frames past the network filter, the hypervisor's "
     "sockets, rarely used kernel code", errno.EAFNOSUPPORT, "NET_RAW (AF_PACKET only)"),
    ("raw IP sockets", "hand-made packets (SOCK_RAW of IPv4 and IPv6)", errno.EPERM,
     "NET_RAW"),
    ("IP protocols", "SCTP, MPTCP, UDP-Lite and every protocol but TCP, UDP and ICMP",
     errno.EPROTONOSUPPORT, None),
    ("netlink protocols", "NETLINK_NETFILTER, NETLINK_XFRM, audit, generic netlink and "
     "every protocol but routes and socket diagnostics", errno.EPROTONOSUPPORT, None),
)


def kept_capabilities(asked: Iterable[str]) -> Tuple[str, ...]:
    """The capabilities root inside a sandbox keeps, given the spec's ``asked``."""
    return DEFAULT_CAPABILITIES + (("NET_RAW",) if "NET_RAW" in asked else ())


def refused(capabilities: FrozenSet[str] = frozenset()) -> Dict[int, int]:
    """x86_64 number -> errno of every call refused outright for a sandbox holding
    ``capabilities``."""
    out = {}
    for refusal in REFUSALS:
        if refusal.unless is None or refusal.unless not in capabilities:
            for number in refusal.calls.values():
                out[number] = refusal.errno
    return out


def every_call() -> Dict[str, Tuple[int, Refusal]]:
    """Name -> (number, its Refusal) of every call the table names."""
    return {name: (number, refusal) for refusal in REFUSALS
            for name, number in refusal.calls.items()}


# ---- the table for engines: OCI seccomp rules (gVisor's --oci-seccomp) and a Docker
# or Podman profile with the same refusals added
AF_MAX = 46  # linux/socket.h (AF_MCTP is 45)
NETLINK_MAX = 32


def _rule(names, action: str, errno_ret: Optional[int] = None, args=()) -> dict:
    rule = {"names": sorted(names), "action": action, "args": [dict(a) for a in args]}
    if errno_ret is not None:
        rule["errnoRet"] = errno_ret
    return rule


def _arg(index: int, value: int, op: str = "SCMP_CMP_EQ", value_two: int = 0) -> dict:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def _errno(code: int, names, *args) -> dict:
    return _rule(names, "SCMP_ACT_ERRNO", code, args)


def _namespace_rules(gvisor: bool = False) -> list:
    """clone and unshare refused with any namespace flag (one rule per flag: a rule
    compares each argument once), and clone3 answering ENOSYS so that the C library
    falls back to clone. Not under gVisor: its OCI seccomp answers every refusal EPERM,
    after which the C library would not fall back (no thread could start), and its
    kernel answers clone3 ENOSYS itself."""
    bits = [1 << i for i in range(32) if NAMESPACE_FLAGS & (1 << i)]
    return [_errno(errno.EPERM, ("clone", "unshare"), _arg(0, bit, "SCMP_CMP_MASKED_EQ", bit))
            for bit in bits] + ([] if gvisor else [_errno(errno.ENOSYS, ("clone3",))])


def _socket_families(capabilities: FrozenSet[str]) -> Tuple[int, ...]:
    return (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK) + \
        ((AF_PACKET,) if "NET_RAW" in capabilities else ())


def oci_seccomp(capabilities: FrozenSet[str] = frozenset()) -> dict:
    """An OCI runtime spec's ``linux.seccomp``: the refusals over a default of ALLOW
    (what gVisor's ``--oci-seccomp`` loads into its own kernel)."""
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": oci_rules(capabilities, gvisor=True)}


def oci_rules(capabilities: FrozenSet[str] = frozenset(), gvisor: bool = False) -> list:
    """The refusals as seccomp rules that each refuse (none allows)."""
    refused_calls: Dict[int, list] = {}
    for refusal in REFUSALS:
        if refusal.unless is None or refusal.unless not in capabilities:
            refused_calls.setdefault(refusal.errno, []).extend(refusal.calls)
    rules = [_errno(code, names) for code, names in sorted(refused_calls.items())]
    rules += _namespace_rules(gvisor)
    families = _socket_families(capabilities)
    rules += [_errno(errno.EAFNOSUPPORT, ("socket", "socketpair"), match)
              for match in _all_but(0, families, AF_MAX)]
    rules += [_errno(errno.EAFNOSUPPORT, ("socketpair",), _arg(0, family))
              for family in families if family != AF_UNIX]
    if "NET_RAW" not in capabilities:
        rules += [_errno(errno.EPERM, ("socket",), _arg(0, family),
                         _arg(1, SOCK_TYPE_MASK, "SCMP_CMP_MASKED_EQ", SOCK_RAW))
                  for family in (AF_INET, AF_INET6)]
    for family, allowed, top in ((AF_INET, INET_PROTOCOLS, 59), (AF_INET6, INET_PROTOCOLS, 59),
                                 (AF_NETLINK, NETLINK_PROTOCOLS, NETLINK_MAX)):
        rules += [_errno(errno.EPROTONOSUPPORT, ("socket",), _arg(0, family), match)
                  for match in _all_but(2, allowed, top)]
    return rules


def _all_but(index: int, allowed, top: int) -> list:
    """Comparisons of argument ``index`` that together match every value but those
    ``allowed`` (all below ``top``): each run of refused values below ``top`` in
    aligned blocks of a power of two (one masked comparison each), and every value from
    ``top`` up, which also takes what has high bits set (a kernel that reads the
    argument as an int would see a small number there). Few rules: gVisor compiles
    each at every sandbox's start."""
    out, value = [], 0
    while value < top:
        if value in allowed:
            value += 1
            continue
        size = 1
        while value % (size * 2) == 0 and value + size * 2 <= top and \
                not any(value <= a < value + size * 2 for a in allowed):
            size *= 2
        out.append(_arg(index, value) if size == 1 else
                   _arg(index, ~(size - 1) & 0xFFFFFFFFFFFFFFFF, "SCMP_CMP_MASKED_EQ", value))
        value += size
    return out + [_arg(index, top, "SCMP_CMP_GE")]


def docker_profile(base: dict, capabilities: FrozenSet[str] = frozenset(),
                   gvisor: bool = False) -> dict:
    """A Docker or Podman seccomp profile: ``base`` (the engine's own default, an
    allowlist) with every refusal of this table added: each refused call taken out of
    the base's allow rules and refused with its errno, namespace flags refused on
    clone and unshare, clone3 answering ENOSYS, and sockets held to the families,
    types and protocols of the table (what matches no allow rule gets the base's
    default errno). ``gvisor``: for runsc, which answers clone3 itself (see
    ``_namespace_rules``)."""
    refused_calls = {name for refusal in REFUSALS
                     if refusal.unless is None or refusal.unless not in capabilities
                     for name in refusal.calls}
    taken = refused_calls | {"socket", "socketpair", "clone", "unshare"} | \
        (set() if gvisor else {"clone3"})
    rules = []
    for rule in base.get("syscalls", []):  # the base's rules for these give way to ours
        names = [n for n in rule["names"] if n not in taken]
        if names:
            rules.append(dict(rule, names=names))
    for refusal in REFUSALS:
        if refusal.unless is None or refusal.unless not in capabilities:
            rules.append(_errno(refusal.errno, refusal.calls))
        else:  # lifted: allowed even where the base does not allow it
            rules.append(_rule(refusal.calls, "SCMP_ACT_ALLOW"))
    bits = NAMESPACE_FLAGS
    rules.append(_rule(("clone", "unshare"), "SCMP_ACT_ALLOW", None,
                       [_arg(0, bits, "SCMP_CMP_MASKED_EQ", 0)]))
    rules += _namespace_rules(gvisor)
    families = _socket_families(capabilities)
    rules.append(_rule(("socket", "socketpair"), "SCMP_ACT_ALLOW", None, [_arg(0, AF_UNIX)]))
    for family in (AF_INET, AF_INET6):
        for sock_type in (SOCK_STREAM, SOCK_DGRAM):
            # protocols up to ICMPv6's number: of those, a stream or datagram socket
            # takes only TCP, UDP and ICMP (the kernel refuses the rest itself), and
            # none above (SCTP, UDP-Lite, L2TP, MPTCP): one rule, not one per protocol
            rules.append(_rule(("socket",), "SCMP_ACT_ALLOW", None,
                               [_arg(0, family),
                                _arg(1, SOCK_TYPE_MASK, "SCMP_CMP_MASKED_EQ", sock_type),
                                _arg(2, max(INET_PROTOCOLS), "SCMP_CMP_LE")]))
        rules.append(_rule(("socket",), "SCMP_ACT_ALLOW" if "NET_RAW" in capabilities
                           else "SCMP_ACT_ERRNO", None if "NET_RAW" in capabilities
                           else errno.EPERM,
                           [_arg(0, family),
                            _arg(1, SOCK_TYPE_MASK, "SCMP_CMP_MASKED_EQ", SOCK_RAW)]))
    rules += [_rule(("socket",), "SCMP_ACT_ALLOW", None, [_arg(0, AF_NETLINK), _arg(2, proto)])
              for proto in NETLINK_PROTOCOLS]
    if "NET_RAW" in capabilities:
        rules.append(_rule(("socket",), "SCMP_ACT_ALLOW", None, [_arg(0, AF_PACKET)]))
    # every other family gets the base's default errno: a rule per family to say
    # EAFNOSUPPORT instead cost each container start ~45 ms of the runtime's compiling
    return dict(base, syscalls=rules)
