"""Per-task settings bound at lease time (PoolConfig.late_bind): an acquire's env,
workdir and labels given to a warm sandbox as it is lent, and forgotten by its reset.

The pool's decisions run over the fakes of reconciler_fakes.py (a provider whose
sandboxes are entries of a dict: the point is to drive the binding's races directly);
the daemon's ``bind`` and a real LocalProvider pool are exercised for real below."""

import asyncio

import pytest
import ray

import sandman_ray as sandman
from sandman_ray.errors import AcquireTimeout, DaemonError, ProviderError
from sandman_ray.pool.states import State
from sandman_ray.providers.base import SANDBOX_LABEL
from sandman_ray.providers.nodes import agent_name
from sandman_ray.spec import PoolConfig, SandboxSpec
from reconciler_fakes import SPEC, FakeProvider, make, run, settle
from conftest import local_ray, own_pool, wait_until


class BindingProvider(FakeProvider):
    """The fake provider, binding late: ``bound`` records each bind; ``bind_fail``
    holds the errors the next binds raise; ``gate``, when set, holds binds until it is
    set."""

    binds_late = True

    def __init__(self):
        super().__init__()
        self.bound, self.bind_fail, self.gate = [], [], None

    async def bind_task(self, info, env, workdir, labels):
        if self.gate is not None:
            await self.gate.wait()
        if self.bind_fail:
            raise self.bind_fail.pop(0)
        self.bound.append((info.sandbox_id, env, workdir, labels))


def binding_pool(**config):
    pool, provider, _, _ = make(BindingProvider(), **config)
    return pool, provider


def task(n, **more):
    return SandboxSpec(image=SPEC.image, env={"TASK": str(n)}, workdir="/work/%d" % n,
                       labels={"task": str(n)}, **more)


def test_specs_that_differ_only_in_env_workdir_and_labels_share_one_warm_set():
    config = PoolConfig(provider=BindingProvider(), warm={task(1): 2, task(2): 1, SPEC: 1},
                        default_pids=None, default_memory=None, default_disk=None)
    plain = config.limited(SPEC)
    assert config.warm == {plain: 4} and config.slot(task(7)) == plain
    unbound = PoolConfig(provider=BindingProvider(), late_bind=False, default_pids=None,
                         default_memory=None, default_disk=None)
    assert unbound.slot(task(7)) == unbound.limited(task(7)) != plain  # today's keys, asked
    cannot = PoolConfig(provider=FakeProvider(), default_pids=None, default_memory=None,
                        default_disk=None)
    assert cannot.slot(task(7)) == cannot.limited(task(7))  # a provider that cannot
    with pytest.raises(ValueError, match="late_bind must be True or False"):
        PoolConfig(late_bind="yes")


def test_warm_sandboxes_serve_every_task_with_its_own_settings_and_no_create():
    async def main():
        pool, provider = binding_pool(warm={SPEC: 3})
        await settle(pool)
        creates = len(provider.calls)
        leases = [await pool.lending.lease(task(n), "c%d" % n, 5) for n in range(3)]
        assert len(provider.calls) == creates  # all three warm
        assert sorted(provider.bound) == sorted(
            (lease.sandbox_id, {"TASK": str(n)}, "/work/%d" % n, {"task": str(n)})
            for n, lease in enumerate(leases))
        assert pool.status()["stats"]["bound"] == 3
        shown = {s["sandbox_id"]: s["spec"] for s in pool.sandboxes()}
        assert shown[leases[1].sandbox_id]["env"] == {"TASK": "1"}  # the lease's own
        await settle(pool)  # the warm set refilled
        plain = await pool.lending.lease(SPEC, "c9", 5)  # nothing to bind: handed at once
        assert plain.sandbox_id not in {b[0] for b in provider.bound}
    run(main())


def test_a_sandbox_that_cannot_bind_is_reset_and_the_waiter_gets_another():
    async def main():
        pool, provider = binding_pool(warm={SPEC: 2})
        await settle(pool)
        provider.bind_fail.append(ProviderError("daemon gone", "transient"))
        lease = await pool.lending.lease(task(1), "c1", 5)
        [(bound_id, *_)] = provider.bound
        assert lease.sandbox_id == bound_id
        assert pool.state.records.get(lease.sandbox_id).state is State.LEASED
        assert pool.state.records.count(State.LEASED) == 1  # the first went to reset
        await settle(pool)
        assert pool.state.records.count(State.READY) == 2 and provider.resets == 1
    run(main())


