"""A leased sandbox's handle on a real local Ray with the LocalProvider: its calls
direct and through its host, streams, command ids, terminals, handles passed to other
processes, daemons the caller cannot reach, and leases kept in use by direct calls."""

import asyncio
import os
import pickle
import time

import pytest
import ray

import sandman_ray as sandman
from conftest import exercise_handle, local_ray, own_pool, wait_until

STATE = "/tmp/sandman-ray-test/handle-state"


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


@pytest.fixture(scope="module")
def image(busybox_image):
    return busybox_image


@pytest.fixture(scope="module")
def pool(cluster):
    """A pool the module's tests share; each gives back what it takes."""
    with own_pool(STATE, "h") as name:
        yield name


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


def test_hosts_made_by_different_processes_are_one_class_to_ray(cluster):
    """Every client process makes its own host, and a process that holds handles to
    actors loads their class once per class id, for good: a pool serving clients that
    come and go grew by a class per client while the id was Ray's random one."""
    def host_class_id():
        from sandman_ray.host import HandleHost
        meta = HandleHost.__ray_metadata__
        return os.getpid(), meta.actor_creation_function_descriptor.function_id.hex()

    in_a_worker = ray.remote(num_cpus=0, max_calls=1)(host_class_id)  # a new one each call
    first, second = ray.get(in_a_worker.remote()), ray.get(in_a_worker.remote())
    here = host_class_id()
    assert len({first[0], second[0], here[0]}) == 3
    assert first[1] == second[1] == here[1]


def test_direct_calls_from_loops_that_end_keep_one_connection(pool, image):
    """A worker that runs ``asyncio.run(sb.exec_async(...))`` at every step makes a
    loop each time: the connection of a loop that has closed is cut at the next call,
    so one connection stays, not one per step."""
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
    with own_pool(STATE, "hu", warm={image: 1}) as pool:
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
