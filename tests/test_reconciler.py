"""The pool's reconciler on its own: no Ray, over the fakes of reconciler_fakes.py (a
provider, a clock, a cluster: which hosts and nodes are alive, the lease store). They
are fakes because the point is to drive the decisions directly and fast; the real ones
are exercised by test_pool.py and the chaos suite."""

import asyncio
import dataclasses
import subprocess
import sys

import pytest

from sandman_ray.errors import AcquireTimeout, LeaseNotHeld, ProviderError
from sandman_ray.pool.reconciler import Reconciler
from sandman_ray.pool.supply import SURPLUS_LINGER_S
from sandman_ray.pool.states import State
from sandman_ray.providers.base import POOL_LABEL, SandboxInfo
from sandman_ray.spec import SandboxSpec
from reconciler_fakes import NODE, OTHER, SPEC, NoMetrics, make, run, settle


def test_the_reconciler_needs_no_ray():
    code = "import sys, sandman_ray.pool.reconciler; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_warm_sandboxes_are_created_and_lent_at_once():
    async def main():
        pool, provider, clock, _ = make(warm={SPEC: 3})
        await settle(pool)
        assert pool.state.records.count(State.READY) == 3
        lease = await pool.lending.lease(SPEC, "c1", 5)
        assert pool.state.records.get(lease.sandbox_id).state is State.LEASED
        await settle(pool)  # the warm set is refilled
        assert pool.state.records.count(State.READY) == 3 and len(provider.sandboxes) == 4
    run(main())


def test_a_waiter_is_served_by_the_create_it_caused_without_a_tick():
    async def main():
        pool, provider, _, _ = make()
        task = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5))
        await asyncio.sleep(0)
        pool.tick()  # one tick starts the create; its completion lends the sandbox
        lease = await asyncio.wait_for(task, 1)
        assert lease.sandbox_id in provider.sandboxes
        assert [e[2] for e in pool.state.events if e[1] == lease.sandbox_id] == \
            ["requested", "creating", "started", "ready", "leased"]
    run(main())


def test_a_delete_waits_for_one_already_under_way():
    """A delete begun elsewhere (its task not run yet) and a second delete of the same
    sandbox: the second returns only once the provider has deleted it, so what comes
    after (deleting a snapshot the sandbox ran from) does not find it still there."""
    async def main():
        pool, provider, _, _ = make(warm={SPEC: 1})
        await settle(pool)
        [rec] = list(pool.state.records.values())
        pool.supply.delete_soon(rec, "surplus")  # its provider call has not started
        await pool.supply.delete(rec, "its snapshot is deleted")
        return rec.sandbox_id, provider.sandboxes, rec.state
    sandbox_id, left, state = run(main())
    assert sandbox_id not in left and state is State.GONE


def test_release_resets_or_deletes_by_the_pool_s_reuse():
    async def main(reuse):
        pool, provider, _, _ = make(reuse=reuse)
        task = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5))
        await settle(pool)
        lease = await task
        assert pool.lending.release(lease.lease_id)
        assert pool.state.records.get(lease.sandbox_id).state is State.RELEASING
        assert not pool.lending.release(lease.lease_id)  # a lease ends once
        await settle(pool)
        return pool, provider, lease
    pool, provider, lease = run(main("reset"))
    assert provider.resets == 1 and pool.state.records.get(lease.sandbox_id).state is State.READY
    pool, provider, lease = run(main("delete"))
    assert provider.resets == 0 and lease.sandbox_id not in provider.sandboxes
    assert lease.sandbox_id not in pool.state.records


def test_ttl_idle_and_grace_reclaim_by_the_clock():
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 3}, lease_grace_s=30, idle_timeout_s=60)
        await settle(pool)
        cluster.hosts = {"h1", "h2"}
        task = asyncio.ensure_future(
            pool.lending.lease(SandboxSpec(image="host", ttl_s=20), "c1", 5))
        await settle(pool)  # a spec of its own: created for it
        ttl = await task
        idle = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        unheld = await pool.lending.lease(SPEC, "c2", 5)
        pool.lending.register(ttl.lease_id, "h2")
        clock.now += 25  # past the TTL only
        await pool.upkeep.sweep()
        assert pool.state.records.leased(ttl.lease_id) is None
        assert pool.state.ended[ttl.lease_id].startswith("reclaimed: the lease outlived its TTL")
        assert ("h2", ttl.lease_id) in [t[:2] for t in cluster.told]
        records = pool.state.records
        assert records.leased(idle.lease_id) and records.leased(unheld.lease_id)
        clock.now += 10  # past the grace: no host registered the third lease
        await pool.upkeep.sweep()
        assert "no host within 30 s" in pool.state.ended[unheld.lease_id]
        assert pool.lending.touch(idle.lease_id, "h1")
        clock.now += 50
        await pool.upkeep.sweep()
        assert pool.state.records.leased(idle.lease_id)  # touched 50 s ago: not idle yet
        clock.now += 11
        await pool.upkeep.sweep()
        assert "idle for 60 s" in pool.state.ended[idle.lease_id]
    run(main())


