"""The pool, its handles and the public API on a real local Ray with the LocalProvider:
owners that die, handles that are dropped, acquires that time out or are cancelled,
a pool actor that is killed, a provider that throttles."""

import gc
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
    RAY_NAMESPACE, ROOT, exercise_handle, holding_driver, local_ray, restart_keeps_specs,
    unique_pool,
    wait_until)

STATE = "/tmp/sandman-ray-test/pool-state"
CACHE = str(ROOT / ".cache" / "provider")


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


@pytest.fixture(scope="module")
def image(busybox_rootfs):
    return "dir:%s" % busybox_rootfs


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


def test_acquire_exec_release_and_context_manager(pool, image):
    sb = sandman.acquire(image, pool=pool, timeout=60)
    exercise_handle(sb)
    sandman.release(sb)
    with sandman.sandbox(image, pool=pool) as sb2:
        assert ray.get(sb2.exec.remote("ls /tmp/x")).exit_code != 0  # a reset sandbox
    assert states(pool)["leased"] == 0


def test_an_acquire_is_one_call_and_its_host_holds_the_lease_at_once(pool, image):
    """The host asks the pool itself, naming itself: the pool registers the lease as it
    lends it, and no second call (a bind, a register) follows."""
    before = ray.get(sandman.get_pool(pool).status.remote())["stats"]
    handles = [sandman.acquire(image, pool=pool) for _ in range(3)]
    try:
        after = ray.get(sandman.get_pool(pool).status.remote())["stats"]
        assert after["leases"] - before["leases"] == 3
        assert after["registered"] == before["registered"]
        holders = {s["holder"] for s in ray.get(sandman.get_pool(pool).list_sandboxes.remote())
                   if s["state"] == "leased"}
        assert len(holders) == 1 and holders.pop().startswith("sandman:sbx:")
        assert ray.get(handles[0].node_id.remote()) == ray.get_runtime_context().get_node_id()
    finally:
        for h in handles:
            sandman.release(h)


def test_handle_calls_take_any_arguments_an_actor_call_takes(pool, image):
    """Plain arguments travel packed into one value; others (an ObjectRef for Ray to
    resolve first) as Ray arguments. Both reach the daemon as given."""
    with sandman.sandbox(image, pool=pool) as sb:
        ray.get(sb.write_file.remote("/work/ref", ray.put(b"from the object store")))
        assert ray.get(sb.read_file.remote("/work/ref")) == b"from the object store"
        r = ray.get(sb.exec.remote(("sh", "-c", "echo $V; cat"), env={"V": "kw"},
                                   stdin=b"in", timeout=30))
        assert (r.exit_code, r.stdout) == (0, b"kw\nin")
        with pytest.raises(TypeError):
            ray.get(sb.exec.remote("true", no_such_option=1))
        with pytest.raises(TypeError):  # packed, but not decodable as the daemon's map
            ray.get(sb.exec.remote("true", env={1: "x"}))
        with pytest.raises(TypeError):
            ray.get(sb.sandbox_id.remote("unexpected"))
        assert ray.get(sb.exec.remote("echo still")).stdout == b"still\n"


def test_direct_calls_answer_as_remote_calls_do(pool, image):
    """``sb.exec(...)`` and ``await sb.exec_async(...)`` run in the caller's process on
    connections of its own, with the same arguments, results and errors as
    ``.remote()``; a session's state is shared by both paths."""
    import asyncio
    with sandman.sandbox(image, pool=pool) as sb:
        assert sb._direct is not None  # the sandbox is on this node: a unix socket
        r = sb.exec(("sh", "-c", "echo $V; cat"), env={"V": "kw"}, stdin=b"in", timeout=30)
        assert (r.exit_code, r.stdout) == (0, b"kw\nin")
        via_host = ray.get(sb.exec.remote(("sh", "-c", "echo $V; cat"), env={"V": "kw"},
                                          stdin=b"in", timeout=30))
        assert type(via_host) is type(r) and \
            via_host._replace(duration_s=0) == r._replace(duration_s=0)
        sb.run("cd /tmp && export A=direct")
        assert ray.get(sb.run.remote("echo $A $(pwd)")).stdout == b"direct /tmp\n"
        ray.get(sb.write_file.remote("/work/both", b"via the host"))
        assert sb.read_file("/work/both") == b"via the host"
        assert (sb.sandbox_id(), sb.node_id()) == (ray.get(sb.sandbox_id.remote()),
                                                   ray.get(sb.node_id.remote()))
        with pytest.raises(TypeError):
            sb.exec("true", no_such_option=1)
        with pytest.raises(sandman.DaemonError):
            sb.read_file("/no/such/file")
        assert ray.get(sb.exec.remote("echo still")).stdout == b"still\n"

        async def side_by_side():
            return await asyncio.gather(*[sb.exec_async("sleep 0.2; echo %d" % i)
                                          for i in range(4)])
        assert [x.stdout for x in asyncio.run(side_by_side())] == [b"%d\n" % i for i in range(4)]
        assert asyncio.run(sb.sandbox_id_async()) == sb.sandbox
        spawned = sb.spawn("sleep 100")
        assert ray.get(sb.proc_status.remote(spawned)).running  # one sandbox, both ways


