"""Snapshots, forks and pauses through the public API, on a real local Ray with the
LocalProvider: forks carry files and the session's place, are independent of each
other and of their parent, are deleted with their pool; a paused sandbox uses no CPU
and comes back with its processes."""

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import ray

import sandman_ray as sandman
from sandman_ray.providers.local import leftovers
from sandman_ray.providers.local.provider import DEFAULT_SNAPSHOT_ROOT
from conftest import ROOT, freezer_state, shared_ray, unique_pool, wait_until

STATE = "/tmp/sandman-ray-test/snapshot-state"
CACHE = ROOT / ".cache" / "provider"
SNAPSHOTS = Path(DEFAULT_SNAPSHOT_ROOT)  # providers/local/snapshots.py


@pytest.fixture(scope="module")
def cluster():
    yield shared_ray()


def make_pool(**config):
    return unique_pool(sandman.LocalProvider(state_root=STATE, cache_root=str(CACHE)), "snap",
                       **config)


@pytest.fixture
def pool(cluster):
    """A pool of the test's own, for tests that count its sandboxes, snapshots or CPU."""
    name = make_pool()
    yield name
    sandman.shutdown_pool(name)


@pytest.fixture(scope="module")
def shared_pool(cluster):
    """A pool the module's tests that count nothing of it share (each gives back what
    it takes)."""
    name = make_pool()
    yield name
    sandman.shutdown_pool(name)


def on_disk(pool: str) -> list:
    """The pool's snapshot directories in the stores of this machine (one per node)."""
    return sorted(p.name for p in SNAPSHOTS.glob("*/%s/*" % pool))


def test_forks_start_from_the_parents_files_and_session_and_are_independent(pool):
    sb = sandman.acquire(pool=pool, timeout=120)
    sb.exec(["sh", "-c", "head -c 50000000 /dev/urandom > /root/big && md5sum /root/big "
                         "> /root/big.md5 && mkdir -p /work && echo parent > /work/f && "
                         "rm /etc/hostname"])
    sb.run("cd /work && export TASK=t1")
    forks = sandman.fork(sb, 8)
    try:
        assert len({f.sandbox for f in forks} | {sb.sandbox}) == 9
        for f in forks:
            r = f.run("pwd; echo $TASK; cat f; md5sum -c /root/big.md5 >/dev/null && echo same;"
                      " test -e /etc/hostname || echo deleted")
            assert r.stdout == b"/work\nt1\nparent\nsame\ndeleted\n", r
        # later writes stay where they were made: in a fork, in the parent
        forks[0].exec(["sh", "-c", "echo child > /work/f && rm /root/big"])
        sb.exec(["sh", "-c", "echo parent-later > /work/f && echo new > /work/g"])
        for f in forks[1:]:
            assert f.exec(["cat", "/work/f"]).stdout == b"parent\n"
            assert f.exec(["ls", "/work"]).stdout == b"f\n"
            assert f.exec(["test", "-e", "/root/big"]).exit_code == 0
        assert forks[0].exec(["cat", "/work/f"]).stdout == b"child\n"
        assert sb.exec(["cat", "/work/f"]).stdout == b"parent-later\n"
        # the fork's snapshot is the pool's, listed with its size and its sandboxes
        [snap] = sandman.snapshots(pool)
        assert snap["for_fork"] and snap["sandboxes"] == 8
        assert snap["size_bytes"] >= 50_000_000
    finally:
        for f in forks:
            sandman.release(f)
        sandman.release(sb)


def test_a_forks_snapshot_goes_with_its_last_sandbox(cluster):
    pool = make_pool(reuse="delete")
    try:
        with sandman.sandbox(pool=pool, timeout=120) as sb:
            sb.exec(["sh", "-c", "echo x > /root/x"])
            forks = sandman.fork(sb, 2)
            assert len(on_disk(pool)) == 1
            for f in forks:
                sandman.release(f)
        wait_until(lambda: not sandman.snapshots(pool) and not on_disk(pool), timeout=30,
                   what="the fork's snapshot to go with its sandboxes")
    finally:
        sandman.shutdown_pool(pool)