def test_a_round_of_touches_restarts_the_idle_clock_of_the_leases_their_holders_hold():
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 2}, idle_timeout_s=60)
        await settle(pool)
        cluster.hosts = {"h1"}
        used = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        other = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        clock.now += 50
        # a round names a lease another holder holds and one long over: passed over
        assert pool.lending.touch_many([(used.lease_id, "h1"), (other.lease_id, "h2"),
                                ("L-over", "h1")]) == 1
        clock.now += 11
        await pool.upkeep.sweep()
        assert pool.state.records.leased(used.lease_id)
        assert "idle for 60 s" in pool.state.ended[other.lease_id]
    run(main())


def test_an_idle_sandbox_that_died_is_replaced_and_a_stray_deleted():
    """The inventory check: a READY sandbox the provider reports dead is never lent, it
    is deleted and the warm target makes another; one no record knows is deleted; a
    dead leased one is its holder's to find (SandboxLost) and stays until released."""
    async def main():
        pool, provider, _, cluster = make(warm={SPEC: 2})
        await settle(pool)
        cluster.hosts = {"h1"}
        lease = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        await settle(pool)
        idle = [r.sandbox_id for r in pool.state.records.walk(State.READY)]
        dead = idle[0]
        provider.sandboxes[dead] = dataclasses.replace(provider.sandboxes[dead], alive=False)
        provider.sandboxes[lease.sandbox_id] = dataclasses.replace(
            provider.sandboxes[lease.sandbox_id], alive=False)
        provider.sandboxes["sbx-stray"] = provider._info("sbx-stray", SPEC, {POOL_LABEL: "p"},
                                                         NODE)
        await pool.upkeep.check_inventory()
        await settle(pool)
        ready = [r.sandbox_id for r in pool.state.records.walk(State.READY)]
        return dead, ready, lease, pool, provider

    dead, ready, lease, pool, provider = run(main())
    assert dead not in ready and dead not in provider.sandboxes and len(ready) == 2
    assert "sbx-stray" not in provider.sandboxes
    assert pool.state.records.leased(lease.lease_id) is not None
    assert pool.state.stats["lost"] == 1


def test_a_lease_whose_host_died_is_reclaimed():
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 1})
        await settle(pool)
        cluster.hosts = {"h1"}
        lease = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        clock.now += 1  # a sweep trusts only host lists taken after the registration
        await pool.upkeep.sweep()
        assert pool.state.records.leased(lease.lease_id)
        cluster.hosts = set()
        await pool.upkeep.sweep()
        assert "host h1 is gone" in pool.state.ended[lease.lease_id]
    run(main())


def test_a_host_registers_leases_it_can_reach_at_once_and_only_it_may_end_them():
    async def main():
        pool, provider, _, cluster = make(warm={SPEC: 2})
        await settle(pool)
        here = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        with pytest.raises(LeaseNotHeld):
            pool.lending.release(here.lease_id, "h2")
        with pytest.raises(LeaseNotHeld):
            pool.lending.register(here.lease_id, "h2")
        there = await pool.lending.lease(SPEC, "c1", 5, holder="h3", holder_node=OTHER)
        rec = pool.state.records.leased(there.lease_id)
        assert rec.holder is None and not rec.registered_at  # a unix socket on another node
        assert pool.lending.register(there.lease_id, "h4")  # the host of the sandbox's node
        # the host that can reach its sandbox is handed the lease to connect, right
        # after the answer
        await asyncio.sleep(0)
        assert cluster.offered == [("h1", here.lease_id)]
        assert pool.lending.release(here.lease_id, "h1")
        assert pool.lending.release(there.lease_id, "h4")
    run(main())


