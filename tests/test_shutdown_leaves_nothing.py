"""A pool's shutdown leaves no process of it on the host, ever: a process that outlived
it (once, a bwrap child, PID 1 of its namespace, outside every cgroup, holding the
daemon's socket) would keep host ids whose range a new sandbox could be given. The
chain is in its sandbox's cgroups from its first instruction, a kill empties them, and
a range is let go only once none of its ids runs (providers/userns.py)."""

import os

from conftest import LOCAL_CACHE, LOCAL_STATE, processes_matching, unique_pool
from sandman_ray.providers.userns import FIRST_ID

ROUNDS = 20


def range_owned() -> list:
    """Live processes whose uid is one of the sandbox ranges' host ids (2^30 and up)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid >= FIRST_ID:
                    found.append(int(name))
            except OSError:
                continue
    return found


def test_a_network_pools_shutdown_twenty_times_leaves_no_process(local_provider):
    """Each round: a pool that keeps sandboxes with a network warm, a lease taken (so
    that the pool is refilling as it shuts down), a command, and a shutdown at once;
    then the host's process table holds nothing of it: no process of a sandbox range,
    no bwrap, daemon or slirp4netns of the pool, and nothing the pool's leftovers
    finder sees."""
    import ray
    import sandman_ray as sandman
    from sandman_ray.providers.local import LocalProvider, leftovers
    from sandman_ray.spec import SandboxSpec
    spec = SandboxSpec(network=True)
    assert range_owned() == []
    for round_ in range(ROUNDS):
        pool = unique_pool(LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE),
                           "down", warm={spec: 2})
        sb = sandman.acquire(spec, pool=pool, timeout=120)
        assert ray.get(sb.exec.remote("echo up")).stdout == b"up\n"
        sandman.shutdown_pool(pool)
        left = leftovers(pool, LOCAL_STATE)
        assert left == {"processes": [], "directories": [], "cgroups": []}, (round_, left)
        assert range_owned() == [], round_
        assert processes_matching("%s/%s/" % (LOCAL_STATE, pool)) == [], round_
        assert processes_matching("slirp4netns") == [], round_
