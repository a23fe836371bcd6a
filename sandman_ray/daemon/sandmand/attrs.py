"""What a tenant may change of the daemon's own process, and the daemon's capability
bounding set.

The daemon outlives its tenants (a renew keeps it: providers/local/renew.py), and every
process it starts inherits its attributes. Root inside the sandbox has the daemon's uid,
so it may change some of them from outside the daemon: its CPU affinity, nice value,
scheduling policy and priority, the rest of its scheduling attributes (``sched_setattr``:
a fair task's own time slice, which EEVDF keeps in ``sched_runtime`` and which needs no
capability, a deadline task's runtime, deadline and period, utilization clamps), I/O
priority, OOM score, the nice value of its autogroup, its resource limits
(``taskset``, ``renice``, ``chrt``, ``ionice``, ``prlimit``, writes to ``/proc/1/...``). ``settings`` reads all of those and what only
the daemon itself could change (umask, personality, timer slack, cgroup, securebits,
capabilities), for every thread; a renew compares them with what the daemon started
with, and any change starts the sandbox afresh.

``drop_bounding_set`` narrows the capability bounding set to the permitted set at the
start: a capability the daemon does not hold cannot come back at an exec (bubblewrap
leaves the bounding set full in a user namespace).

Calls the standard library does not wrap (prctl, ioprio_get, sched_getattr) go through
``_ctypes``'s
bare function call, without the ctypes package (0.3 ms to import instead of ~3 ms);
where ``_ctypes`` is missing they are skipped, and the rest still holds.
"""

import os
import struct

PR_CAPBSET_READ, PR_CAPBSET_DROP = 23, 24
PR_GET_SECUREBITS = 27
SYS_IOPRIO_GET = 252  # x86_64
IOPRIO_WHO_PROCESS = 1
SYS_SCHED_GETATTR = 315  # x86_64
# struct sched_attr (linux/sched/types.h, 56 bytes since 4.18): size, policy, flags,
# nice, priority, runtime, deadline, period, util_min, util_max
SCHED_ATTR = struct.Struct("<IIQiIQQQII")
# /proc/self files whose whole text is a setting (absent ones are skipped)
PROCESS_FILES = ("oom_score_adj", "autogroup", "cgroup", "personality", "limits",
                 "loginuid", "coredump_filter")
THREAD_FILES = ("timerslack_ns", "comm")
STATUS_FIELDS = ("Umask", "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff", "CapBnd",
                 "CapAmb", "Cpus_allowed_list", "Mems_allowed_list")


def _libc():
    try:
        import _ctypes
    except ImportError:
        return None
    handle = _ctypes.dlopen(None)
    return lambda name, *args: _ctypes.call_function(_ctypes.dlsym(handle, name), args)


_call = _libc()


_buffers = []  # the array type of _sched_attr_buffer, made once


def _sched_attr_buffer():
    """A new zeroed buffer of SCHED_ATTR's size that ``_call`` passes as a pointer: an
    array type made from ``_ctypes`` as the ctypes package makes its own."""
    if not _buffers:
        import _ctypes

        class Byte(_ctypes._SimpleCData):
            _type_ = "B"

        class Attr(_ctypes.Array):
            _type_ = Byte
            _length_ = SCHED_ATTR.size
        _buffers.append(Attr)
    return _buffers[0]()


def _sched_attr(tid):
    """The thread's whole ``sched_getattr`` struct as a tuple, or None where the kernel
    has no such call (before 3.14)."""
    buf = _sched_attr_buffer()
    if _call("syscall", SYS_SCHED_GETATTR, tid, buf, SCHED_ATTR.size, 0) != 0:
        return None
    return SCHED_ATTR.unpack(bytes(buf))


def drop_bounding_set():
    """Drop from the bounding set every capability not in the permitted set; the
    number dropped (0 where nothing could be: no ``_ctypes``, or no CAP_SETPCAP)."""
    if _call is None:
        return 0
    permitted = int(_status().get("CapPrm", "0"), 16)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read())
    except (OSError, ValueError):
        last = 40
    dropped = 0
    for cap in range(last + 1):
        if not permitted >> cap & 1 and _call("prctl", PR_CAPBSET_READ, cap) == 1:
            dropped += _call("prctl", PR_CAPBSET_DROP, cap) == 0
    return dropped


def _status(task="self"):
    out = {}
    try:
        with open("/proc/%s/status" % task) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                out[key] = value.strip()
    except OSError:
        pass
    return out


def _read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read(65536)
    except OSError:
        return None


def settings():
    """Every attribute a tenant could have changed, or that the daemon's children would
    inherit: the process's, and each thread's (by thread id)."""
    import resource
    out = {"process": {name: _read("/proc/self/" + name) for name in PROCESS_FILES}}
    status = _status()
    out["status"] = {k: status.get(k) for k in STATUS_FIELDS}
    out["rlimits"] = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                out["rlimits"][name] = resource.getrlimit(getattr(resource, name))
            except (ValueError, OSError):
                continue
    if _call is not None:
        out["securebits"] = _call("prctl", PR_GET_SECUREBITS)
    threads = {}
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            threads[tid] = _thread(tid)
        except OSError:  # a thread that ended meanwhile
            continue
    out["threads"] = threads
    return out


def _thread(tid):
    base = "/proc/self/task/%d/" % tid
    seen = {"affinity": sorted(os.sched_getaffinity(tid)),
            "nice": os.getpriority(os.PRIO_PROCESS, tid),
            "policy": os.sched_getscheduler(tid),
            "priority": os.sched_getparam(tid).sched_priority}
    seen.update((name, _read(base + name)) for name in THREAD_FILES)
    if _call is not None:
        seen["ioprio"] = _call("syscall", SYS_IOPRIO_GET, IOPRIO_WHO_PROCESS, tid)
        seen["sched_attr"] = _sched_attr(tid)
    return seen


def changed(before, after):
    """The names of the settings that differ (threads that started or ended since do
    not count: a renew runs once the daemon's own threads are done; the main thread and
    every thread still there are compared)."""
    out = sorted(k for k in ("process", "status", "rlimits", "securebits")
                 if before.get(k) != after.get(k))
    for tid, seen in after.get("threads", {}).items():
        was = before.get("threads", {}).get(tid)
        if was is None:
            was = before.get("threads", {}).get(os.getpid())  # a new thread inherits these
        out += ["thread %d %s" % (tid, key) for key in sorted(seen)
                if was is not None and key != "comm" and seen[key] != was.get(key)]
    return out
