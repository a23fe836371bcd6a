"""The seccomp filter of LocalProvider sandboxes, as a classic BPF program for
``bwrap --seccomp FD``: the policy of record (``providers/syscalls.py``) assembled.

Its shape, per system call::

    another ABI (x32, 32-bit numbers): refused (they bypass the numbers checked here)
    clone3: ENOSYS (its flags sit in memory a filter cannot read; the C library then
            falls back to clone, which is checked)
    a refused number: its errno
    clone, unshare: refused if any namespace flag is set
    personality: only the personalities of Docker's profile
    socket, socketpair: the family, type and protocol allowlists
    anything else: allowed

Calls whose answer does not depend on their arguments are answered by the kernel's
per-number cache of a filter's verdict (Linux 5.11+), without running the program:
the filter costs nothing on the hot path of ``read``, ``write`` or ``poll``.
"""

import errno
import platform
import struct
from typing import Dict, FrozenSet, List, Optional, Tuple

from sandman_ray.providers import syscalls as policy

# linux/filter.h and linux/seccomp.h
LD_W_ABS = 0x20          # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15             # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35             # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45            # BPF_JMP | BPF_JSET | BPF_K
AND_K = 0x54             # BPF_ALU | BPF_AND | BPF_K
RET_K = 0x06             # BPF_RET | BPF_K
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
NR, ARCH = 0, 4


def arg(index: int) -> int:
    """The offset of the low 32 bits of argument ``index`` (x86_64 is little-endian;
    the ints the checks read are 32 bits wide in the kernel too)."""
    return 16 + 8 * index


def program(capabilities: FrozenSet[str] = frozenset()) -> Optional[bytes]:
    """The filter for a sandbox holding ``capabilities`` (SandboxSpec.capabilities) on
    this machine, or None where it is not written for the CPU (the sandbox then runs
    without one)."""
    if platform.machine() != "x86_64":
        return None
    return b"".join(struct.pack("=HBBI", *insn)
                    for insn in assembled(source(frozenset(capabilities))))


def source(capabilities: FrozenSet[str]) -> List[tuple]:
    """The program: (code, label if true, label if false, k), or (label,) to mark a
    place; "next" is the next instruction."""
    raw = "NET_RAW" in capabilities
    refused = policy.refused(capabilities)
    by_errno: Dict[int, List[int]] = {}
    for number, code in refused.items():
        by_errno.setdefault(code, []).append(number)
    out = [(LD_W_ABS, None, None, ARCH),
           (JEQ_K, "next", "eperm", AUDIT_ARCH_X86_64),   # another ABI: refused
           (LD_W_ABS, None, None, NR),
           (JGE_K, "eperm", "next", X32_SYSCALL_BIT),       # x32: refused
           (JEQ_K, "enosys", "next", policy.CLONE3)]
    for code in sorted(by_errno):
        out += [(JEQ_K, _errno_label(code), "next", nr) for nr in sorted(by_errno[code])]
    out += [(JEQ_K, "flags", "next", policy.CLONE),
            (JEQ_K, "flags", "next", policy.UNSHARE),
            (JEQ_K, "personality", "next", policy.PERSONALITY),
            (JEQ_K, "socket", "next", policy.SOCKET),
            (JEQ_K, "socketpair", "allow", policy.SOCKETPAIR),
            # clone and unshare: no namespace of any kind
            ("flags",), (LD_W_ABS, None, None, arg(0)),
            (JSET_K, "eperm", "allow", policy.NAMESPACE_FLAGS),
            ("personality",), (LD_W_ABS, None, None, arg(0))]
    out += [(JEQ_K, "allow", "next", value) for value in policy.PERSONALITIES]
    out += [(RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPERM),
            # socketpair makes unix pairs (and TIPC's, a refused family)
            ("socketpair",), (LD_W_ABS, None, None, arg(0)),
            (JEQ_K, "allow", "eafnosupport", policy.AF_UNIX),
            ("socket",), (LD_W_ABS, None, None, arg(0)),
            (JEQ_K, "allow", "next", policy.AF_UNIX),
            (JEQ_K, "inet", "next", policy.AF_INET),
            (JEQ_K, "inet", "next", policy.AF_INET6),
            (JEQ_K, "netlink", "next", policy.AF_NETLINK),
            (JEQ_K, "allow" if raw else "eafnosupport", "eafnosupport", policy.AF_PACKET),
            ("inet",), (LD_W_ABS, None, None, arg(1)),
            (AND_K, None, None, policy.SOCK_TYPE_MASK),
            (JEQ_K, "allow" if raw else "eperm", "next", policy.SOCK_RAW),
            (JEQ_K, "protocol", "next", policy.SOCK_STREAM),
            (JEQ_K, "protocol", "esocktnosupport", policy.SOCK_DGRAM),
            ("protocol",), (LD_W_ABS, None, None, arg(2))]
    out += [(JEQ_K, "allow", "next", value) for value in policy.INET_PROTOCOLS]
    out += [(RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPROTONOSUPPORT),
            ("netlink",), (LD_W_ABS, None, None, arg(2))]
    out += [(JEQ_K, "allow", "next", value) for value in policy.NETLINK_PROTOCOLS]
    out += [(RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPROTONOSUPPORT),
            ("allow",), (RET_K, None, None, SECCOMP_RET_ALLOW)]
    for code in sorted(set(by_errno) | {errno.EPERM, errno.ENOSYS, errno.EAFNOSUPPORT,
                                        errno.ESOCKTNOSUPPORT}):
        out += [(_errno_label(code),), (RET_K, None, None, SECCOMP_RET_ERRNO | code)]
    return out


def _errno_label(code: int) -> str:
    return errno.errorcode[code].lower()


def assembled(source: List[tuple]) -> List[Tuple[int, int, int, int]]:
    """Resolve labels into BPF's relative jumps (counted from the next instruction);
    a jump must go forward and fit in a byte."""
    places: Dict[str, int] = {}
    insns = []
    for item in source:
        if len(item) == 1:
            places[item[0]] = len(insns)
        else:
            insns.append(item)

    def offset(label, index):
        if label in (None, "next"):
            return 0
        jump = places[label] - index - 1
        if not 0 <= jump <= 255:
            raise ValueError("seccomp: a jump to %s of %d instructions" % (label, jump))
        return jump
    return [(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(insns)]
