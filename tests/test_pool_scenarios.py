"""OpenSandbox's pool scenarios (its Python SDK's tests/test_pool_sync.py and
tests/test_pool_async.py, which drive its pool with fakes), as tests of our pool on a
real local Ray with the LocalProvider. Each test's docstring names the scenario of
theirs it answers, and says where ours differs."""

import os
import signal
import threading
import time

import pytest
import ray

import sandman_ray as sandman
from conftest import LOCAL_CACHE, local_ray, processes_matching, unique_pool, wait_until
from sandbox_pids import daemon_under
from sandman_ray.providers.faults import FaultyProvider
from sandman_ray.providers.local import LocalProvider, leftovers

STATE = "/tmp/sandman-ray-test/scenario-state"
CACHE = LOCAL_CACHE


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


@pytest.fixture(scope="module")
def image(busybox_image):
    return busybox_image


def local() -> LocalProvider:
    return LocalProvider(state_root=STATE, cache_root=CACHE)


def status(pool: str) -> dict:
    return ray.get(sandman.get_pool(pool).status.remote())


def ready_ids(pool: str) -> set:
    return {s["sandbox_id"] for s in ray.get(sandman.get_pool(pool).list_sandboxes.remote())
            if s["state"] == "ready"}


def kill_daemon(sandbox_id: str) -> None:
    """SIGKILL the daemon of a sandbox from the host (the sandbox's PID 1: its pid
    namespace, and the sandbox, go with it)."""
    chains = [pid for pid in processes_matching(sandbox_id)
              if open("/proc/%d/cmdline" % pid, "rb").read().startswith(b"bwrap")]
    assert chains, "no launch chain of %s" % sandbox_id
    os.kill(daemon_under(min(chains)), signal.SIGKILL)


def test_a_pool_warms_up_as_it_is_created(cluster, image):
    """OpenSandbox: test_start_warms_idle_and_resize_zero_shrinks, its first half (a
    started pool fills its idle set). Ours: ``create_pool(warm=...)`` makes that many
    sandboxes ready before any acquire, and leases none."""
    pool = unique_pool(local(), "w", warm={image: 2})
    try:
        wait_until(lambda: status(pool)["states"]["ready"] == 2, timeout=60,
                   what="two warm sandboxes")
        state = status(pool)
        assert state["stats"]["creates"] == 2 and state["states"]["leased"] == 0
    finally:
        sandman.shutdown_pool(pool)


def test_an_acquire_fails_fast_on_an_empty_pool_or_creates_on_demand(cluster, image):
    """OpenSandbox: test_acquire_fail_fast_empty_raises_pool_empty and
    test_acquire_direct_create_when_empty (an AcquirePolicy). Ours: the acquire's
    ``timeout``: 0 fails at once when nothing is ready (AcquireTimeout, no lease and no
    waiter left), a timeout with room for a create gets a sandbox made for it."""
    pool = unique_pool(local(), "f")
    try:
        started = time.monotonic()
        with pytest.raises(sandman.AcquireTimeout):
            sandman.acquire(image, pool=pool, timeout=0)
        assert time.monotonic() - started < 2.0
        state = status(pool)
        assert state["states"]["leased"] == 0 and state["waiters"] == 0
        sb = sandman.acquire(image, pool=pool, timeout=60)
        assert sb.exec("echo made").stdout == b"made\n"
        sandman.release(sb)
        # warm now (released and reset): the fail-fast acquire is served at once
        wait_until(lambda: status(pool)["states"]["ready"] >= 1, timeout=30,
                   what="the released sandbox to be reset")
        quick = sandman.acquire(image, pool=pool, timeout=0)
        sandman.release(quick)
    finally:
        sandman.shutdown_pool(pool)


def test_a_warm_target_resized_while_leased(cluster, image):
    """OpenSandbox: test_start_warms_idle_and_resize_zero_shrinks, its second half
    (resize(0) kills the idle sandboxes). Ours: ``set_warm`` lowered deletes the ready
    surplus at once (no lingering) and never a leased sandbox, which serves on; raised
    again, it makes them again."""
    pool = unique_pool(local(), "r", warm={image: 2})
    try:
        wait_until(lambda: len(ready_ids(pool)) == 2, timeout=60, what="two warm sandboxes")
        sb = sandman.acquire(image, pool=pool, timeout=60)
        wait_until(lambda: len(ready_ids(pool)) == 2, timeout=60, what="the refill")
        assert sandman.set_warm(image, 0, pool=pool) == {}
        wait_until(lambda: not ready_ids(pool), timeout=15, what="the idle ones deleted")
        assert sb.exec("echo still").stdout == b"still\n"
        assert status(pool)["states"]["leased"] == 1
        sandman.set_warm(image, 1, pool=pool)
        wait_until(lambda: len(ready_ids(pool)) == 1, timeout=60, what="one warm again")
        sandman.release(sb)
    finally:
        sandman.shutdown_pool(pool)