def _whole(items):
    """(stdout bytes, the ExecResult) of a stream's items."""
    out, result = b"", None
    for item in items:
        if isinstance(item, sandman.ExecResult):
            result = item
        else:
            assert item[0] in ("stdout", "stderr")
            out += item[1] if item[0] == "stdout" else b""
    return out, result


def _no_sleep_left(sb):
    return not sb.exec("pidof sleep").ok


def test_exec_stream_yields_output_then_the_result_on_every_path(pool, image):
    """Directly, through ``.remote()`` (a Ray streaming generator), with asyncio, and
    through the host for a passed handle: the same chunks, then the ExecResult."""
    import asyncio
    cmd = "head -c 3000000 /dev/zero; echo tail"
    with sandman.sandbox(image, pool=pool) as sb:
        stream = sb.exec_stream(cmd)
        out, result = _whole(stream)
        assert len(out) == 3_000_005 and out.endswith(b"tail\n") and result.ok
        assert stream.result is result and result.stdout == b""
        out_remote, result_remote = _whole(ray.get(ref) for ref in sb.exec_stream.remote(cmd))
        assert out_remote == out and result_remote.ok

        async def consume():
            got = []
            async for item in sb.exec_stream_async(cmd):
                got.append(item)
            return got
        assert _whole(asyncio.run(consume()))[0] == out
        passed_on = pickle.loads(pickle.dumps(sb))
        assert passed_on._direct is None
        assert _whole(passed_on.exec_stream(cmd))[0] == out


def test_a_stream_given_up_kills_its_command(pool, image):
    """Closing the iterator, dropping ``.remote()``'s generator, or breaking out of an
    async stream ends the command in the sandbox."""
    import asyncio
    cmd = "echo start; exec sleep 1000"
    with sandman.sandbox(image, pool=pool) as sb:
        stream = sb.exec_stream(cmd)
        assert next(stream) == ("stdout", b"start\n")
        stream.close()
        wait_until(lambda: _no_sleep_left(sb), what="the direct stream's command killed")
        refs = sb.exec_stream.remote(cmd)
        assert ray.get(next(refs)) == ("stdout", b"start\n")
        assert not _no_sleep_left(sb)
        del refs
        wait_until(lambda: _no_sleep_left(sb), what="the .remote() stream's command killed")

        async def first_then_break():
            async for item in sb.exec_stream_async(cmd):
                return item
        assert asyncio.run(first_then_break()) == ("stdout", b"start\n")
        wait_until(lambda: _no_sleep_left(sb), what="the async stream's command killed")
        assert sb.exec("echo fine").stdout == b"fine\n"


def test_a_command_with_an_id_runs_once_on_every_path(pool, image):
    """A retry with the same command id, directly, through the host or from a handle
    passed to another process, returns the first run's result: the append ran once."""
    cmd = "echo ran >> /tmp/log; wc -l < /tmp/log"
    with sandman.sandbox(image, pool=pool) as sb:
        first = sb.exec(cmd, command_id="append-once")
        assert first.stdout == b"1\n"
        assert ray.get(sb.exec.remote(cmd, command_id="append-once")) == first
        passed_on = pickle.loads(pickle.dumps(sb))
        assert passed_on.exec(cmd, command_id="append-once") == first
        assert sb.read_file("/tmp/log") == b"ran\n"
        assert sb.exec(cmd, command_id="append-twice").stdout == b"2\n"
        # what runs in the background is the lease's: found again through another path
        pid = sb.spawn("echo from the background; sleep 100", command_id="bg")
        assert passed_on.spawn("echo from the background; sleep 100", command_id="bg") == pid
        assert pid in [p.pid for p in passed_on.proc_list() if p.running]
        wait_until(lambda: passed_on.proc_output(pid).data == b"from the background\n",
                   what="the background process's output")


