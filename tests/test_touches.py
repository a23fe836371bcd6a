"""A process's touches: its calls note their leases, and one call per pool and round
tells the pool (sandman_ray.touches), off the calls' own path."""

import threading

from sandman_ray.touches import Touches


class FakeMethod:
    def __init__(self, pool):
        self.pool = pool

    def remote(self, leases):
        with self.pool.lock:
            self.pool.rounds.append(sorted(leases))
            self.pool.arrived.notify_all()


class FakePool:
    """A PoolActor handle's shape: ``_actor_id`` and ``touch_many.remote``."""

    def __init__(self, actor_id):
        self._actor_id = actor_id
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.rounds = []
        self.touch_many = FakeMethod(self)

    def wait_rounds(self, n, timeout=10.0):
        with self.lock:
            assert self.arrived.wait_for(lambda: len(self.rounds) >= n, timeout), self.rounds
            return list(self.rounds)


def test_the_leases_used_in_a_round_reach_their_pool_in_one_call():
    touches = Touches(every_s=0.2)
    a, b = FakePool("a"), FakePool("b")
    for _ in range(100):  # a hundred calls on two leases: one entry each
        touches.note(a, "L-1", "h1")
        touches.note(a, "L-2", "h1")
    touches.note(b, "L-3", None)
    assert a.wait_rounds(1) == [[("L-1", "h1"), ("L-2", "h1")]]
    assert b.wait_rounds(1) == [[("L-3", None)]]
    touches.note(a, "L-2", "h1")  # a later round, for what was used since
    assert a.wait_rounds(2)[1] == [("L-2", "h1")]


def test_a_process_that_notes_nothing_sends_nothing():
    touches = Touches(every_s=0.05)
    pool = FakePool("a")
    touches.note(pool, "L-1", "h1")
    pool.wait_rounds(1)
    with pool.lock:  # rounds come only for what was noted: the thread waits for a note
        assert not pool.arrived.wait_for(lambda: len(pool.rounds) > 1, 0.3)
