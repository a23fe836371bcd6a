"""Leases kept alive by their caller (``keepalive_s``): the leases the service holds for
clients outside Ray. They last while a call or a keepalive comes at least that often,
whatever their host does; a retry of an acquire with the same id gets the same lease.
Driven over the reconciler's fakes (reconciler_fakes.py)."""

import asyncio

import pytest

from sandman_ray.errors import AcquireTimeout
from sandman_ray.pool.states import Lease, State, pack_lease, unpack_lease
from reconciler_fakes import SPEC, make, run, settle

HOST = "gateway"


def lent(pool):
    return [r for r in pool.state.records.values() if r.state is State.LEASED]


def test_a_kept_lease_outlives_its_host_and_ends_when_no_longer_kept():
    """Kept every 20 s with a keepalive of 30 s, it lasts past the grace and the death
    of its host; left alone, it is reclaimed at the first sweep past 30 s, saying why."""
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 1}, lease_grace_s=10)
        await settle(pool)
        cluster.hosts = {HOST}
        lease = await pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST, lease_id="L-k1",
                                 keepalive_s=30)
        assert lease.keepalive_s == 30
        await pool.upkeep.sweep()
        cluster.hosts = set()  # the gateway restarts
        for _ in range(4):
            clock.now += 20
            assert pool.lending.keep_many([("L-k1", HOST)]) == 1
            await pool.upkeep.sweep()
            assert [r.lease.lease_id for r in lent(pool)] == ["L-k1"]
        clock.now += 29
        await pool.upkeep.sweep()
        assert lent(pool)
        clock.now += 2
        await pool.upkeep.sweep()
        return pool
    pool = run(main())
    assert lent(pool) == []
    assert "no call or keepalive for 30 s" in pool.state.ended["L-k1"]


def test_calls_keep_a_lease_and_its_idleness_while_keepalives_keep_only_the_lease():
    """A call (``touch``) renews both; a keepalive renews the lease alone, so a client
    that only keeps its lease still meets the idle timeout."""
    async def main():
        pool, _, clock, cluster = make(warm={SPEC: 1}, idle_timeout_s=60)
        await settle(pool)
        await pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST, lease_id="L-k2", keepalive_s=30)
        for _ in range(3):
            clock.now += 25
            assert pool.lending.touch("L-k2", HOST)
            await pool.upkeep.sweep()
        assert lent(pool)
        for _ in range(3):
            clock.now += 25
            pool.lending.keep_many([("L-k2", HOST)])
            await pool.upkeep.sweep()
        return pool
    pool = run(main())
    assert lent(pool) == [] and "idle for 60 s" in pool.state.ended["L-k2"]


def test_a_keepalive_for_a_lease_held_by_another_host_or_ended_keeps_nothing():
    async def main():
        pool, _, _, _ = make(warm={SPEC: 1})
        await settle(pool)
        await pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST, lease_id="L-k3", keepalive_s=30)
        return pool.lending.keep_many([("L-k3", "someone-else"), ("L-gone", HOST)])
    assert run(main()) == 0


def test_a_retried_acquire_gets_the_same_lease_never_a_second_sandbox():
    """The same id and client while the first waits, and after it was lent: the same
    lease. Another client's acquire with that id while it waits is refused; an id that
    ended says why."""
    async def main():
        pool, provider, _, _ = make(max_sandboxes=3)
        first = asyncio.ensure_future(pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST,
                                                 lease_id="L-r1", keepalive_s=30))
        await asyncio.sleep(0)
        again = asyncio.ensure_future(pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST,
                                                 lease_id="L-r1", keepalive_s=30))
        with pytest.raises(ValueError, match="taken"):
            await pool.lending.lease(SPEC, "tenant-b", 5, holder="other", lease_id="L-r1",
                             keepalive_s=30)
        await settle(pool)
        a, b = await first, await again
        c = await pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST, lease_id="L-r1",
                                     keepalive_s=30)
        pool.lending.release("L-r1", HOST)
        with pytest.raises(AcquireTimeout, match="released"):
            await pool.lending.lease(SPEC, "tenant-a", 5, holder=HOST, lease_id="L-r1",
                                     keepalive_s=30)
        return a, b, c, provider
    a, b, c, provider = run(main())
    assert a == b == c
    assert [call for call in provider.calls if call[0] == "create"] == [("create", a.sandbox_id)]


