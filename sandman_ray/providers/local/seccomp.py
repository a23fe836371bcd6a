"""The seccomp filter of LocalProvider sandboxes, as a classic BPF program for
``bwrap --seccomp FD``.

The capability set already refuses mounts, module loading, raw I/O and tracing of
other users. What it does not refuse is the kernel surface that container engines'
default profiles close too, and that task images do not use:

- new user namespaces (``unshare -U``, ``clone(CLONE_NEWUSER)``): inside one, root
  gets every capability again over new mount and network namespaces, which puts
  much more of the kernel in reach;
- ``clone3``, whose flags sit in memory a filter cannot read: it fails with ENOSYS,
  and the C library falls back to ``clone``, which is checked;
- the kernel keyring (not namespaced), ``bpf``, ``perf_event_open``, ``userfaultfd``;
- system calls of other ABIs (x32 and 32-bit numbers) bypass the numbers checked
  here, so they are refused.

Refused calls fail with EPERM (ENOSYS for ``clone3``); everything else is allowed.
"""

import errno
import platform
import struct
from typing import Dict, List, Optional, Tuple

# linux/filter.h and linux/seccomp.h
LD_W_ABS = 0x20          # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15             # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35             # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45            # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06             # BPF_RET | BPF_K
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
CLONE_NEWUSER = 0x10000000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
NR, ARCH, ARG0_LOW = 0, 4, 16

# x86_64 system call numbers
CLONE, UNSHARE, CLONE3 = 56, 272, 435
REFUSED = {"add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298,
           "bpf": 321, "userfaultfd": 323}



def program() -> Optional[bytes]:
    """The filter for this machine, or None where it is not written for the CPU (the
    sandbox then runs without one)."""
    if platform.machine() != "x86_64":
        return None
    return b"".join(struct.pack("=HBBI", *insn) for insn in _assembled(_x86_64()))


def _x86_64() -> List[tuple]:
    """(code, label if true, label if false, k) or (label,) to mark a place."""
    jumps = [(LD_W_ABS, None, None, ARCH),
             (JEQ_K, "next", "deny", AUDIT_ARCH_X86_64),   # another ABI: refused
             (LD_W_ABS, None, None, NR),
             (JGE_K, "deny", "next", X32_SYSCALL_BIT),       # x32: refused
             (JEQ_K, "enosys", "next", CLONE3)]
    jumps += [(JEQ_K, "deny", "next", nr) for nr in sorted(REFUSED.values())]
    return jumps + [
        (JEQ_K, "flags", "next", CLONE),
        (JEQ_K, "flags", "allow", UNSHARE),
        ("flags",), (LD_W_ABS, None, None, ARG0_LOW),
        (JSET_K, "deny", "allow", CLONE_NEWUSER),
        ("allow",), (RET_K, None, None, SECCOMP_RET_ALLOW),
        ("deny",), (RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPERM),
        ("enosys",), (RET_K, None, None, SECCOMP_RET_ERRNO | errno.ENOSYS)]


def _assembled(source: List[tuple]) -> List[Tuple[int, int, int, int]]:
    """Resolve labels into BPF's relative jumps (counted from the next instruction)."""
    places: Dict[str, int] = {}
    insns = []
    for item in source:
        if len(item) == 1:
            places[item[0]] = len(insns)
        else:
            insns.append(item)

    def offset(label, index):
        return 0 if label in (None, "next") else places[label] - index - 1
    return [(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(insns)]