def test_a_workdir_the_sandbox_refuses_fails_the_acquire_with_the_reason():
    async def main():
        pool, provider = binding_pool(warm={SPEC: 1})
        await settle(pool)
        provider.bind_fail.append(ProviderError("bind: workdir /proc/x: No such file",
                                                "fatal"))
        with pytest.raises(ProviderError, match="workdir /proc/x"):
            await pool.lending.lease(task(1), "c1", 5)
        await settle(pool)
        assert pool.state.records.count(State.LEASED) == 0
        assert pool.state.records.count(State.READY) == 1  # reset, not lost
    run(main())


def test_an_acquire_given_up_while_its_settings_are_bound_ends_that_lease():
    async def main():
        pool, provider = binding_pool(warm={SPEC: 1})
        await settle(pool)
        provider.gate = asyncio.Event()
        with pytest.raises(AcquireTimeout):
            await pool.lending.lease(task(1), "c1", 0.05)
        assert pool.state.records.count(State.LEASED) == 0  # not left to the grace
        provider.gate.set()
        await settle(pool)
        assert pool.state.records.count(State.READY) == 1 and provider.resets == 1
        # a cancel of a lease being bound: the same
        provider.gate = asyncio.Event()
        waiting = asyncio.ensure_future(pool.lending.lease(task(2), "c2", 5, lease_id="L-x"))
        await asyncio.sleep(0)
        assert pool.lending.cancel("L-x")
        provider.gate.set()
        with pytest.raises(AcquireTimeout, match="cancelled|released|ended"):
            await waiting
        await settle(pool)
        assert pool.state.records.count(State.LEASED) == 0
    run(main())


def test_warm_refills_wait_until_the_leases_being_bound_are_handed_out():
    """A burst's binds and the warm set's refill would share the node's CPU: the refill
    starts once no lease is being bound (a waiter's own create does not wait)."""
    async def main():
        pool, provider = binding_pool(warm={SPEC: 2})
        await settle(pool)
        creates = len(provider.calls)
        provider.gate = asyncio.Event()
        leases = [asyncio.ensure_future(pool.lending.lease(task(n), "c%d" % n, 5))
                  for n in range(3)]
        await settle(pool)
        assert len(provider.calls) == creates + 1  # the third waiter's create alone
        provider.gate.set()
        await asyncio.gather(*leases)
        await settle(pool)
        assert len(provider.calls) == creates + 3  # the warm set refilled
        assert pool.state.records.count(State.READY) == 2
    run(main())


def test_a_retried_acquire_waits_for_the_binding_of_its_lease():
    async def main():
        pool, provider = binding_pool(warm={SPEC: 1})
        await settle(pool)
        provider.gate = asyncio.Event()
        first = asyncio.ensure_future(pool.lending.lease(task(1), "c1", 5, lease_id="L-r",
                                                         keepalive_s=30))
        await asyncio.sleep(0)
        again = asyncio.ensure_future(pool.lending.lease(task(1), "c1", 5, lease_id="L-r",
                                                         keepalive_s=30))
        await asyncio.sleep(0)
        assert not again.done()  # not handed out before its settings hold
        provider.gate.set()
        assert (await first) == (await again) and len(provider.bound) == 1
    run(main())


# ---- the daemon's bind, for real
def test_bind_sets_env_and_workdir_until_the_next_bind_replaces_them(client, tmp_path):
    where = str(tmp_path / "made" / "here")
    assert client.bind({"TASK": "a", "EXTRA": "1"}, where) == {"workdir": where}
    out = client.exec("echo $TASK $EXTRA; pwd")
    assert out.stdout.decode().split() == ["a", "1", where]
    assert client.exec("echo $TASK", env={"TASK": "own"}).stdout == b"own\n"
    pid = client.spawn("echo $TASK > bg.txt")  # background processes see it too
    client.proc_wait(pid, timeout=10)
    assert client.read_file(where + "/bg.txt") == b"a\n"
    client.bind({"TASK": "b"})  # replaces: EXTRA and the workdir are the daemon's own again
    out = client.exec("echo $TASK ${EXTRA:-none}; pwd")
    start = client.info()["workdir"]
    assert out.stdout.decode().split() == ["b", "none", start]
    client.bind()