def test_a_named_snapshot_is_an_image_kept_warm_listed_and_deleted(pool):
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        sb.exec(["sh", "-c", "echo prepared > /root/state"])
        snap = sandman.snapshot(sb, "task-1")
        assert snap == "snapshot:%s/task-1" % pool
        with pytest.raises(ValueError, match="already has a snapshot"):
            sandman.snapshot(sb, "task-1")
        with pytest.raises(ValueError, match="snapshot name"):
            sandman.snapshot(sb, "../escape")
    # a warm set of it: four READY before anyone asks, then lent without a create
    sandman.set_warm(snap, 4)
    actor = sandman.get_pool(pool)
    ready = lambda: sum(1 for s in ray.get(actor.list_sandboxes.remote())  # noqa: E731
                        if s["image"] == snap and s["state"] == "ready")
    wait_until(lambda: ready() == 4, timeout=60, what="4 warm sandboxes of the snapshot")
    creates = ray.get(actor.status.remote())["stats"]["creates"]
    held = [sandman.acquire(snap, pool=pool, timeout=30) for _ in range(4)]
    assert ray.get(actor.status.remote())["stats"]["creates"] == creates
    assert all(h.exec(["cat", "/root/state"]).stdout == b"prepared\n" for h in held)
    [listed] = sandman.snapshots(pool)
    assert listed["name"] == "task-1" and listed["warm"] == 4 and listed["sandboxes"] >= 4
    assert listed["size_bytes"] > 0 and not listed["for_fork"]
    # not while leases hold sandboxes of it
    with pytest.raises(sandman.SnapshotInUse, match="release them first"):
        sandman.delete_snapshot(snap)
    for h in held:
        sandman.release(h)
    sandman.delete_snapshot(snap)
    assert sandman.snapshots(pool) == [] and on_disk(pool) == []
    assert not any(s["image"] == snap for s in ray.get(actor.list_sandboxes.remote()))
    with pytest.raises(sandman.ProviderError, match="no such snapshot"):
        sandman.acquire(snap, pool=pool, timeout=30)  # nothing of it can start any more


def test_snapshots_are_deleted_with_their_pool(cluster):
    pool = make_pool()
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        sb.exec(["sh", "-c", "echo a > /root/a"])
        sandman.snapshot(sb, "one")
        sandman.snapshot(sb, "two")
        sandman.fork(sb, 1)[0]  # dropped: its lease is reclaimed with the pool
    assert len(on_disk(pool)) == 3  # two named, and the fork's
    sandman.shutdown_pool(pool)
    assert on_disk(pool) == []
    assert leftovers(pool, STATE) == {"processes": [], "directories": [], "cgroups": []}


def test_the_host_image_cannot_be_snapshotted(shared_pool):
    pool = shared_pool
    with sandman.sandbox("host", pool=pool, timeout=120) as sb:
        with pytest.raises(sandman.NotSupported, match="host image"):
            sandman.snapshot(sb)


def sandbox_cpu_s(pool: str) -> float:
    """CPU seconds used so far by every process of the pool's sandboxes (from the
    host's /proc, found as ``leftovers`` finds them)."""
    total = 0
    for pid in leftovers(pool, STATE)["processes"]:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_a_paused_sandbox_uses_no_cpu_and_resumes_with_its_processes(pool):
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        pid = sb.spawn(["sh", "-c", "while :; do :; done"])
        sb.write_file("/root/kept", b"memory and files stay")
        # each window lets CPU time accumulate while it is measured: a measure, not a wait
        before = sandbox_cpu_s(pool)
        time.sleep(0.5)
        assert sandbox_cpu_s(pool) - before > 0.2  # running: the loop takes a core
        sandman.pause(sb)
        frozen = sandbox_cpu_s(pool)
        time.sleep(1.0)
        assert sandbox_cpu_s(pool) - frozen < 0.02
        sandman.resume(sb)
        resumed = sandbox_cpu_s(pool)
        time.sleep(0.5)
        assert sandbox_cpu_s(pool) - resumed > 0.2
        assert sb.proc_status(pid).running
        assert sb.read_file("/root/kept") == b"memory and files stay"


