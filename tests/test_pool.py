"""The pool, its handles and the public API on a real local Ray with the LocalProvider:
owners that die, handles that are dropped, acquires that time out or are cancelled,
a pool actor that is killed, a provider that throttles."""

import gc
import glob
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import ray

import sandman_ray as sandman
from sandman_ray.providers.base import POOL_LABEL
from conftest import (
    LOCAL_CACHE, RAY_NAMESPACE, ROOT, holding_driver, local_ray, restart_keeps_specs,
    unique_pool, wait_until)

STATE = "/tmp/sandman-ray-test/pool-state"
CACHE = LOCAL_CACHE


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


@pytest.fixture(scope="module")
def image(busybox_image):
    return busybox_image


def make_pool(provider=None, **config):
    return unique_pool(provider or sandman.LocalProvider(state_root=STATE, cache_root=CACHE),
                       "p", **config)


@pytest.fixture(scope="module")
def pool(cluster):
    """A pool the module's tests share (each gives back what it takes: a test that
    leaks a lease fails the next one's counts); a test that needs a pool of a config of
    its own makes it."""
    name = make_pool()
    yield name
    sandman.shutdown_pool(name)


def states(pool):
    return ray.get(sandman.get_pool(pool).status.remote())["states"]


def test_a_pool_starts_its_node_agents_as_it_starts_and_stops_them(cluster):
    """A cold pool's first burst does not wait for actor processes: the node's agent
    runs before any acquire, and goes with the pool."""
    from sandman_ray.pool.actor import NAMESPACE
    from sandman_ray.providers.nodes import agent_name
    pool = make_pool()
    name = agent_name(pool, ray.get_runtime_context().get_node_id(), "agent")

    def agent_alive():
        try:
            return ray.get(ray.get_actor(name, namespace=NAMESPACE).ready.remote(), timeout=5)
        except (ValueError, ray.exceptions.RayError):
            return None
    try:
        assert wait_until(agent_alive, timeout=60, what="the pool's node agent")
        assert sum(states(pool).values()) == 0  # no sandbox asked for, none made
    finally:
        sandman.shutdown_pool(pool)
    wait_until(lambda: agent_alive() is None, timeout=30, what="the agent to go with its pool")


def test_the_pool_process_runs_with_two_malloc_arenas(pool):
    """Without it the pool's RSS climbs with lease cycles as its threads' arenas
    fragment (bench/soak.py); the setting holds for a pool Ray restarts too, as it is
    the actor's own runtime_env."""
    environ = open("/proc/%d/environ" % _pid(pool), "rb").read().split(b"\0")
    assert b"MALLOC_ARENA_MAX=2" in environ


def test_one_host_actor_serves_every_lease_of_a_process_on_a_node(cluster, image):
    pool = make_pool(warm={image: 1})
    try:
        first = sandman.acquire(image, pool=pool)
        host = first._host._actor_id
        sandman.release(first)
        second, third = sandman.acquire(image, pool=pool), sandman.acquire(image, pool=pool)
        assert second._host._actor_id == third._host._actor_id == host  # no new actor
        assert ray.get(second.sandbox_id.remote()) != ray.get(third.sandbox_id.remote())
        assert [r.exit_code for r in ray.get([second.exec.remote("true"),
                                              third.exec.remote("false")])] == [0, 1]
        sandman.release(second)
        with pytest.raises(sandman.SandboxLost):  # a released handle holds nothing
            ray.get(second.exec.remote("true"))
        assert ray.get(third.exec.remote("true")).exit_code == 0
        sandman.release(third)
    finally:
        sandman.shutdown_pool(pool)


def test_a_handle_dropped_after_a_call_lets_the_call_finish_then_frees_the_lease(cluster, image):
    pool = make_pool(warm={image: 1})
    try:
        # the handle is garbage as soon as .remote() returns
        ref = sandman.acquire(image, pool=pool).exec.remote("sleep 0.5; echo done")
        gc.collect()
        assert ray.get(ref).stdout == b"done\n"
        wait_until(lambda: states(pool)["leased"] == 0, timeout=10, what="the lease freed")
        # several calls, the last one quick: the lease waits for all of them (and not
        # for the questions about the handle, which are no daemon calls)
        sb = sandman.acquire(image, pool=pool)
        assert ray.get(sb.sandbox_id.remote()) == sb.sandbox
        refs = [sb.exec.remote("sleep 0.%d; echo %d" % (5 - i, i)) for i in range(4)]
        del sb
        gc.collect()
        assert [r.stdout for r in ray.get(refs)] == [b"%d\n" % i for i in range(4)]
        wait_until(lambda: states(pool)["leased"] == 0, timeout=10, what="the lease freed")
        kept = sandman.acquire(image, pool=pool)
        passed_on = pickle.loads(pickle.dumps(kept))  # as when given to a task
        del kept
        gc.collect()
        assert ray.get(passed_on.exec.remote("true")).exit_code == 0  # still leased
        assert states(pool)["leased"] == 1
        sandman.release(passed_on)
    finally:
        sandman.shutdown_pool(pool)