def test_bind_refuses_a_bad_workdir_naming_it(client):
    with pytest.raises(DaemonError, match="workdir must be an absolute path"):
        client.bind(workdir="relative/dir")
    with pytest.raises(DaemonError, match="/proc/no/such"):
        client.bind(workdir="/proc/no/such")
    with pytest.raises(DaemonError, match="not a valid variable name"):
        client.bind({"A=B": "x"})
    assert client.exec("true").exit_code == 0


# ---- a real pool
@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


def agent_of(pool):
    return ray.get_actor(agent_name(pool, ray.get_runtime_context().get_node_id()),
                         namespace="sandman")


def agent_labels(pool, sandbox_id):
    """The labels the node agent lists the sandbox with."""
    [info] = ray.get(agent_of(pool).list.remote({SANDBOX_LABEL: sandbox_id}))
    return info.labels


def listed_with(pool, sandbox_id, task):
    """The agent lists the sandbox with the lease's label ``task`` (the pool tells it
    after the daemon took the settings, without waiting for it)."""
    return wait_until(lambda: agent_labels(pool, sandbox_id).get("task") == task or None,
                      timeout=30, what="the agent's listing of task %s" % task) and task


def test_each_episode_sees_exactly_its_own_settings_from_a_warm_sandbox(cluster,
                                                                       busybox_image):
    """A LocalProvider pool of one warm sandbox: episodes whose specs each set their own
    env, workdir and labels all run in it, one after another (no create after the
    first), and none sees the one before's variable, directory, files or label."""
    image = busybox_image
    with own_pool("/tmp/sandman-ray-test/late-bind", "late", warm={image: 1},
                  max_sandboxes=1) as pool:
        episodes(pool, image)


def episodes(pool, image):
    """Three episodes of their own settings in the one warm sandbox, then one of none."""
    actor = sandman.get_pool(pool)
    wait_until(lambda: ray.get(actor.status.remote())["states"]["ready"] == 1,
               timeout=60, what="the warm sandbox")
    creates = ray.get(actor.status.remote())["stats"]["creates"]
    seen = []
    for n in range(3):
        spec = SandboxSpec(image=image, env={"TASK": "t%d" % n},
                           workdir="/work/t%d" % n, labels={"task": "t%d" % n})
        with sandman.sandbox(spec, pool=pool, timeout=60) as sb:
            out = sb.exec("echo $TASK; pwd; ls /work; ls").stdout.decode().split()
            sb.exec("echo left > mine.txt")
            seen.append((out, listed_with(pool, sb.sandbox, "t%d" % n)))
    assert seen == [(["t%d" % n, "/work/t%d" % n, "t%d" % n], "t%d" % n)
                    for n in range(3)]
    status = ray.get(actor.status.remote())
    assert status["stats"]["creates"] == creates and status["stats"]["bound"] == 3
    wait_until(lambda: ray.get(actor.status.remote())["states"]["ready"] == 1,
               timeout=60, what="the sandbox back after its last reset")
    [sandbox_id] = [s["sandbox_id"] for s in ray.get(actor.list_sandboxes.remote())]
    labels = agent_labels(pool, sandbox_id)
    assert "task" not in labels and labels[SANDBOX_LABEL] == sandbox_id
    # a word of a lease's settings that comes after its sandbox's reset is not taken
    ray.get(agent_of(pool).note_task.remote(sandbox_id, "a-token-gone", {"A": "1"}, None,
                                            {"task": "late"}))
    assert "task" not in agent_labels(pool, sandbox_id)
    with sandman.sandbox(image, pool=pool, timeout=60) as sb:  # no settings: its own
        out = sb.exec("echo ${TASK:-none}; pwd; ls /work 2>&1 || true").stdout.decode()
        assert out.split()[:2] == ["none", "/"] and "t2" not in out


def test_a_workdir_the_image_lacks_is_made_at_a_sandbox_s_start(cluster, busybox_image):
    """With today's keys (late_bind=False) the workdir is the launch's: the daemon makes
    it as it starts, as a container's WORKDIR is made, instead of failing every create."""
    spec = SandboxSpec(image=busybox_image, env={"TASK": "x"}, workdir="/made/at/start")
    with own_pool("/tmp/sandman-ray-test/late-bind", "early", late_bind=False) as pool:
        with sandman.sandbox(spec, pool=pool, timeout=60) as sb:
            assert sb.exec("echo $TASK; pwd").stdout == b"x\n/made/at/start\n"
        status = ray.get(sandman.get_pool(pool).status.remote())
        assert status["stats"]["bound"] == 0 and status["stats"]["create_failures"] == 0
