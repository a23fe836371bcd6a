"""The service's operations past acquire and exec, with a real ``sandman serve`` and
clients without Ray: the asyncio client, pause and resume, snapshots and forks that
only their tenant can see or start, batched keepalives, and each tenant in the pool's
status and ``sandman status``."""

import asyncio
import json
import subprocess
import sys
import time

import pytest

from sandman_ray.errors import LeaseNotHeld, ProviderError
from sandman_ray.remote import connect
from test_service import http_call, pool_leases, serving
from conftest import wait_until


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("service-ops")) as running:
        yield running


def test_the_asyncio_client_does_what_the_blocking_one_does(service):
    pool = connect(service["url"], service["alice"])

    async def episode():
        async with pool.sandbox_async("builtin:debian", timeout=60) as sb:
            # many calls in flight on one connection
            answers = await asyncio.gather(*(sb.exec_async("echo %d" % i) for i in range(20)))
            assert [a.stdout for a in answers] == [b"%d\n" % i for i in range(20)]
            await sb.write_file_async("/tmp/f", b"x" * 300000)
            assert await sb.read_file_async("/tmp/f") == b"x" * 300000
            assert (await sb.run_async("cd /tmp && export MARK=1")).exit_code == 0
            assert (await sb.run_async("pwd; echo $MARK")).stdout == b"/tmp\n1\n"
            streamed = [item async for item in sb.exec_stream_async("seq 3")]
            assert b"".join(i[1] for i in streamed if i[0] == "stdout") == b"1\n2\n3\n"
            assert sb.exec("echo blocking too").stdout == b"blocking too\n"
            return sb.lease_id
    lease_id = asyncio.run(episode())
    assert lease_id not in [lease["lease_id"] for lease in pool.leases()]
    with pool.sandbox("builtin:debian") as sb, \
            pytest.raises(AttributeError, match="no operation 'no_such_op_async'"):
        sb.no_such_op_async  # noqa: B018 - what it is asked for is the test


def test_a_paused_lease_answers_only_after_resume(service):
    pool = connect(service["url"], service["alice"])

    async def paused():
        async with pool.sandbox_async("builtin:debian", timeout=60) as sb:
            await sb.pause_async()
            call = asyncio.ensure_future(sb.exec_async("echo after"))
            done, _ = await asyncio.wait([call], timeout=1.5)
            assert not done  # its daemon is frozen with the rest of the sandbox
            await sb.resume_async()
            assert (await asyncio.wait_for(call, 30)).stdout == b"after\n"
    asyncio.run(paused())
    with pool.sandbox("builtin:debian") as sb:
        sb.pause(reclaim=False)
        sb.resume()
        assert sb.exec("true").exit_code == 0


def test_snapshots_and_forks_are_their_tenants_alone(service):
    alice, bob = connect(service["url"], service["alice"]), connect(service["url"], service["bob"])
    with alice.sandbox("builtin:debian") as sb:
        sb.exec(["sh", "-c", "mkdir -p /work && echo prepared > /work/state"])
        sb.run("cd /work && export TASK=7")
        image = alice.snapshot(sb, "task-7")
        forks = alice.fork(sb, 2)
    try:
        assert [f.run("pwd; echo $TASK; cat state").stdout for f in forks] == \
            [b"/work\n7\nprepared\n"] * 2
    finally:
        for f in forks:
            f.release()
    wait_until(lambda: len(alice.snapshots()) == 1, timeout=30,
               what="the fork's snapshot to go with its last sandbox")
    [listed] = alice.snapshots()
    assert listed["name"] == "task-7" and listed["image"] == image
    assert bob.snapshots() == []
    with pytest.raises(ProviderError, match="no such snapshot"):
        bob.acquire(image, timeout=30)  # as one that never existed
    with pytest.raises(LeaseNotHeld):
        bob.delete_snapshot("task-7")
    with alice.sandbox(image) as again:
        assert again.exec("cat /work/state").stdout == b"prepared\n"
    alice.delete_snapshot(image)
    assert alice.snapshots() == []


def test_one_keepalive_keeps_many_and_names_what_is_not_the_tenants(service):
    alice, bob = connect(service["url"], service["alice"]), connect(service["url"], service["bob"])
    mine = [alice.acquire("builtin:debian") for _ in range(2)]
    theirs = bob.acquire("builtin:debian")
    try:
        ids = [sb.lease_id for sb in mine] + [theirs.lease_id, "L-nothing"]
        status, _, body = http_call(service, "POST", "/v1/keepalive", {"leases": ids},
                                    key=service["alice"])
        assert status == 200
        assert json.loads(body) == {"kept": 2, "ended": [theirs.lease_id, "L-nothing"]}
        status, _, body = http_call(service, "POST", "/v1/keepalive",
                                    {"leases": ["x"] * 1001}, key=service["alice"])
        assert status == 400 and json.loads(body)["error"]["type"] == "ValidationError"
    finally:
        for sb in mine + [theirs]:
            sb.release()