def test_release_cuts_off_the_calls_in_flight(cluster, image):
    pool = make_pool(warm={image: 1})
    try:
        sb = sandman.acquire(image, pool=pool)
        ref = sb.exec.remote("sleep 60")
        wait_until(lambda: b"sleep 60" in ray.get(sb.exec.remote("ps")).stdout,
                   timeout=10, what="the command to start")
        sandman.release(sb)
        with pytest.raises(sandman.SandboxLost):
            ray.get(ref, timeout=20)  # not after the command's 60 s
    finally:
        sandman.shutdown_pool(pool)


def test_warm_pool_is_kept_ready(cluster, image):
    pool = make_pool(warm={image: 3})
    try:
        wait_until(lambda: states(pool)["ready"] == 3, timeout=30, what="3 warm sandboxes")
        with sandman.sandbox(image, pool=pool):
            wait_until(lambda: states(pool)["ready"] == 3, timeout=30, what="the warm set refilled")
    finally:
        sandman.shutdown_pool(pool)


def test_bad_image_fails_the_acquire_with_the_reason(pool):
    with pytest.raises(sandman.ProviderError, match="not an OCI layout"):
        sandman.acquire("oci:/no/such/layout", pool=pool, timeout=30)


def test_acquire_timeout_is_raised_and_loses_nothing(cluster, image):
    pool = make_pool(max_sandboxes=1)
    try:
        held = sandman.acquire(image, pool=pool)
        started = time.monotonic()
        with pytest.raises(sandman.AcquireTimeout, match="within 0.5 s"):
            sandman.acquire(image, pool=pool, timeout=0.5)
        assert time.monotonic() - started < 5
        sandman.release(held)
    finally:
        sandman.shutdown_pool(pool)


def provider_sandboxes(pool):
    """What the provider itself runs for ``pool`` (not what the pool believes)."""
    import asyncio
    p = sandman.LocalProvider(state_root=STATE, cache_root=CACHE).bind(pool)
    return asyncio.run(p.list({POOL_LABEL: pool}))


def test_sigkilled_driver_leaves_no_leased_sandbox(cluster, image):
    pool = make_pool(max_starting=32)
    try:
        proc = holding_driver(cluster, RAY_NAMESPACE, pool, image, 20)
        assert states(pool)["leased"] == 20
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        wait_until(lambda: states(pool)["leased"] == 0, timeout=5,
                   what="every lease of the dead driver to be reclaimed")
        reclaimed_in = time.monotonic() - killed
        # the provider runs nothing leased: only warm (reset, unleased) ones or none
        wait_until(lambda: all(s == "ready" for s in _pool_states(pool)), timeout=30,
                   what="reclaimed sandboxes to settle")
        assert len(provider_sandboxes(pool)) == len(_pool_states(pool))
        assert reclaimed_in <= 5
    finally:
        sandman.shutdown_pool(pool)


def _sandbox_processes(pool):
    """The host pids in the cgroups of ``pool``'s sandboxes on this host: what its
    sandboxes run, read from the kernel (no Ray call)."""
    from sandman_ray.providers.local.agent import agent_groups
    pids = set()
    for group in agent_groups(pool):
        for procs in glob.glob(os.path.join(group, "*", "cgroup.procs")):
            try:
                with open(procs) as fh:
                    pids.update(int(line) for line in fh if line.strip())
            except OSError:  # removed meanwhile
                continue
    return pids


def test_a_driver_killed_right_after_its_burst_leaves_no_sandbox_within_seconds(
        cluster, image):
    """A driver acquires a burst, runs a command in each through its host and is
    SIGKILLed at once: the leases it took since the last sweep saw its host are ended
    at the next sweep like the others (the pool offered them to that host, which served
    them), not after the lease grace; every sandbox's processes are gone from the host's
    process table within 5 s."""
    pool = make_pool(max_starting=32, reuse="delete", lease_grace_s=60)
    try:
        proc = holding_driver(cluster, RAY_NAMESPACE, pool, image, 10)
        running = _sandbox_processes(pool)  # read in a few ms: no sweep between
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert len(running) >= 10  # a daemon in each, at least
        proc.wait()
        wait_until(lambda: not _sandbox_processes(pool), timeout=40,
                   what="the dead driver's sandboxes to be deleted")
        gone_in = time.monotonic() - killed
        assert gone_in <= 5, "the last sandbox went %.1f s after the kill" % gone_in
        assert provider_sandboxes(pool) == []
    finally:
        sandman.shutdown_pool(pool)


