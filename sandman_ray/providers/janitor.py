"""Removes what a node agent's sandboxes leave on the host once the agent is gone.

The agent starts one janitor, in a session of its own, holding the write end of the
janitor's stdin. When the agent dies, however it dies (``ray.shutdown()``, SIGKILL, a
node going away), stdin reaches end-of-file; the janitor then kills whatever sandbox
process still names the state directory, waits for them to exit, and removes the
state directory and the cgroups. Sandboxes already die with their agent (bwrap's
parent-death signal); this removes their files.

    python -m sandman_ray.providers.janitor STATE_DIR [CGROUP_DIR ...]
"""

import os
import shutil
import signal
import sys
import time


def sandbox_processes(state_dir: str):
    """Pids of live processes whose command line names ``state_dir``."""
    found = []
    needle = state_dir.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % name, "rb") as fh:
                if needle in fh.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def clean(state_dir: str, cgroup_dirs, wait_s: float = 10.0) -> None:
    for pid in sandbox_processes(state_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    # Not our children: poll until they are gone (exited processes have an empty
    # command line even before their parent reaps them).
    deadline = time.monotonic() + wait_s
    while sandbox_processes(state_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(state_dir, ignore_errors=True)
    shutil.rmtree(state_dir + ".trash", ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(state_dir))  # the pool's directory, once its last node left
    except OSError:
        pass
    for group in cgroup_dirs:
        if not os.path.isdir(group):
            continue
        for leaf in os.listdir(group):
            try:
                os.rmdir(os.path.join(group, leaf))
            except OSError:
                pass
        try:
            os.rmdir(group)
        except OSError:
            pass


def main(argv) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the agent's death ends us
    while os.read(0, 4096):
        pass
    clean(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