def test_a_handle_pauses_and_resumes_its_sandbox_and_may_resume_on_a_call(shared_pool):
    pool = shared_pool
    """``sb.pause()``: a call meanwhile is refused with SandboxPaused (it would wait on a
    frozen daemon), unless the lease resumes on a call (``auto_resume``); a pause with
    ``reclaim`` keeps the sandbox whole. The async forms do the same."""
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        sb.run("export KEPT=yes")
        pid = sb.spawn("sleep 300")
        sb.pause()
        assert sb.paused
        with pytest.raises(sandman.SandboxPaused, match="resume"):
            sb.exec("true")
        with pytest.raises(sandman.SandboxPaused):
            sb.exec.remote("true")
        sb.resume()
        assert sb.run("echo $KEPT").stdout == b"yes\n" and not sb.paused
        sb.pause(reclaim=True)
        sb.auto_resume = True
        assert sb.exec("echo back").stdout == b"back\n" and not sb.paused
        assert sb.proc_status(pid).running

        async def paused_then_called():
            await sb.pause_async()
            was = sb.paused
            out = await sb.exec_async("echo async")
            return was, out.stdout, sb.paused
        assert asyncio.run(paused_then_called()) == (True, b"async\n", False)
        sb.pause()
        assert ray.get(sb.run.remote("echo $KEPT")).stdout == b"yes\n"


def test_a_holder_pauses_through_its_node_s_agent_which_takes_the_lease_s_token_only(pool):
    """The handle of the process that holds the lease's token pauses in one hop, at the
    node's agent (LocalProvider.controller), and the pool hears of it after; the agent
    refuses any other token, among them that of a lease of the same sandbox that
    ended, and leaves the sandbox running."""
    actor = sandman.get_pool(pool)
    events = lambda sid: [e[2] for e in ray.get(actor.recent_events.remote())  # noqa: E731
                          if e[1] == sid and e[2] in ("paused", "resumed")]
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        agent = ray.get_actor(sb._controller, namespace="sandman")
        token = sb._direct.token
        for wrong in ("", "0" * len(token), token[:-1], token + "0", b"x"):
            assert ray.get(agent.pause_held.remote(sb.sandbox, wrong)) is False
        assert ray.get(agent.pause_held.remote("no-such-sandbox", token)) is False
        assert freezer_state(pool, sb.sandbox) == "THAWED"
        sb.pause()
        assert freezer_state(pool, sb.sandbox) == "FROZEN"
        wait_until(lambda: events(sb.sandbox) == ["paused"], what="the pool to hear of it")
        sb.resume()
        assert freezer_state(pool, sb.sandbox) == "THAWED" and sb.exec("true").exit_code == 0
        wait_until(lambda: events(sb.sandbox) == ["paused", "resumed"],
                   what="the pool to hear of the resume")
    with sandman.sandbox(pool=pool, timeout=120) as again:  # the same sandbox, reset
        assert again.sandbox == sb.sandbox and again._direct.token != token
        assert ray.get(agent.pause_held.remote(again.sandbox, token)) is False
        assert ray.get(agent.resume_held.remote(again.sandbox, token)) is False
        assert freezer_state(pool, again.sandbox) == "THAWED"
        assert again.exec("echo mine").stdout == b"mine\n"


def test_the_agent_s_control_socket_pauses_for_the_token_alone_and_refuses_garbage(shared_pool):
    pool = shared_pool
    """The holder's pause goes to its node agent's control socket (sandman_ray.control),
    no Ray call; the socket is root's alone, unseen inside the sandbox, takes the
    lease's token only, and answers garbage (bad JSON, wrong types, a line past its
    limit, a half line) with an error or nothing, the sandbox running on."""
    import socket
    import stat
    from sandman_ray import control
    from sandman_ray.lookup import _control_paths
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        sb.pause()
        path = _control_paths[sb._controller]
        assert path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert freezer_state(pool, sb.sandbox) == "FROZEN"
        sb.resume()
        assert freezer_state(pool, sb.sandbox) == "THAWED"
        token = sb._direct.token
        for wrong in ("", "0" * len(token), token[:-1], token + "0"):
            assert control.ask(path, "pause", sb.sandbox, wrong) is False
        assert control.ask(path, "pause", "no-such-sandbox", token) is False
        for garbage in (b"not json\n", b"[1, 2]\n", b'{"op": "kill", "sandbox": "x", '
                        b'"token": "y"}\n', b'{"op": "pause", "sandbox": 1, "token": "y"}\n',
                        json.dumps({"op": "pause", "sandbox": sb.sandbox, "token": token,
                                    "reclaim": "yes"}).encode() + b"\n",
                        b"x" * (control.REQUEST_LIMIT + 10) + b"\n", b'{"op": "pau'):
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(control.READ_TIMEOUT_S + 5)
                conn.connect(path)
                try:
                    conn.sendall(garbage)
                    conn.shutdown(socket.SHUT_WR)
                    answer = b"".join(iter(lambda: conn.recv(4096), b""))
                except ConnectionResetError:  # dropped with the rest of its line unread
                    answer = b""
            assert answer == b"" or b"ProtocolError" in answer, (garbage[:40], answer)
        assert freezer_state(pool, sb.sandbox) == "THAWED"
        inside = sb.exec(["sh", "-c", "test -e %s || ls %s" % (path, os.path.dirname(path))])
        assert inside.exit_code != 0, inside
        assert sb.exec("echo on").stdout == b"on\n"
        assert control.ask(path, "pause", sb.sandbox, token) is True  # the token alone
        assert freezer_state(pool, sb.sandbox) == "FROZEN"
        assert control.ask(path, "resume", sb.sandbox, token) is True
        assert sb.exec("echo still").stdout == b"still\n"