def test_a_lease_held_by_a_host_not_yet_seen_waits_for_the_grace():
    """A client asks the pool itself while its host starts: until the host is seen
    alive, its lease is reclaimed only after the grace; once seen, as soon as it is
    gone."""
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 2}, lease_grace_s=30)
        await settle(pool)
        starting = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        clock.now += 1
        await pool.upkeep.sweep()
        assert pool.state.records.leased(starting.lease_id)  # h1 not listed yet: it may be starting
        cluster.hosts = {"h1"}
        await pool.upkeep.sweep()
        cluster.hosts = set()
        await pool.upkeep.sweep()
        assert "host h1 is gone" in pool.state.ended[starting.lease_id]
        never = await pool.lending.lease(SPEC, "c2", 5, holder="h2", holder_node=NODE)
        clock.now += 29
        await pool.upkeep.sweep()
        assert pool.state.records.leased(never.lease_id)
        clock.now += 2
        await pool.upkeep.sweep()
        assert "no host within 30 s" in pool.state.ended[never.lease_id]
    run(main())


def test_every_lease_of_a_host_once_seen_ends_when_it_dies_however_new():
    """A host seen alive by one sweep takes another lease and dies before the next: that
    sweep ends both leases, not only the one it saw the host hold (the newer one does not
    wait out the grace)."""
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 3}, lease_grace_s=30)
        await settle(pool)
        cluster.hosts = {"h1"}
        first = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        clock.now += 1
        await pool.upkeep.sweep()
        newer = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        clock.now += 1
        cluster.hosts = set()
        await pool.upkeep.sweep()
        assert "host h1 is gone" in pool.state.ended[first.lease_id]
        assert "host h1 is gone" in pool.state.ended[newer.lease_id]
        assert pool.upkeep.hosts_seen == set()  # forgotten with its last lease
    run(main())


def test_a_host_that_answered_an_offer_counts_as_seen():
    """A client's host takes the offers of a burst of acquires and dies before any sweep
    listed it alive: the pool delivered them, so the next sweep ends them all."""
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 3}, lease_grace_s=30)
        await settle(pool)
        leases = [await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
                  for _ in range(3)]
        assert [h for h, _ in cluster.offered] == ["h1"] * 3
        cluster.answered = {"h1"}  # its take() answered; it never showed in a host list
        clock.now += 1
        await pool.upkeep.sweep()
        for lease in leases:
            assert "host h1 is gone" in pool.state.ended[lease.lease_id]
    run(main())


def test_a_request_is_cancelled_by_its_lease_id_before_and_after_it_is_served():
    async def main():
        pool, _, _, _ = make(max_starting=1, create_rate_per_s=0.01, create_burst=1)
        first = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5, lease_id="L-1"))
        second = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5, lease_id="L-2"))
        await settle(pool)
        assert (await first).lease_id == "L-1"
        assert pool.lending.cancel("L-2") and len(pool.state.waiters) == 0
        with pytest.raises(AcquireTimeout, match="cancelled"):
            await second
        assert pool.lending.cancel("L-1")  # served: the lease ends
        assert pool.state.records.leased("L-1") is None
        with pytest.raises(AcquireTimeout, match="L-1"):  # an id is used once
            await pool.lending.lease(SPEC, "c1", 5, lease_id="L-1")
        # a cancel that overtakes its request: the request, when it comes, is refused
        assert not pool.lending.cancel("L-3")
        with pytest.raises(AcquireTimeout, match="cancelled"):
            await pool.lending.lease(SPEC, "c1", 5, lease_id="L-3")
        assert pool.state.records.count(State.LEASED) == 0
    run(main())


def test_surplus_is_deleted_only_after_it_lingered():
    async def main():
        pool, provider, clock, _ = make(warm={SPEC: 3})
        await settle(pool)
        pool.config.warm = {pool.config.limited(SPEC): 1}
        await settle(pool)
        assert pool.state.records.count(State.READY) == 3
        clock.now += SURPLUS_LINGER_S + 1
        await settle(pool)
        assert pool.state.records.count(State.READY) == 1 and len(provider.sandboxes) == 1
    run(main())