@pytest.mark.parametrize("bad", [0, 1, 4.9, 3601, "30", True, float("nan")])
def test_a_keepalive_out_of_bounds_is_refused_naming_it(bad):
    async def main():
        pool, _, _, _ = make(warm={SPEC: 1})
        await pool.lending.lease(SPEC, "c", 5, holder=HOST, keepalive_s=bad)
    with pytest.raises(ValueError, match="keepalive_s must be a number of seconds from 5 to 3600"):
        run(main())


def test_a_lease_carries_its_keepalive_through_packing_and_a_restart_of_the_pool():
    """Packed, it keeps its keepalive (and an older, shorter packing still unpacks); a
    restarted pool adopts a kept lease from its host with a full period."""
    lease = Lease("L-p", "sbx-1", "unix:/run/sbx-1/sock", "t-sbx-1", "node-a", "p", "c",
                  1.7e9 + 900, keepalive_s=45.0)
    assert unpack_lease(pack_lease(lease)) == lease
    from sandman_ray.daemon.sandmand.wire import pack, unpack
    older = pack(unpack(pack_lease(lease))[:-1])
    assert unpack_lease(older).keepalive_s == 0.0

    async def main():
        pool, provider, clock, cluster = make()
        info = await provider.create("sbx-1", SPEC, {"sandman.pool": "p"})
        lease_of = Lease("L-p", "sbx-1", info.address, info.token, info.node_id, "p", "c",
                         clock.time() - 100, keepalive_s=45.0)
        cluster.hosts, cluster.held = {HOST}, {HOST: [lease_of]}
        await pool.upkeep.recover()
        rec = pool.state.records.leased("L-p")
        assert (rec.keepalive_s, rec.kept_at) == (45.0, clock.now)
        clock.now += 44
        cluster.hosts = set()
        await pool.upkeep.sweep()
        assert pool.state.records.leased("L-p") is not None
        clock.now += 2
        await pool.upkeep.sweep()
        return pool
    pool = run(main())
    assert pool.state.records.leased("L-p") is None


def test_clients_are_lent_in_proportion_to_their_weights_and_bank_nothing():
    """Two clients of weights 3 and 1, each with many waiters, one sandbox freed at a
    time: 3 to 1. A client that starts waiting later starts level with the others
    (its waiting for nothing earned it no turns); clients of no weight take turns."""
    from sandman_ray.pool.waiters import FairQueue, Waiter
    queue = FairQueue()
    for i in range(40):
        for client, weight in (("heavy", 3.0), ("light", 1.0)):
            queue.push(Waiter(client, SPEC, None, "%s-%d" % (client, i), 0.0, weight=weight))
    served = [queue.next_for(SPEC, lambda client: True).client for _ in range(40)]
    assert served.count("heavy") == 30 and served.count("light") == 10
    assert all(served[i:i + 4].count("light") == 1 for i in range(0, 40, 4))
    for i in range(10):
        queue.push(Waiter("late", SPEC, None, "late-%d" % i, 0.0))
    nxt = [queue.next_for(SPEC, lambda client: True).client for _ in range(10)]
    assert 2 <= nxt.count("late") <= 4, nxt  # its share (1 of 5), not a run of catch-up
    even = FairQueue()
    for i in range(5):
        for client in ("a", "b", "c"):
            even.push(Waiter(client, SPEC, None, "%s-%d" % (client, i), 0.0))
    assert [even.next_for(SPEC, lambda client: True).client for _ in range(6)] == \
        ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("bad", [0, -1, 1001, True, "2"])
def test_a_weight_out_of_bounds_is_refused_naming_it(bad):
    async def main():
        pool, _, _, _ = make(warm={SPEC: 1})
        await pool.lending.lease(SPEC, "c", 5, weight=bad)
    with pytest.raises(ValueError, match="weight must be a number above 0"):
        run(main())