def test_a_holder_renews_at_its_node_s_agent_for_the_lease_s_token_alone(pool):
    """A holder's renew (sandman_ray.control: the service's kept SandboxFusion leases
    ask it) is the pool's reset without the lease ending: the sandbox keeps none of
    its files or processes and takes the new token alone. Any other token renews
    nothing; and a lease that ended, whose sandbox the pool resets and lends again,
    never renews the next holder's sandbox nor learns its token, even when its renew
    arrives during the pool's reset."""
    from sandman_ray import control
    from sandman_ray.client import DaemonClient
    from sandman_ray.errors import AuthError
    renew = lambda sid, token: asyncio.run(control.renew_async(path, sid, token))  # noqa
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        agent = ray.get_actor(sb._controller, namespace="sandman")
        path = ray.get(agent.control_address.remote())
        token, address = sb._direct.token, sb._direct.address
        sb.exec(["sh", "-c", "echo left > /root/left; setsid sleep 1000 & echo $! > /pid"])
        for wrong in ("", "0" * len(token), token[:-1], token + "0"):
            assert renew(sb.sandbox, wrong) is None
        assert ray.get(agent.renew_held.remote("no-such-sandbox", token)) is False
        assert sb.exec("cat /root/left").stdout == b"left\n"  # nothing was done
        renewed = renew(sb.sandbox, token)
        assert renewed is not None and renewed["token"] != token, renewed
        with DaemonClient(renewed["address"], renewed["token"]) as client:
            left = client.exec(["sh", "-c", "ls /root/left /pid; grep -lx sleep /proc/*/comm"])
            assert left.exit_code != 0 and left.stdout == b"", left
        with pytest.raises(AuthError):
            DaemonClient(address, token).exec("true")
        assert renew(sb.sandbox, token) is None  # the old token renews no more
        # a reset as the pool's at a lease's end, and a renew with that lease's token
        # sent after it: the renew waits for the reset and finds the token gone
        token = renewed["token"]
        info, late = ray.get([agent.reset.remote(sb.sandbox),
                              agent.renew_held.remote(sb.sandbox, token)])
        assert late is False and info.token != token
    with sandman.sandbox(pool=pool, timeout=120) as again:  # the same sandbox, lent again
        assert again.sandbox == sb.sandbox
        assert renew(again.sandbox, token) is None
        assert again.exec("echo mine").stdout == b"mine\n"


def test_pauses_with_an_ended_lease_s_token_during_its_reset_never_freeze_the_next(pool):
    """A holder keeps pausing through the control socket with its token while its
    release resets the sandbox: from the reset's first step on the token is refused,
    so the next holder gets the sandbox running (before, a pause that waited on the
    reset's lock froze it after the reset's thaw)."""
    import threading
    from sandman_ray import control
    from sandman_ray.lookup import _control_paths
    sb = sandman.acquire(pool=pool, timeout=120)
    sb.pause()
    sb.resume()
    path, token, sandbox_id = _control_paths[sb._controller], sb._direct.token, sb.sandbox
    stop, answers = threading.Event(), []

    def hammer():
        while not stop.is_set():
            answers.append(control.ask(path, "pause", sandbox_id, token))
    threads = [threading.Thread(target=hammer)]
    for t in threads:
        t.start()
    try:
        sandman.release(sb)
        with sandman.sandbox(pool=pool, timeout=120) as again:
            stop.set()
            for t in threads:
                t.join()
            assert again.sandbox == sandbox_id
            assert freezer_state(pool, again.sandbox) == "THAWED"
            assert again.exec("echo mine").stdout == b"mine\n"
    finally:
        stop.set()
    assert answers and answers[-1] is False, answers[-5:]