def _pool_states(pool):
    return [s["state"] for s in ray.get(sandman.get_pool(pool).list_sandboxes.remote())]


def test_killed_rollout_worker_releases_its_sandboxes(cluster, image):
    pool = make_pool()

    @ray.remote(num_cpus=0)
    class RolloutWorker:
        def start(self, pool, image):
            self.handles = [sandman.acquire(image, pool=pool) for _ in range(3)]
            return ray.get([h.exec.remote("true") for h in self.handles])

    try:
        worker = RolloutWorker.remote()
        ray.get(worker.start.remote(pool, image))
        assert states(pool)["leased"] == 3
        ray.kill(worker)
        wait_until(lambda: states(pool)["leased"] == 0, timeout=5,
                   what="the dead worker's leases to be reclaimed")
    finally:
        sandman.shutdown_pool(pool)


def test_dropped_handle_is_reclaimed(cluster, image):
    pool = make_pool()
    try:
        sb = sandman.acquire(image, pool=pool)
        assert ray.get(sb.exec.remote("true")).exit_code == 0
        assert states(pool)["leased"] == 1
        del sb  # the last reference: collected, the handle gives its lease back
        wait_until(lambda: states(pool)["leased"] == 0, timeout=5,
                   what="the forgotten handle's lease to be reclaimed")
    finally:
        sandman.shutdown_pool(pool)


def test_timed_out_and_cancelled_acquires_lose_track_of_nothing(cluster, image):
    pool = make_pool(max_starting=32, lease_grace_s=2.0)
    actor = sandman.get_pool(pool)
    spec = sandman.SandboxSpec(image=image)
    try:
        quick = [actor.lease.remote(spec, "impatient", 0.1) for _ in range(200)]
        timed_out = 0
        for ref in quick:
            try:
                ray.get(ref)  # lent in time: never taken by a handle, reclaimed after grace
            except sandman.AcquireTimeout:
                timed_out += 1
        assert timed_out > 100  # a cold pool cannot serve 200 within 0.1 s
        cancelled = [actor.lease.remote(spec, "canceller", 30) for _ in range(200)]
        for ref in cancelled:
            ray.cancel(ref)
        for ref in cancelled:
            try:
                ray.get(ref)
            except (ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError):
                pass
        # leases handed out to callers that never took them end after the grace
        wait_until(lambda: states(pool)["leased"] == 0 and all(
            s in ("ready",) for s in _pool_states(pool)), timeout=60,
            what="every sandbox to be warm and unleased or gone")
        assert sorted(i.sandbox_id for i in provider_sandboxes(pool)) == sorted(
            s["sandbox_id"] for s in ray.get(actor.list_sandboxes.remote()))
    finally:
        sandman.shutdown_pool(pool)


def test_pool_actor_restart_keeps_live_leases(cluster, image):
    pool = make_pool()
    try:
        handles = [sandman.acquire(image, pool=pool) for _ in range(3)]
        held = {ray.get(h.sandbox_id.remote()) for h in handles}
        before = ray.get(sandman.get_pool(pool).status.remote())["pid"]
        # under load: lease requests in flight (and creates started for them) at the kill
        in_flight = [sandman.get_pool(pool).lease.remote(sandman.SandboxSpec(image=image),
                                                          "loader", 30) for _ in range(6)]
        ray.kill(sandman.get_pool(pool), no_restart=False)
        wait_until(lambda: _pid(pool) not in (None, before), timeout=30,
                   what="the pool actor to come back in a new process")
        assert states(pool)["leased"] == 3
        for h in handles:
            assert ray.get(h.exec.remote("echo ok")).stdout == b"ok\n"
        more = [sandman.acquire(image, pool=pool) for _ in range(3)]
        assert held.isdisjoint({ray.get(h.sandbox_id.remote()) for h in more})
        for h in handles + more:
            sandman.release(h)
        for ref in in_flight:  # lost with the old process, or served by the new one
            try:
                ray.get(ref)
            except (ray.exceptions.RayError, sandman.SandmanError):
                pass
        wait_until(lambda: states(pool)["leased"] == 0, timeout=30, what="all released")
        # nothing leaked: what the provider runs is what the pool knows
        wait_until(lambda: sorted(i.sandbox_id for i in provider_sandboxes(pool)) == sorted(
            s["sandbox_id"] for s in ray.get(sandman.get_pool(pool).list_sandboxes.remote())),
            timeout=30, what="the provider's inventory to match the pool's")
    finally:
        sandman.shutdown_pool(pool)