def test_lowering_a_warm_target_deletes_the_surplus_at_once_not_the_leases():
    async def main():
        pool, provider, clock, cluster = make(warm={SPEC: 3})
        await settle(pool)
        lease = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        await settle(pool)  # refilled: 3 ready, 1 leased
        before = pool.state.records.count(State.READY)
        pool.snapshot_ops.set_warm(SPEC, 1)
        await settle(pool)
        after = pool.state.records.count(State.READY)
        pool.snapshot_ops.set_warm(SPEC, 0)
        await settle(pool)
        return before, after, pool.state.records.count(State.READY), pool, lease

    before, after, last, pool, lease = run(main())
    assert (before, after, last) == (3, 1, 0)  # no lingering: asked for
    assert pool.state.records.leased(lease.lease_id) is not None


def test_a_waiter_held_back_by_max_sandboxes_gets_room_from_an_unwanted_idle_one():
    """At max_sandboxes, a READY sandbox of another spec that nothing wants (lingering
    for its kind's next acquire) is deleted at once for a waiter, not after lingering;
    a warm one, which its target wants, is not."""
    other = SandboxSpec(image="host", ttl_s=60)
    async def main():
        pool, provider, clock, cluster = make(max_sandboxes=2, warm={SPEC: 1})
        await settle(pool)
        asked = asyncio.ensure_future(pool.lending.lease(other, "c1", 5))
        await settle(pool)  # created for it
        lease = await asked
        pool.lending.release(lease.lease_id)
        await settle(pool)  # reset: a READY ``other`` no one wants, lingering
        assert pool.state.records.count(State.READY) == 2
        task = asyncio.ensure_future(pool.lending.lease(SandboxSpec(image="dir:/busybox"), "c2", 5))
        await settle(pool, ticks=6)
        got = await task
        return got, pool, provider

    got, pool, provider = run(main())
    specs = [r.spec for r in pool.state.records.values() if r.state is not State.GONE]
    limited = pool.config.limited  # the specs as the pool keeps them (its default nofile)
    assert got.sandbox_id in provider.sandboxes
    assert limited(SPEC) in specs and limited(other) not in specs


def test_a_fatal_create_fails_the_waiters_at_once_and_transient_ones_are_retried():
    async def main():
        pool, provider, _, _ = make()
        provider.fail = [ProviderError("no such image", "fatal")]
        task = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5))
        await settle(pool)
        with pytest.raises(ProviderError, match="no such image"):
            await task
        assert len(pool.state.waiters) == 0 and pool.state.stats["create_failures"] == 1
        provider.fail = [ProviderError("429", "throttled"), ProviderError("503", "transient")]
        rate = pool.supply.bucket.rate
        task = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5))
        await settle(pool, ticks=6)
        assert (await asyncio.wait_for(task, 1)).sandbox_id in provider.sandboxes
        assert pool.state.stats["throttled"] == 1 and pool.supply.bucket.rate < rate
    run(main())


def test_a_client_at_its_quota_waits_and_asks_for_no_create():
    async def main():
        pool, provider, _, _ = make(client_quota=1, warm={SPEC: 1})
        await settle(pool)
        held = await pool.lending.lease(SPEC, "greedy", 5)
        more = asyncio.ensure_future(pool.lending.lease(SPEC, "greedy", 5))
        await settle(pool)
        assert not more.done() and pool.state.wanted()[pool.config.limited(SPEC)] == 1
        other = await pool.lending.lease(SPEC, "modest", 5)  # the warm one, not the greedy waiter's
        assert other.sandbox_id != held.sandbox_id and not more.done()
        pool.lending.release(held.lease_id)
        await settle(pool)
        assert (await asyncio.wait_for(more, 1)).sandbox_id
    run(main())


def test_sandboxes_of_a_dead_node_are_forgotten_and_their_warm_capacity_made_again():
    async def main():
        pool, provider, _, cluster = make(warm={SPEC: 2})
        await settle(pool)
        lease = await pool.lending.lease(SPEC, "c1", 5, holder="h1", holder_node=NODE)
        provider.default_node = OTHER
        cluster.nodes = {OTHER}
        await pool.upkeep.drop_dead_nodes()
        assert "lost: Ray node" in pool.state.ended[lease.lease_id]
        await settle(pool)
        assert {r.info.node_id for r in pool.state.records.values()} == {OTHER}
        assert pool.state.records.count(State.READY) == 2
    run(main())