def test_each_tenant_is_shown_in_the_pools_status(service):
    import ray
    alice, bob = connect(service["url"], service["alice"]), connect(service["url"], service["bob"])
    with alice.sandbox("builtin:debian"), alice.sandbox("builtin:debian"), \
            bob.sandbox("builtin:debian"):
        shown = subprocess.run(
            [sys.executable, "-m", "sandman_ray.cli", "--address",
             ray.get_runtime_context().gcs_address, "status", service["pool"]],
            capture_output=True, text=True, check=True).stdout
        rows = {line.split()[0]: line.split()[1] for line in shown.splitlines()
                if line.startswith("svc:")}
        assert rows == {"svc:alice": "2", "svc:bob": "1"}, shown
    wait_until(lambda: pool_leases(service) == 0, timeout=10, what="the leases to end")


def test_a_restarted_pool_keeps_the_service_s_leases_alive_and_served(service):
    """The PoolActor killed (Ray restarts it) under two leases of alice's: both are
    recovered as the service's, still served over the data plane, kept alive by the
    client past their keepalive, and released as usual; one that the client stops
    keeping is still reclaimed after its keepalive."""
    import ray
    import sandman_ray as sandman
    alice = connect(service["url"], service["alice"], keepalive_s=5)
    held = [alice.acquire("builtin:debian") for _ in range(2)]
    for sb in held:
        sb.write_file("/tmp/mark", sb.lease_id)
    actor = sandman.get_pool(service["pool"])
    before = ray.get(actor.status.remote())["pid"]
    ray.kill(actor, no_restart=False)

    def back():
        try:
            status = ray.get(actor.status.remote(), timeout=5)
        except (ray.exceptions.RayError, sandman.SandmanError):
            return False
        return status["pid"] != before and status["states"].get("leased", 0) == 2
    wait_until(back, timeout=60, what="the pool back, with both leases")
    for sb in held:
        assert sb.read_file("/tmp/mark") == sb.lease_id.encode()
    wait_until(lambda: pool_leases(service) == 2, timeout=1, what="both leases")
    # past their keepalive: the client's thread keeps them, also in the new pool
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert sorted(lease["lease_id"] for lease in alice.leases()) == \
            sorted(sb.lease_id for sb in held)
        time.sleep(1)
    kept, dropped = held
    with alice.lock:  # this client stops keeping one of them
        alice.held.discard(dropped.lease_id)
    wait_until(lambda: [lease["lease_id"] for lease in alice.leases()] == [kept.lease_id],
               timeout=5 + 0.2 + 10, what="the lease no one keeps to be reclaimed")
    kept.release()
    wait_until(lambda: pool_leases(service) == 0, timeout=10, what="the lease to end")


def test_tenants_share_a_contended_cpu_by_their_weights_not_their_sandboxes(service):
    """alice runs a busy command in each of four sandboxes, bob in one, all on one
    CPU: each tenant's sandboxes together weigh its weight (pool/shares.py), so bob's
    one gets about as much CPU as alice's four together, not a fifth of it."""
    alice, bob = connect(service["url"], service["alice"]), connect(service["url"], service["bob"])
    busy = "taskset -c 0 sh -c 'while :; do :; done'"
    ticks = "awk '{s += $14 + $15} END {print s}' /proc/[0-9]*/stat"
    hers = [alice.acquire("builtin:debian") for _ in range(4)]
    his = bob.acquire("builtin:debian")
    try:
        for sb in hers + [his]:
            sb.spawn(["sh", "-c", busy])
        wait_until(lambda: [cpu_weight(sb.sandbox_id) for sb in hers + [his]] ==
                   [0.25] * 4 + [1.0], timeout=10, what="the pool to weigh the leases")
        before = [int(sb.exec(["sh", "-c", ticks]).stdout) for sb in hers + [his]]
        time.sleep(3)  # the window the CPU is measured over
        after = [int(sb.exec(["sh", "-c", ticks]).stdout) for sb in hers + [his]]
    finally:
        for sb in hers + [his]:
            sb.release()
    used = [a - b for a, b in zip(after, before)]
    assert used[4] >= 0.6 * sum(used[:4]), used


def cpu_weight(sandbox_id: str) -> float:
    """The weight the sandbox's cpu group has on this node (1.0: a group's default)."""
    import glob
    for path in glob.glob("/sys/fs/cgroup/cpu/sandman/*/%s/cpu.shares" % sandbox_id):
        return int(open(path).read()) / 1024
    for path in glob.glob("/sys/fs/cgroup/sandman/*/%s/cpu.weight" % sandbox_id):
        return int(open(path).read()) / 100
    return float("nan")
