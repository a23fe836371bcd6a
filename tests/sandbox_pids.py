"""Host pids of a sandbox's processes, for tests that look at a sandbox from the host.
Imports nothing but the daemon module, so that tests/unprivileged_agent.py (run as
another user) can use it too."""

from sandman_ray.daemon.sandmand.spawn import descendants


def daemon_under(chain_pid: int) -> int:
    """The host pid of the daemon (PID 1 inside) that the launch chain ``chain_pid``
    started: the descendant whose command line names sandmand."""
    for pid in sorted(descendants(chain_pid)):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"sandmand" in cmdline and not cmdline.startswith(b"bwrap"):
            return pid
    raise AssertionError("no daemon runs under pid %d" % chain_pid)