def test_a_restarted_pool_adopts_its_sandboxes_with_their_whole_spec():
    async def main():
        old, provider, clock, cluster = make()
        spec = SandboxSpec(image="host", cpu=0.5, memory="64Mi", env={"K": "v"}, ttl_s=99,
                           labels={"team": "rl"})
        task = asyncio.ensure_future(
            old.lending.lease(spec, "c1", 5, holder="h1", holder_node=NODE))
        task2 = asyncio.ensure_future(old.lending.lease(SPEC, "c2", 5))
        await settle(old)
        kept, free = await task, await task2
        old.lending.release(free.lease_id)
        await settle(old)
        gone = provider._info("sbx-dead", spec, {POOL_LABEL: "p"}, NODE)
        provider.sandboxes["sbx-dead"] = SandboxInfo(**dict(gone.__dict__, alive=False))
        provider.sandboxes["sbx-nospec"] = provider._info("sbx-nospec", None, {POOL_LABEL: "p"},
                                                          NODE)
        cluster.hosts = {"h1", "h2"}
        cluster.held = {"h1": [kept], "h2": [free]}  # h2 kept a lease that ended
        wanting = dataclasses.replace(old.config, warm={SPEC: 1})  # the free one is wanted
        new = Reconciler("p", wanting, provider, cluster, clock, NoMetrics())
        await new.upkeep.recover()
        rec = new.state.records.leased(kept.lease_id)
        assert rec.spec == old.config.limited(spec) and rec.spec.env == {"K": "v"}
        assert rec.holder == "h1" and "sbx-dead" not in provider.sandboxes
        assert "sbx-nospec" not in provider.sandboxes
        # one that no live host holds (or holds with a token it no longer takes) may
        # have served a lease no host took yet: afresh first
        assert new.state.records.get(free.sandbox_id).state is State.RELEASING
        resets = provider.resets
        await settle(new)
        assert new.state.records.get(free.sandbox_id).state is State.READY
        assert provider.resets == resets + 1
        with pytest.raises(LeaseNotHeld):
            new.lending.release(kept.lease_id, "intruder")
    run(main())


def test_twenty_thousand_records_cost_a_tick_only_what_changed():
    """An idle tick over 30,000 records examines none of them; one release costs a
    tick the released record and the oldest one its spec has spare. (Counted, not
    timed.)"""
    async def main():
        n = 20000
        pool, provider, clock, _ = make(warm={SPEC: n}, max_sandboxes=2 * n, max_starting=n,
                                        create_rate_per_s=1e9, create_burst=n)
        await settle(pool, ticks=2)
        assert pool.state.records.count(State.READY) == n
        leases = [await pool.lending.lease(SPEC, "c%d" % (i % 7), 5) for i in range(n // 2)]
        clock.now += 1  # the token bucket refills
        await settle(pool)  # the warm set refills: 30,000 records
        assert len(pool.state.records) == n + n // 2
        pool.state.records.visited = 0
        for _ in range(10):
            pool.tick()
        assert pool.state.records.visited == 0 and len(provider.calls) == n + n // 2
        pool.lending.release(leases[0].lease_id)
        pool.tick()
        assert pool.state.records.visited <= 2  # the released one, and the oldest surplus one
        await settle(pool)
        clock.now += SURPLUS_LINGER_S + 1  # the reset one is surplus now
        pool.state.records.visited = 0
        pool.tick()
        assert pool.state.records.visited <= 2
    run(main())


def test_the_status_says_what_the_loop_s_ticks_and_sweeps_take():
    async def main():
        pool, _, _, _ = make(warm={SPEC: 2})
        assert pool.status()["loop_ms"] == {}
        loop = asyncio.ensure_future(pool.run())
        while pool.state.records.count(State.READY) < 2:
            await asyncio.sleep(0)
        loop.cancel()
        times = pool.status()["loop_ms"]
        assert times["tick"]["n"] >= 1 and times["sweep"]["n"] >= 1
        for step in times.values():
            assert 0 <= step["p50_ms"] <= step["p99_ms"] <= step["max_ms"] < 1e4
    run(main())


def test_a_lease_goes_to_a_sandbox_on_the_callers_node_first():
    """Ready on both nodes: each caller gets the one on its own node, older ones
    elsewhere notwithstanding; with none on its node, one elsewhere at once rather than
    a wait; with none ready, a create on its node."""
    async def main():
        pool, provider, _, _ = make(warm={SPEC: 1})
        await settle(pool)
        provider.default_node = OTHER
        pool.config.warm[pool.config.limited(SPEC)] = 2
        await settle(pool)
        nodes = lambda: sorted(r.node for r in pool.state.records.walk(State.READY))
        assert nodes() == [NODE, OTHER]
        there = await pool.lending.lease(SPEC, "c1", 5, holder="h2", holder_node=OTHER)
        assert there.node_id == OTHER  # the older one on NODE stays
        pool.config.warm[pool.config.limited(SPEC)] = 0
        await settle(pool)
        elsewhere = await pool.lending.lease(SPEC, "c1", 5, holder="h2", holder_node=OTHER)
        assert elsewhere.node_id == NODE  # none on OTHER was ready: no wait for one
        provider.default_node = NODE
        made = asyncio.ensure_future(
            pool.lending.lease(SPEC, "c1", 5, holder="h2", holder_node=OTHER))
        await settle(pool)
        assert (await made).node_id == OTHER  # created where its caller is
        anywhere = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5, holder="h2",
                                                    holder_node=OTHER, node="anywhere"))
        await settle(pool)
        assert (await anywhere).node_id == NODE  # where the provider puts it
    run(main())