def test_a_terminal_runs_an_interactive_shell(pool, image):
    """A PTY through the handle: ``sh -i`` answers keys, programs see a terminal of the
    size asked, and closing it ends what it started."""
    with sandman.sandbox(image, pool=pool) as sb:
        term = sb.pty_open(["sh", "-i"], cols=90, rows=20)
        sb.pty_write(term["pty"], "[ -t 0 ] && [ -t 1 ] && echo tty-$((6*7)); stty size\n")
        seen, cursor = b"", 0
        while b"20 90" not in seen:
            r = ray.get(sb.pty_read.remote(term["pty"], cursor, timeout=10))
            assert r["data"] or r["running"], seen
            seen, cursor = seen + r["data"], r["cursor"]
        assert b"tty-42" in seen
        sb.pty_write(term["pty"], "sleep 1000 &\n")
        wait_until(lambda: not _no_sleep_left(sb), what="the terminal's sleep")
        assert not sb.pty_close(term["pty"])["running"]
        wait_until(lambda: _no_sleep_left(sb), what="the terminal's processes gone")


def test_a_passed_handle_calls_through_its_host(pool, image):
    """The direct path stays with the process that acquired the lease (its token is
    not pickled): a handle given to another process makes the same calls, directly
    written, through its host."""
    with sandman.sandbox(image, pool=pool) as sb:
        passed_on = pickle.loads(pickle.dumps(sb))
        assert passed_on._direct is None
        assert sb._direct.token.encode() not in pickle.dumps(sb)
        assert passed_on.exec("echo relayed").stdout == b"relayed\n"

        @ray.remote(num_cpus=0)
        def elsewhere(handle):
            return handle.exec("echo from a task").stdout, handle._direct is None
        assert ray.get(elsewhere.remote(sb)) == (b"from a task\n", True)


def test_direct_calls_from_loops_that_end_keep_one_connection(pool, image):
    """A worker that runs ``asyncio.run(sb.exec_async(...))`` at every step makes a
    loop each time: the connection of a loop that has closed is cut at the next call,
    so one connection stays, not one per step."""
    import asyncio
    with sandman.sandbox(image, pool=pool) as sb:
        for i in range(5):
            assert asyncio.run(sb.exec_async("echo %d" % i)).stdout == b"%d\n" % i
        assert len(sb._direct.loops) == 1
        # several calls of one loop share its connection, and one connect
        async def together():
            return await asyncio.gather(*[sb.exec_async("true") for _ in range(6)])
        assert [r.exit_code for r in asyncio.run(together())] == [0] * 6
        assert len(sb._direct.loops) == 1


def test_a_daemon_this_process_cannot_reach_is_called_through_the_host(pool, image):
    """A direct path that fails to connect before anything was sent (a TCP address out
    of this process's reach) gives way to the host, and the call is made once."""
    import asyncio
    with sandman.sandbox(image, pool=pool) as sb:
        sb._direct.address = "unix:/nonexistent/sandman.sock"
        assert sb.exec("echo via the host").stdout == b"via the host\n"
        assert sb._direct is None
    with sandman.sandbox(image, pool=pool) as sb:
        sb._direct.address = "unix:/nonexistent/sandman.sock"
        assert asyncio.run(sb.exec_async("echo via the host")).stdout == b"via the host\n"
        assert sb._direct is None


def test_direct_calls_keep_their_lease_in_use(cluster, image):
    """A lease used only by direct calls tells the pool so: idleness does not reclaim
    it while they go on, and does once they stop."""
    pool = make_pool(warm={image: 1})
    try:
        sb = sandman.acquire(sandman.SandboxSpec(image=image, idle_timeout_s=5.0), pool=pool)
        until = time.monotonic() + 7.0
        while time.monotonic() < until:  # longer than the idle timeout
            assert sb.exec("true").exit_code == 0
            time.sleep(0.5)
        assert states(pool)["leased"] == 1
        wait_until(lambda: states(pool)["leased"] == 0, timeout=20,
                   what="the idle lease to be reclaimed")

        def refused() -> bool:  # once the pool has reset the sandbox (milliseconds)
            try:
                sb.exec("true")
                return False
            except sandman.LeaseEnded as exc:
                assert "idle" in str(exc)
                return True
        wait_until(refused, timeout=30, what="direct calls to be refused")
    finally:
        sandman.shutdown_pool(pool)


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