def test_a_paused_lease_is_not_reclaimed_for_idleness_but_its_ttl_runs(cluster):
    pool = make_pool(idle_timeout_s=5)
    try:
        sb = sandman.acquire(sandman.SandboxSpec(ttl_s=10), pool=pool, timeout=120)
        sandman.pause(sb)
        actor = sandman.get_pool(pool)
        leased = lambda: [s for s in ray.get(actor.list_sandboxes.remote())  # noqa: E731
                          if s["state"] == "leased"]
        # past the idle timeout (5 s; the watchdog sweeps every 0.2 s), the paused
        # lease is still held: the passing of time is what this checks
        time.sleep(6)
        assert len(leased()) == 1
        # ... until its TTL (10 s) ends it; the sandbox is thawed and reset for the next
        wait_until(lambda: not leased(), timeout=30, what="the TTL to end the paused lease")
        # the handle paused it, so it asks the pool first, which knows
        with pytest.raises(sandman.LeaseEnded):
            sb.resume()
        # through the host, which the pool tells at once (a direct call may still reach
        # the sandbox until its reset, milliseconds later: SECURITY.md)
        with pytest.raises(sandman.LeaseEnded):
            ray.get(sb.exec.remote("true"))
        with sandman.sandbox(pool=pool, timeout=60) as again:
            assert again.exec("echo up").stdout == b"up\n"
    finally:
        sandman.shutdown_pool(pool)


def test_only_the_holder_snapshots_or_pauses_a_lease(shared_pool):
    pool = shared_pool
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        actor = sandman.get_pool(pool)
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(actor.snapshot.remote(sb.lease_id, "someone-else"))
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(actor.pause.remote(sb.lease_id, "someone-else"))
    with pytest.raises(sandman.LeaseEnded):
        sandman.snapshot(sb)
    with pytest.raises(ValueError, match="n must be"):
        sandman.fork(sb, 0)


def sandman_cmd(*args) -> "subprocess.CompletedProcess":
    import subprocess
    import sys
    exe = Path(sys.executable).with_name("sandman")
    return subprocess.run([str(exe), "--address", ray.get_runtime_context().gcs_address]
                          + list(args), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_the_cli_lists_deletes_and_counts_snapshots_at_shutdown(cluster):
    pool = make_pool()
    with sandman.sandbox(pool=pool, timeout=120) as sb:
        sb.exec(["sh", "-c", "head -c 3000000 /dev/zero > /root/three-mb"])
        sandman.snapshot(sb, "kept")
        sandman.snapshot(sb, "dropped")
    listed = sandman_cmd("snapshots", pool, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted(r["name"] for r in rows) == ["dropped", "kept"]
    assert all(r["size_bytes"] >= 3_000_000 and r["base"] == "builtin:debian" for r in rows)
    text = sandman_cmd("snapshots").stdout
    assert "kept" in text and "2.9 MiB" in text and "2 snapshots" in text
    gone = sandman_cmd("snapshots", pool, "--delete", "dropped")
    assert gone.returncode == 0 and on_disk(pool) == ["kept"], gone.stderr
    missing = sandman_cmd("snapshots", pool, "--delete", "nonexistent")
    assert missing.returncode != 0 and "no snapshot 'nonexistent'" in missing.stderr
    down = sandman_cmd("shutdown", pool)
    assert down.returncode == 0 and "1 snapshots" in down.stdout, down
    assert on_disk(pool) == []


def test_a_paused_sandbox_goes_with_its_dead_agent(cluster):
    """An agent that dies while one of its sandboxes is paused (frozen processes do
    not die of SIGKILL): its janitor thaws and kills them, and nothing is left."""
    from sandman_ray.providers.nodes import NAMESPACE, agent_name
    pool = make_pool()
    try:
        sb = sandman.acquire(pool=pool, timeout=120)
        sb.spawn("sleep 1000")
        sandman.pause(sb)
        assert leftovers(pool, STATE)["processes"]
        ray.kill(ray.get_actor(agent_name(pool, ray.get(sb.node_id.remote())), namespace=NAMESPACE))
        wait_until(lambda: not leftovers(pool, STATE)["processes"], timeout=60,
                   what="the janitor to remove the paused sandbox's processes")
    finally:
        sandman.shutdown_pool(pool)