def test_a_restarted_pool_keeps_each_sandbox_s_whole_spec(cluster, image):
    pool = make_pool()
    try:
        restart_keeps_specs(pool, sandman.SandboxSpec(image=image, cpu=1, memory="256Mi", env={"SPEC_CHECK": "kept"},
                               ttl_s=600, labels={"team": "rl"}))
    finally:
        sandman.shutdown_pool(pool)


def _pid(pool):
    try:
        return ray.get(sandman.get_pool(pool).status.remote(), timeout=2)["pid"]
    except (ray.exceptions.RayError, sandman.SandmanError):
        return None  # restarting


def test_throttling_provider_slows_the_pool_without_failing_acquires(cluster, image):
    from sandman_ray.providers.faults import FaultyProvider
    inner = sandman.LocalProvider(state_root=STATE, cache_root=CACHE)
    pool = make_pool(provider=FaultyProvider(inner, throttle_first=8),
                     create_rate_per_s=20, create_burst=5)
    try:
        handles = [sandman.acquire(image, pool=pool, timeout=120) for _ in range(6)]
        status = ray.get(sandman.get_pool(pool).status.remote())
        assert status["stats"]["throttled"] == 8 and status["stats"]["create_failures"] == 0
        assert status["create_rate_per_s"] < 20  # backed off, growing back
        for h in handles:
            sandman.release(h)
    finally:
        sandman.shutdown_pool(pool)


CLIENT = textwrap.dedent("""
    import sys, time, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], namespace="sandman-pool-tests")
    n = int(sys.argv[4])
    print("go", flush=True)
    sys.stdin.readline()  # every client starts at the same moment
    start = time.monotonic()
    refs = [sandman.acquire_async(sys.argv[3], pool=sys.argv[2], timeout=300) for _ in range(n)]
    import asyncio
    async def main():
        handles = await asyncio.gather(*refs)
        results = await asyncio.gather(*[h.exec.remote("true") for h in handles])
        assert all(r.exit_code == 0 for r in results)
        return handles
    handles = asyncio.run(main())
    print("done %.3f" % (time.monotonic() - start), flush=True)
    sys.stdin.readline()
""")


PER_CLIENT = int(os.environ.get("SANDMAN_FAIRNESS_PER_CLIENT", "20"))


def test_clients_are_served_fairly_and_creates_are_paced(cluster, image):
    """4 client processes ask for 20 sandboxes each at the same moment (80 handle
    actors, about a minute here; SANDMAN_FAIRNESS_PER_CLIENT sets another count)."""
    rate = 16.0
    pool = make_pool(create_rate_per_s=rate, create_burst=1, max_starting=16,
                     lease_grace_s=300.0)  # a handle may wait minutes for its worker
    procs = []
    try:
        for _ in range(4):
            procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, cluster, pool, image,
                                           str(PER_CLIENT)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          stderr=subprocess.STDOUT, cwd=str(ROOT)))
        for p in procs:
            while p.stdout.readline().strip() != "go":
                pass
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        times, output = [], []
        for p in procs:
            for line in p.stdout:
                output.append(line)
                if line.startswith("done "):
                    times.append(float(line.split()[1]))
                    break
        assert len(times) == 4, "a client failed:\n" + "".join(output[-40:])
        assert max(times) <= 1.2 * min(times) + 1.0, times
        starts = ray.get(sandman.get_pool(pool).status.remote())["create_starts"]
        assert len(starts) >= 4 * PER_CLIENT
        for i, t in enumerate(starts):  # any one-second window: at most rate + the burst
            assert sum(1 for u in starts[i:] if u - t < 1.0) <= rate + 1
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sandman.shutdown_pool(pool)


def test_client_quota_holds_back_a_greedy_client(cluster, image):
    pool = make_pool(client_quota=1)
    try:
        first = sandman.acquire(image, pool=pool, client="greedy")
        with pytest.raises(sandman.AcquireTimeout):
            sandman.acquire(image, pool=pool, client="greedy", timeout=1.0)
        other = sandman.acquire(image, pool=pool, client="modest", timeout=30)
        sandman.release(first)
        second = sandman.acquire(image, pool=pool, client="greedy", timeout=30)
        for h in (other, second):
            sandman.release(h)
    finally:
        sandman.shutdown_pool(pool)


def test_ttl_reclaims_a_lease_and_its_holder_learns_it(cluster, image):
    pool = make_pool(sandbox_ttl_s=3.0)  # long enough for the first call on a slow VM
    try:
        sb = sandman.acquire(image, pool=pool)
        assert ray.get(sb.exec.remote("true")).exit_code == 0
        wait_until(lambda: states(pool)["leased"] == 0, timeout=10, what="the TTL to reclaim")
        with pytest.raises(sandman.SandboxLost):
            ray.get(sb.exec.remote("true"))
    finally:
        sandman.shutdown_pool(pool)
