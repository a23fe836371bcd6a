"""Removes what a node agent's sandboxes leave on the host once the agent is gone.

The agent starts one janitor (``start``), in a session of its own and not as its
child, holding the write end of the janitor's stdin. When the agent dies, however it
dies (``ray.kill``, ``ray.shutdown()``, SIGKILL, a node going away), stdin reaches
end-of-file; the janitor then kills whatever sandbox
process still names the state directory, waits for them to exit, and removes the
state directory and the cgroups. Sandboxes already die with their agent (bwrap's
parent-death signal); this removes their files.

    python -m sandman_ray.providers.janitor STATE_DIR [CGROUP_DIR ...]
                                            [--containers ENGINE_URL LABEL=VALUE]

With ``--containers`` (the DockerProvider's agents), it first removes the engine's
containers that carry that label (the agent's incarnation): containers do not die
with the process that created them.
"""

import errno
import os
import shutil
import signal
import sys
import time

LATE_CREATE_S = 5.0  # an engine's create call, measured here at 13-24 ms, well within


def start(args):
    """Start a janitor with ``args`` (as for ``main``) for the calling process: it
    cleans up once the caller's end of its stdin closes, however the caller dies.

    It is started through ``setsid -f``, so it is not the caller's child: Ray kills a
    dead worker's children (measured: a direct child dies with its actor under
    ``ray.kill``), but not processes that were handed to init."""
    import subprocess
    return subprocess.Popen(["setsid", "-f", sys.executable, "-m", __name__] + list(args),
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)


def sandbox_processes(state_dir: str, unless: bytes = b""):
    """Pids of live processes whose command line names ``state_dir`` (and, when given,
    does not contain ``unless``)."""
    found = []
    needle = state_dir.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % name, "rb") as fh:
                cmdline = fh.read()
            if needle in cmdline and not (unless and unless in cmdline):
                found.append(int(name))
        except OSError:
            continue
    return found


def clean(state_dir: str, cgroup_dirs, wait_s: float = 10.0) -> None:
    # Killed again on every round: a launch that was under way when the agent died
    # can still fork after a scan (bwrap's child in the new pid namespace appears after
    # bwrap itself), and such a child was once found alive after a fault trial, bwrap
    # gone. Not our children: exited processes have an empty command line even before
    # their parent reaps them.
    deadline = time.monotonic() + wait_s
    thaw_groups(cgroup_dirs)  # a frozen (paused) process does not die of SIGKILL
    while True:
        pids = sandbox_processes(state_dir)
        kill(pids)
        if not pids or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    shutil.rmtree(state_dir, ignore_errors=True)
    parent = state_dir
    for _ in range(2):  # the node's and the pool's directories, once they are empty
        parent = os.path.dirname(parent)
        try:
            os.rmdir(parent)
        except OSError:
            break
    clean_cgroups(cgroup_dirs)


def clean_cgroups(groups) -> None:
    """Kill what is left in each group's sandbox groups (a daemon whose bwrap died
    without taking it along), then remove them and the group."""
    thaw_groups(groups)
    for group in groups:
        leaves = sandbox_groups(group)
        for leaf in leaves:
            kill_listed(os.path.join(leaf, "cgroup.procs"))
        for leaf in leaves + [group]:
            try:
                remove_cgroup(leaf)
            except OSError:
                pass


def thaw_groups(groups) -> None:
    """Thaw every sandbox group under the agents' ``groups`` that a pause froze (v1
    freezer.state, v2 cgroup.freeze), so that their processes can be killed."""
    for group in groups:
        for leaf in sandbox_groups(group):
            for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                try:
                    with open(os.path.join(leaf, name), "w") as fh:
                        fh.write(value)
                except OSError:
                    pass


def sandbox_groups(group: str):
    """The sandboxes' cgroups under an agent's ``group`` (none when it does not exist)."""
    try:
        return [e.path for e in os.scandir(group) if e.is_dir()]
    except OSError:
        return []


def kill(pids) -> None:
    """SIGKILL each pid but this process's own (an agent's launcher thread sits in a
    sandbox's groups while it forks the sandbox's first process)."""
    me = os.getpid()
    for pid in pids:
        try:
            if int(pid) != me:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def listed_pids(procs_file: str):
    """The pids a cgroup.procs file lists (a missing file lists none)."""
    try:
        with open(procs_file) as fh:
            return [int(pid) for pid in fh.read().split()]
    except (OSError, ValueError):
        return []


def kill_listed(procs_file: str) -> None:
    """SIGKILL every pid a cgroup.procs file lists."""
    kill(listed_pids(procs_file))


def remove_cgroup(path: str) -> None:
    """Remove a cgroup whose processes were killed: EBUSY while the kernel still reaps
    the last of them, so asked again for up to half a second. Gone already is fine."""
    for attempt in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == 49:
                raise
            time.sleep(0.01)


def main(argv) -> int:
    containers = None
    if "--containers" in argv:
        at = argv.index("--containers")
        containers, argv = argv[at + 1:at + 3], argv[:at] + argv[at + 3:]
    if len(argv) < 1 or (containers is not None and len(containers) != 2):
        print(__doc__, file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the agent's death ends us
    while os.read(0, 4096):
        pass
    if containers is not None:
        _remove_containers_reporting(*containers)
    clean(argv[0], argv[1:])
    if containers is not None:
        # The engine may still finish a create the agent sent just before it died:
        # look again once such a request has had time to complete.
        time.sleep(LATE_CREATE_S)
        _remove_containers_reporting(*containers)
    return 0


def _remove_containers_reporting(engine_url: str, label: str) -> None:
    from sandman_ray.providers.docker.engine import engine_client, remove_containers
    try:
        remove_containers(engine_client(engine_url), [label])
    except Exception as exc:
        print("janitor: cannot reach the engine at %s: %s" % (engine_url, exc), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