def test_a_lease_asked_on_a_node_is_served_there_only():
    """``node=<id>``: a sandbox ready elsewhere does not serve it; one is created on
    that node even when the pool's supply would otherwise do; an unknown node is a
    clear error."""
    async def main():
        pool, provider, _, _ = make(warm={SPEC: 1})
        await settle(pool)
        ready_here = next(iter(pool.state.records.walk(State.READY)))
        assert ready_here.node == NODE
        asked = asyncio.ensure_future(pool.lending.lease(SPEC, "c1", 5, holder="h1",
                                                 holder_node=NODE, node=OTHER))
        await settle(pool)
        lease = await asked
        assert lease.node_id == OTHER and ready_here.state is State.READY
        with pytest.raises(ValueError, match="not an alive Ray node"):
            await pool.lending.lease(SPEC, "c1", 5, node="node-z")
    run(main())


def test_the_reasons_of_ended_leases_are_kept_for_a_while_not_for_a_count():
    """A pool that lends lease after lease keeps the reasons of those that ended in the
    last keep_s seconds (a late call, an offer or a retried acquire comes within
    seconds), at most kept of them: what it holds stays level however many end."""
    from sandman_ray.pool.states import EndedLeases
    now = [0.0]
    ended = EndedLeases(kept=1000, keep_s=60.0, clock=lambda: now[0])
    for i in range(100000):  # 100 leases a second for 1,000 s
        ended.note("L-%d" % i, "released by its holder")
        now[0] += 0.01
        if i == 5000:
            assert ended["L-4999"] == "released by its holder"
    assert len(ended) == len(ended.noted) == 1000  # the count's bound: 60 s hold 6,000
    assert "L-99999" in ended and "L-98999" not in ended
    ended = EndedLeases(kept=100000, keep_s=60.0, clock=lambda: now[0])
    for i in range(10000):
        ended.note("L-%d" % i, "reclaimed")
        now[0] += 0.1
    assert 599 <= len(ended) <= 601 and "L-9999" in ended and "L-1000" not in ended
    ended.note("L-9999", "noted again")  # the newest once more: still one entry
    assert list(ended)[-1] == "L-9999" and ended["L-9999"] == "noted again"


def test_a_fork_snapshot_goes_with_the_last_sandbox_started_from_it():
    """A snapshot taken for a fork belongs to the forks: the provider deletes it once
    the last sandbox started from it is gone (Supply.on_gone, which the reconciler
    wires to SnapshotOps), and not while one lives."""
    async def main():
        pool, provider, clock, cluster = make()

        async def leased(spec):
            task = asyncio.ensure_future(pool.lending.lease(spec, "c1", 5))
            await settle(pool)
            return await task
        first = await leased(SPEC)
        taken = await pool.snapshot_ops.snapshot(first.lease_id, None, "fork1", for_fork=True)
        pool.lending.release(first.lease_id)
        fork = SandboxSpec(image=taken["image"])
        copies = [await leased(fork) for _ in range(2)]
        pool.lending.release(copies[0].lease_id)
        await settle(pool)
        assert ("delete_snapshot", "fork1") not in provider.calls  # one copy still lives
        assert "fork1" in pool.state.snapshots
        pool.lending.release(copies[1].lease_id)
        await settle(pool)
        assert ("delete_snapshot", "fork1") in provider.calls
        assert pool.state.snapshots == {} and pool.state.fork_snapshots == set()
    run(main())