def test_a_stale_idle_sandbox_is_replaced_not_lent(cluster, image):
    """OpenSandbox: test_acquire_fail_fast_stale_idle_raises_and_kills_candidate (an idle
    entry whose sandbox is gone is killed, not handed out). Ours: a warm sandbox whose
    daemon was killed is found by the pool's inventory check (every 5 s), deleted, and
    made again; acquires get working sandboxes."""
    pool = unique_pool(local(), "s", warm={image: 1})
    try:
        wait_until(lambda: len(ready_ids(pool)) == 1, timeout=60, what="a warm sandbox")
        (stale,) = ready_ids(pool)
        kill_daemon(stale)
        wait_until(lambda: ready_ids(pool) and stale not in ready_ids(pool), timeout=30,
                   what="the stale sandbox replaced")
        with sandman.sandbox(image, pool=pool, timeout=60) as sb:
            assert sb.sandbox != stale and sb.exec("true").exit_code == 0
        assert status(pool)["stats"]["lost"] == 1
    finally:
        sandman.shutdown_pool(pool)


def test_a_pool_restarted_with_leases_held_keeps_them(cluster, image):
    """OpenSandbox keeps its pool's state in a store (InMemoryPoolStateStore, Redis) that
    a restarted pool reads. Ours: the PoolActor killed while a lease is held comes back
    (Ray restarts it) with the lease recovered from the provider's inventory and the
    live hosts; the holder's sandbox kept its files, serves direct and ``.remote()``
    calls, and its release is taken by the new pool."""
    pool = unique_pool(local(), "t", warm={image: 1})
    try:
        sb = sandman.acquire(image, pool=pool, timeout=60)
        sb.write_file("/tmp/kept", b"before the restart")
        actor = sandman.get_pool(pool)
        before = status(pool)["pid"]
        ray.kill(actor, no_restart=False)

        def answered():
            try:
                return status(pool)["pid"] != before
            except (ray.exceptions.RayError, sandman.SandmanError):
                return False  # restarting
        wait_until(answered, timeout=60, what="the pool to come back")
        assert status(pool)["states"]["leased"] == 1
        assert sb.read_file("/tmp/kept") == b"before the restart"
        assert ray.get(sb.exec.remote("echo remote")).stdout == b"remote\n"
        sandman.release(sb)
        wait_until(lambda: status(pool)["states"]["leased"] == 0, timeout=30,
                   what="the release at the restarted pool")
    finally:
        sandman.shutdown_pool(pool)


def test_acquires_in_flight_when_the_pool_shuts_down_end_at_once(cluster, image):
    """OpenSandbox: test_acquire_when_stopped_raises_pool_not_running and
    test_graceful_shutdown_is_bounded_by_drain_timeout_during_warmup. Ours: acquires
    waiting on slow creates (3 s each) when the pool shuts down get AcquireTimeout that
    says so, none hangs or keeps a sandbox; the shutdown does not wait for the creates;
    nothing of the pool is left; an acquire afterwards names the missing pool."""
    pool = unique_pool(FaultyProvider(local(), create_delay_s=3.0), "d")
    outcomes = []

    def one():
        try:
            sandman.acquire(image, pool=pool, timeout=60)
            outcomes.append("leased")
        except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
            outcomes.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: status(pool)["waiters"] == 4, timeout=30, what="four waiting acquires")
    started = time.monotonic()
    sandman.shutdown_pool(pool)
    took = time.monotonic() - started
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert took < 3.0, "the shutdown waited %.1f s" % took
    assert len(outcomes) == 4 and all(isinstance(o, sandman.AcquireTimeout)
                                      and "shutting down" in str(o) for o in outcomes), outcomes
    wait_until(lambda: not any(leftovers(pool, STATE).values()), timeout=30,
               what="nothing of the pool left")
    with pytest.raises(sandman.SandmanError, match=pool):
        sandman.acquire(image, pool=pool, timeout=5)
    for call in (lambda: sandman.acquire(image, pool=0), lambda: sandman.set_warm(image, 1, 0),
                 lambda: sandman.shutdown_pool("a/b")):  # a name no pool can have
        with pytest.raises(ValueError, match="pool name"):
            call()


def test_a_daemon_lost_right_after_the_acquire_surfaces_and_leaks_nothing(cluster, image):
    """OpenSandbox kills a candidate it cannot connect to when it acquires. Ours: a
    sandbox lent and then lost before its first call (its daemon killed): the call
    raises SandboxLost, directly and through the host, never hangs; the release is
    taken, the sandbox is started afresh for the next lease (its reset, finding it
    dead, launches it again), and the next acquire gets a working one."""
    pool = unique_pool(local(), "b", warm={image: 1})
    try:
        sb = sandman.acquire(image, pool=pool, timeout=60)
        lost = sb.sandbox
        kill_daemon(lost)
        with pytest.raises(sandman.SandboxLost):
            sb.exec("true")
        with pytest.raises(sandman.SandboxLost):
            ray.get(sb.exec.remote("true"))
        sandman.release(sb)
        wait_until(lambda: status(pool)["states"]["leased"] == 0, timeout=30,
                   what="the release")
        with sandman.sandbox(image, pool=pool, timeout=60) as again:
            assert again.exec("true").exit_code == 0
            assert again.exec("cat /proc/1/cmdline").stdout  # a daemon again
    finally:
        sandman.shutdown_pool(pool)
